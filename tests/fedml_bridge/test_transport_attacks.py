"""An outsider, and an insider with the wrong certificate, against live cross-silo transports on
loopback (a server, rank 0, and silo 1, with mutual TLS): what each attack sends, what is refused
and logged, and that nothing of it reaches the protocol while genuine messages still do."""

import logging
import pickle
import struct
from argparse import Namespace

import grpc
import pytest
import torch

from fedml_perfedavg.net import wire
from fedml_perfedavg.net.addresses import write_ipconfig
from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.fedml_bridge.cross_silo.transport import SecureGRPCCommManager
from fedml_perfedavg.core.errors import ConfigError

from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb2
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pb2_grpc
from fedml.core.distributed.communication.message import Message

from tests.helpers import certificate_from, reencode, transport_args
from tests.helpers import raw_send as send_raw

CAP = 64 * 1024
MODEL = {"w": torch.ones(4, 3), "b": torch.zeros(4)}


class WritesAFile:
    """A pickle that, once unpickled, writes a file: what FedML's own transport would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('owned')",))


@pytest.fixture
def world(tmp_path):
    tls, other = tmp_path / "tls", tmp_path / "other-ca"
    make_certificates(str(tls), 2)
    make_certificates(str(other), 2)
    path = write_ipconfig(str(tmp_path / "ip.csv"), 3)
    args = transport_args(tls_dir=str(tls), run_id="run-A", max_message_bytes=CAP, connect_timeout=5.0, round_idx=0)
    server = SecureGRPCCommManager(path, client_rank=0, client_num=2, args=args)
    silo = SecureGRPCCommManager(path, client_rank=1, client_num=2, args=args)
    yield Namespace(tls=tls, other=other, server=server, silo=silo, marker=tmp_path / "owned", path=path)
    server.stop_receive_message()
    silo.stop_receive_message()


def raw_send(transport, data, tls_dir=None, as_rank=None, ca_dir=None):
    return send_raw(transport.addresses[transport.rank], data, tls_dir, as_rank, ca_dir, to_rank=transport.rank)


def _encoded(kind, sender, receiver, seq=1000, run_id="run-A", reply_to=-1, model=None, **params):
    return wire.encode(
        wire.Envelope(
            type=kind,
            sender=sender,
            receiver=receiver,
            run_id=run_id,
            round=0,
            seq=seq,
            params=params,
            model=model,
            reply_to=reply_to,
        )
    )


def _drain(transport):
    out = []
    while not transport._queue.empty():
        out.append(transport._queue.get_nowait())
    return out


def _model_to_silo(world):
    message = Message(wire.SYNC_MODEL, 0, 1)
    message.add_params(wire.MODEL_KEY, MODEL)
    message.add_params("client_idx", "7")
    world.server.send_message(message)
    [received] = _drain(world.silo)
    return received


def _upload_from_silo(world):
    message = Message(wire.UPLOAD, 1, 0)
    message.add_params(wire.MODEL_KEY, {k: v + 1 for k, v in MODEL.items()})
    message.add_params("num_samples", 40)
    world.silo.send_message(message)


def test_genuine_messages_go_both_ways(world):
    received = _model_to_silo(world)
    assert received.sender == 0 and received.params == {"client_idx": "7"}
    assert torch.equal(received.model["w"], MODEL["w"])
    _upload_from_silo(world)
    [upload] = _drain(world.server)
    assert upload.sender == 1 and upload.reply_to == received.seq and torch.equal(upload.model["w"], MODEL["w"] + 1)


def test_a_pickle_sent_to_every_port_runs_nothing(world, caplog):
    payload = pickle.dumps(WritesAFile(world.marker))
    for transport in (world.server, world.silo):
        # An outsider: plaintext, and TLS without a client certificate; both end in the handshake.
        assert raw_send(transport, payload) == grpc.StatusCode.UNAVAILABLE
        assert raw_send(transport, payload, ca_dir=world.tls) == grpc.StatusCode.UNAVAILABLE
    # An insider with a valid certificate gets through TLS, and the bytes are refused undecoded.
    with caplog.at_level(logging.WARNING):
        assert raw_send(world.server, payload, world.tls, 2, world.tls) == grpc.StatusCode.PERMISSION_DENIED
    assert "rank 0 refused a message from 127.0.0.1:" in caplog.text and "(a pickle" in caplog.text
    # The outsiders' connections are named too, with their addresses: plaintext to a TLS port, and a
    # TLS handshake without a client certificate.
    _eventually(lambda: caplog.text.count("rank 0 refused a connection from 127.0.0.1:") == 2)  # (lines after counts)
    assert world.server.refusals.totals["not-tls"] == 1 and world.server.refusals.totals["handshake"] == 1
    assert world.server.refusals.totals["pickle"] == 1
    assert not world.marker.exists()
    assert _drain(world.server) == [] and _drain(world.silo) == []
    assert world.server.rejected == 1


def test_an_insecure_transport_still_never_unpickles(tmp_path, caplog):
    path = write_ipconfig(str(tmp_path / "ip.csv"), 2)
    server = SecureGRPCCommManager(
        path, client_rank=0, client_num=1, args=transport_args(insecure=True, run_id="r", max_message_bytes=CAP)
    )
    try:
        with caplog.at_level(logging.WARNING):
            assert raw_send(server, pickle.dumps(WritesAFile(tmp_path / "owned"))) == grpc.StatusCode.PERMISSION_DENIED
        assert not (tmp_path / "owned").exists() and _drain(server) == []
        assert "refused a message" in caplog.text
    finally:
        server.stop_receive_message()


def test_no_tls_and_no_insecure_flag_refuses_to_start(tmp_path):
    from fedml_perfedavg.fedml_bridge.bootstrap import TRANSPORT_VALUES

    path = write_ipconfig(str(tmp_path / "ip.csv"), 2)
    with pytest.raises(ConfigError, match="does not start without TLS.*fedml-perfedavg certs --out DIR"):
        transport_args(run_id="r")  # fedml.init's check
    # the transport's own, whatever values it is handed
    plain = vars(transport_args(run_id="r", insecure=True))[TRANSPORT_VALUES]
    args = Namespace(run_id="r", **{TRANSPORT_VALUES: {**plain, "insecure": False}})
    with pytest.raises(ConfigError, match="does not start without TLS"):
        SecureGRPCCommManager(path, client_rank=0, client_num=1, args=args)
    with pytest.raises(ConfigError, match=r"reads its comm_args from FedML's args .*call fedml.init\(args\) first"):
        SecureGRPCCommManager(path, client_rank=0, client_num=1, args=Namespace(run_id="r", insecure=True))


def test_silo_two_cannot_speak_for_silo_one_or_the_server(world, caplog):
    status = _encoded(wire.CLIENT_STATUS, sender=1, receiver=0, client_status="ONLINE")
    finish_as_server = _encoded(wire.FINISH, sender=0, receiver=1, client_idx="0")
    finish_as_itself = _encoded(wire.FINISH, sender=2, receiver=1, client_idx="0")
    with caplog.at_level(logging.WARNING):
        assert raw_send(world.server, status, world.tls, 2, world.tls) == grpc.StatusCode.PERMISSION_DENIED
        assert raw_send(world.silo, finish_as_server, world.tls, 2, world.tls) == grpc.StatusCode.PERMISSION_DENIED
        assert raw_send(world.silo, finish_as_itself, world.tls, 2, world.tls) == grpc.StatusCode.PERMISSION_DENIED
    assert "claims sender rank 1, but the peer's certificate is rank 2's" in caplog.text
    assert "claims sender rank 0, but the peer's certificate is rank 2's" in caplog.text
    assert "a silo takes messages from the server (rank 0) only; got type 7 from rank 2" in caplog.text
    assert _drain(world.server) == [] and _drain(world.silo) == []
    # The server's own certificate may tell a silo to finish.
    assert raw_send(world.silo, finish_as_server, world.tls, 0, world.tls) == "delivered"
    assert [m.type for m in _drain(world.silo)] == [wire.FINISH]


def test_a_certificate_from_another_ca_is_refused_in_the_handshake(world):
    status = _encoded(wire.CLIENT_STATUS, sender=1, receiver=0, client_status="ONLINE")
    # its own CA's root: it cannot even trust the server; the run's root: the server refuses its certificate
    assert raw_send(world.server, status, world.other, 1, world.other) == grpc.StatusCode.UNAVAILABLE
    assert raw_send(world.server, status, world.other, 1, world.tls) == grpc.StatusCode.UNAVAILABLE
    assert _drain(world.server) == []


def test_messages_over_the_size_cap_are_refused(world, caplog):
    _model_to_silo(world)
    big = {"w": torch.zeros(CAP // 4)}  # just over the cap once encoded
    huge = {"w": torch.zeros(CAP)}  # 4 x the cap: gRPC refuses it before reading it
    with caplog.at_level(logging.WARNING):
        assert (
            raw_send(
                world.server, _encoded(wire.UPLOAD, 1, 0, model=big, num_samples=1, reply_to=0), world.tls, 1, world.tls
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
    assert f"over the size cap of {CAP}" in caplog.text
    assert (
        raw_send(
            world.server, _encoded(wire.UPLOAD, 1, 0, model=huge, num_samples=1, reply_to=0), world.tls, 1, world.tls
        )
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert _drain(world.server) == []


def test_replays_other_runs_and_second_uploads_are_dropped(world, caplog):
    sent = []
    original = world.silo.delivery.send
    world.silo.delivery.send = lambda receiver, data, *args, **kwargs: (
        sent.append(data),
        original(receiver, data, *args, **kwargs),
    )[1]
    _model_to_silo(world)
    _upload_from_silo(world)
    assert len(_drain(world.server)) == 1
    with caplog.at_level(logging.WARNING):
        # the very bytes again (as one who recorded them would send them)
        assert raw_send(world.server, sent[0], world.tls, 1, world.tls) == grpc.StatusCode.PERMISSION_DENIED
        # a second upload in the same round, with a new sequence number
        _upload_from_silo(world)
        # an upload for another run
        other_run = _encoded(wire.UPLOAD, 1, 0, seq=10**6, run_id="run-B", model=MODEL, num_samples=1, reply_to=0)
        assert raw_send(world.server, other_run, world.tls, 1, world.tls) == grpc.StatusCode.PERMISSION_DENIED
    assert "is a replay (sequence 0, already at 0)" in caplog.text
    assert "answers no open model (a round already closed, or a second upload in one round)" in caplog.text
    assert "is for run 'run-B', not this run ('run-A')" in caplog.text
    assert _drain(world.server) == []
    # The next round's model opens the next upload.
    _model_to_silo(world)
    _upload_from_silo(world)
    assert len(_drain(world.server)) == 1


@pytest.mark.parametrize(
    "bad,problem",
    [
        ({"w": torch.ones(3, 4), "b": torch.zeros(4)}, "shape/dtype"),
        ({"w": torch.full((4, 3), float("nan")), "b": torch.zeros(4)}, "non-finite"),
        ({"w": torch.full((4, 3), 1e6), "b": torch.zeros(4)}, "exceeds train_args.max_update_norm"),
    ],
)
def test_a_silos_own_bad_model_is_delivered_and_rejected_by_the_update_checks(world, bad, problem):
    """A certificate proves who sent a model, not that the model is good: that is the update
    checks' part (wrong shape, NaN, a huge norm), as for any client."""
    from fedml_perfedavg.core.guards import update_problem

    _model_to_silo(world)
    message = Message(wire.UPLOAD, 1, 0)
    message.add_params(wire.MODEL_KEY, bad)
    message.add_params("num_samples", 40)
    world.silo.send_message(message)
    [upload] = _drain(world.server)
    assert problem in update_problem(dict(upload.model), MODEL, max_update_norm=100.0)


def test_an_upload_may_answer_an_earlier_model_still_open_but_only_once(world, caplog):
    """FedML's own server sends a silo its first model twice when the silo reports online twice;
    the silo answers the first. That answer is taken, and closes both."""
    first = _model_to_silo(world)
    second = _model_to_silo(world)
    message = Message(wire.UPLOAD, 1, 0)
    message.add_params(wire.MODEL_KEY, MODEL)
    message.add_params("num_samples", 40)
    world.silo.conversations.last_model = (first.seq, first.round)  # the silo answers the model it trained on
    world.silo.send_message(message)
    assert [u.reply_to for u in _drain(world.server)] == [first.seq]
    world.silo.conversations.last_model = (second.seq, second.round)
    with caplog.at_level(logging.WARNING):
        world.silo.send_message(message)
    assert _drain(world.server) == [] and "answers no open model" in caplog.text


def test_a_header_nested_20000_deep_is_a_counted_refusal_not_an_error(world, caplog):
    nested = wire.MAGIC + struct.pack(">I", 40_000) + b"[" * 20_000 + b"]" * 20_000
    with caplog.at_level(logging.WARNING):
        assert raw_send(world.server, nested, world.tls, 2, world.tls) == grpc.StatusCode.PERMISSION_DENIED
    assert "more than 256 brackets" in caplog.text and world.server.refusals.totals["malformed"] == 1


def test_a_flood_of_refused_messages_writes_a_few_lines_and_counts_them_all(world, caplog):
    """600 bad messages with a 60 KB field from an insider: every one refused and counted, a few
    lines logged, each cut short (FedML-era code wrote 36.8 MB/s of log for this)."""
    flood = reencode(
        _encoded(wire.CLIENT_STATUS, 2, 0, client_status="ONLINE"), lambda h: h.update(run_id="x" * 60_000)
    )
    sent = 0
    with caplog.at_level(logging.WARNING):
        channel, stub = _insider_stub(world, 2)
        for _ in range(600):
            try:
                stub.sendMessage(pb2.CommRequest(client_id=2, message=flood), timeout=5)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
                sent += 1
        channel.close()
    lines = [r.getMessage() for r in caplog.records if "refused a message" in r.getMessage()]
    assert sent == 600 and world.server.refusals.totals["malformed"] == 600
    assert len(lines) <= 3 and sum(len(line) for line in lines) < 2000, lines


def test_a_silo_that_restarts_opens_a_new_session_and_its_old_one_is_refused(world, caplog):
    _model_to_silo(world)
    old_status = _encoded(wire.CLIENT_STATUS, 1, 0, seq=5000, client_status="FINISHED")
    # a new process of silo 1: its first message must be its announcement
    other = _encoded(wire.CLIENT_STATUS, 1, 0, seq=0, client_status="FINISHED")
    other_session = _with_session(other, "newprocess1")
    hello = _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=0, client_status="ONLINE"), "newprocess1")
    with caplog.at_level(logging.WARNING):
        assert raw_send(world.server, _with_session(old_status, "firstprocess"), world.tls, 1, world.tls) == "delivered"
        assert raw_send(world.server, other_session, world.tls, 1, world.tls) == grpc.StatusCode.PERMISSION_DENIED
        assert raw_send(world.server, hello, world.tls, 1, world.tls) == "delivered"
        assert (
            raw_send(
                world.server,
                _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=6000, client_status="FINISHED"), "firstprocess"),
                world.tls,
                1,
                world.tls,
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
    assert "comes from another process of that rank (session newprocess1" in caplog.text
    assert "a silo's new process must announce itself first" in caplog.text
    assert "comes from an earlier process of that rank (session firstprocess)" in caplog.text
    assert [m.session for m in _drain(world.server)] == ["firstprocess", "newprocess1"]
    assert world.server.refusals.totals == {"session": 1, "replay": 1}


def test_a_certificate_whose_key_usage_excludes_clients_is_refused(world, tmp_path, caplog):
    from cryptography.x509.oid import ExtendedKeyUsageOID

    signing = tmp_path / "signing"
    signing.mkdir()
    certificate_from(world.tls, signing, [ExtendedKeyUsageOID.CODE_SIGNING])  # rank 1's name, the run's CA
    status = _encoded(wire.CLIENT_STATUS, 1, 0, client_status="ONLINE")
    with caplog.at_level(logging.WARNING):
        code = raw_send(world.server, status, signing, 1, world.tls)
        # gRPC's TLS refuses it in the handshake ("unsupported certificate purpose"), and the gate
        # names the connection as it closes (the count comes just before the line: wait for the line);
        # had it let it through, the transport's own check would refuse the message
        # (peer_certificate_problem, tested in test_credentials.py).
        _eventually(lambda: "TLS handshake failed" in caplog.text)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert world.server.refusals.totals["handshake"] == 1
    assert _drain(world.server) == []


def test_a_second_process_with_a_seated_silos_key_cannot_take_its_seat_until_it_is_given_up_on(world, caplog):
    """Issue 44: a twin that announced once locked the original silo out (its session was retired)."""
    _model_to_silo(world)
    first = _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=5000, client_status="FINISHED"), "firstprocess")
    assert raw_send(world.server, first, world.tls, 1, world.tls) == "delivered"
    world.server.conversations.hold_seats({1, 2})  # training: silo 1's process takes part
    twin = _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=0, client_status="ONLINE"), "twin")
    with caplog.at_level(logging.WARNING):
        assert raw_send(world.server, twin, world.tls, 1, world.tls) == grpc.StatusCode.PERMISSION_DENIED
    assert "announced itself from a second process (session twin) while its process (session firstprocess)" in (
        caplog.text
    )
    again = _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=5001, client_status="FINISHED"), "firstprocess")
    assert raw_send(world.server, again, world.tls, 1, world.tls) == "delivered"  # the original goes on
    world.server.conversations.hold_seats({2})  # silo 1 missed a deadline: given up on
    later = _with_session(_encoded(wire.CLIENT_STATUS, 1, 0, seq=1, client_status="ONLINE"), "twin")
    assert raw_send(world.server, later, world.tls, 1, world.tls) == "delivered"  # now a new process may take over
    assert [m.session for m in _drain(world.server)] == ["firstprocess", "firstprocess", "twin"]
    assert world.server.refusals.totals == {"twin-session": 1}


def _eventually(predicate, seconds=3.0):
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _with_session(data: bytes, session: str) -> bytes:
    return reencode(data, lambda header: header.update(session=session))


def _insider_stub(world, rank):
    from fedml_perfedavg.net.credentials import rank_name

    read = lambda name: (world.tls / name).read_bytes()  # noqa: E731
    channel = grpc.secure_channel(
        "%s:%d" % world.server.addresses[0],
        grpc.ssl_channel_credentials(read("ca.pem"), read(f"rank-{rank}.key"), read(f"rank-{rank}.pem")),
        options=[("grpc.ssl_target_name_override", rank_name(0))],
    )
    return channel, pb2_grpc.gRPCCommManagerStub(channel)


def test_the_managers_deadlines_tick_on_time_under_a_steady_stream_of_messages(world):
    """A peer that keeps the queue from ever being empty must not stop the deadline ticks
    (before: they came only when the queue was empty, so a flood held every deadline back)."""
    import threading
    import time

    ticks, received = [], []

    class Observer:
        def receive_message(self, kind, message):
            received.append(kind)
            time.sleep(0.01)

        def on_idle(self):
            ticks.append(time.monotonic())

    server = world.server
    server.add_observer(Observer())
    envelope = wire.decode(_encoded(wire.CLIENT_STATUS, 1, 0, client_status="ONLINE"), CAP)
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            server._queue.put(envelope)
            time.sleep(0.002)

    feeder = threading.Thread(target=flood, daemon=True)
    feeder.start()
    loop = threading.Thread(target=server.message_handling_subroutine, daemon=True)
    started = time.monotonic()
    loop.start()
    time.sleep(2.0)
    stop.set()
    server.is_running = False
    loop.join(2.0)
    feeder.join(1.0)
    assert len(received) > 100 and server._queue.qsize() > 0  # the queue was never empty
    gaps = [b - a for a, b in zip([started, *ticks], ticks)]
    assert len(ticks) >= 6 and max(gaps) < 0.5
    server.is_running = True  # the fixture stops it properly


def test_grpc_behind_the_gate_listens_on_a_unix_socket_only_this_user_can_reach(world):
    """Issue 44: gRPC behind the gate listened on a loopback TCP port, which any local process could
    flood (it stopped a run at round 0). Now the only TCP ports are the gates' own."""
    import os
    import stat
    import subprocess

    for transport in (world.server, world.silo):
        backend = transport.gate.backend
        assert stat.S_ISSOCK(os.stat(backend.path).st_mode)
        assert stat.S_IMODE(os.stat(backend.directory).st_mode) == 0o700
    listening = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True).stdout
    ours = {int(line.split()[3].rsplit(":", 1)[1]) for line in listening.splitlines() if f"pid={os.getpid()}," in line}
    assert ours == {world.server.addresses[0][1], world.silo.addresses[1][1]}, listening
    assert _model_to_silo(world).type == wire.SYNC_MODEL  # through the gate to gRPC, as before
    assert world.silo.refusals.totals == {}
    # gRPC names the request's peer by the gate's socket (unix:PATH): matched to its connection, which
    # then counts as past its handshake (issue 43)
    assert any(c.requests > 0 and not c.waiting for c in world.silo.gate.book.connections())
    server_dir = world.server.gate.backend.directory
    world.server.stop_receive_message()
    assert not os.path.exists(server_dir)  # removed with the gate


def test_a_refused_connection_from_an_organizations_host_names_its_rank():
    """The WARNING of a refused connection says whose row of the address file the host is (a silo
    with another run's CA is named when its handshake fails); on a shared host it says nothing."""
    from types import SimpleNamespace

    rows = {0: ("198.18.1.1", 1), 1: ("198.18.1.2", 2), 2: ("198.18.2.2", 3), 3: ("198.18.2.2", 4)}
    server = SimpleNamespace(rank=0, addresses=rows)
    assert SecureGRPCCommManager._rows_at(server, "198.18.1.2") == " (the address file's row of rank 1)"
    assert SecureGRPCCommManager._rows_at(server, "198.18.2.2") == " (the address file's rows of ranks [2, 3])"
    assert SecureGRPCCommManager._rows_at(server, "203.0.113.9") == ""  # nobody's row
    loopback = SimpleNamespace(rank=0, addresses={r: ("127.0.0.1", r) for r in range(3)})
    assert SecureGRPCCommManager._rows_at(loopback, "127.0.0.1") == ""  # every rank there: no one named
