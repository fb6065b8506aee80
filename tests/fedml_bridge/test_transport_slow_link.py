"""A link on which each new connection waits before its bytes flow (a long, slow path between two
organizations, or a receiver too loaded to take its handshake at once): live cross-silo
transports on loopback with mutual TLS still deliver, as long as the wait is within the
receiver's handshake allowance (comm_args.handshake_timeout)."""

import socket
import threading
import time

import pytest
import torch

from fedml_perfedavg.net import wire
from fedml_perfedavg.net.addresses import write_ipconfig
from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.fedml_bridge.cross_silo.transport import PeerUnreachable, SecureGRPCCommManager

from fedml.core.distributed.communication.message import Message

from tests.helpers import transport_args


class SlowLink:
    """A TCP relay to ``target`` that holds each new connection ``delay`` seconds before relaying
    its bytes either way (whatever the sender sent meanwhile waits, as on a slow path)."""

    def __init__(self, target, delay: float) -> None:
        self.target, self.delay = target, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        time.sleep(self.delay)
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return

        def pipe(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(1 << 16):
                    sink.sendall(data)
            except OSError:
                pass
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pipe, args=(client, server), daemon=True).start()
        pipe(server, client)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def pair(tmp_path):
    make_certificates(str(tmp_path / "tls"), 1)
    path = write_ipconfig(str(tmp_path / "ip.csv"), 2)
    args = transport_args(
        tls_dir=str(tmp_path / "tls"), run_id="run-A", max_message_bytes=1 << 20, connect_timeout=5.0, round_idx=0
    )
    server = SecureGRPCCommManager(path, client_rank=0, client_num=1, args=args)
    silo = SecureGRPCCommManager(path, client_rank=1, client_num=1, args=args)
    yield server, silo
    server.stop_receive_message()
    silo.stop_receive_message()


def _model_message():
    message = Message(wire.SYNC_MODEL, 0, 1)
    message.add_params(wire.MODEL_KEY, {"w": torch.ones(3)})
    message.add_params("client_idx", "0")
    return message


def _received(transport, seconds=5.0):
    deadline = time.monotonic() + seconds
    while transport._queue.empty():
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.01)
    return transport._queue.get_nowait()


def _through_slow_link(pair, delay: float, seconds: float):
    """Send the server's model to the silo through a :class:`SlowLink` of ``delay``, within
    ``seconds``: (seconds it took, the link)."""
    server, silo = pair
    link = SlowLink(silo.addresses[1], delay)
    server.addresses[1] = link.address
    started = time.monotonic()
    try:
        server.send_message(_model_message(), deadline=started + seconds)
    finally:
        link.close()
    return time.monotonic() - started, link


def test_a_connection_whose_handshake_takes_longer_than_the_retry_backoff_still_delivers(pair):
    # gRPC abandons a connection attempt after its "min_reconnect_backoff"; at the backoff's 100 ms a
    # handshake slower than the 1 s backoff ceiling never finished, and every message failed.
    took, link = _through_slow_link(pair, delay=1.5, seconds=4.5)
    received = _received(pair[1])
    assert received.sender == 0 and torch.equal(received.model["w"], torch.ones(3))
    assert 1.5 <= took < 4.5, took
    assert link.connections == 1  # the first attempt waited; it was not abandoned and retried


def test_a_link_slower_than_the_send_deadline_is_unreachable_in_time(pair):
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match="did not take a message from rank 0 within 1.0 s"):
        _through_slow_link(pair, delay=3.0, seconds=1.0)
    assert time.monotonic() - started < 2.0
