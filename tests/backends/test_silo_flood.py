"""An outsider with no certificate cannot stop a TLS run by holding connections: thousands of
idle connections from many addresses and a flood of handshakes without a certificate, against a
run whose processes may open only 1024 files (the limit at which FedML's server died). The run
finishes with the undisturbed model, the honest silos' messages are never refused, and every
refused connection is counted by reason."""

import csv
import json
import os
import resource
import shutil
import socket
import ssl
import threading
import time

import pytest
import torch

from fedml_perfedavg.fedml_bridge.cross_silo import TRAINING_STARTED
from fedml_perfedavg.net.gate import CONNECTION_REASONS
from fedml_perfedavg.run.config import load_yaml, resolve

from tests.helpers import (
    HF_YAML,
    assert_same_bits,
    drained,
    failure_tail,
    launch_silo,
    launched_threads,
    needs_mnist,
    single_process_at,
)

SETTINGS = {"client_num_per_round": 2, "frequency_of_the_test": 1, "show_progress": False, "beta": 0.05}


def _server_address(run_dir):
    with open(run_dir / "grpc_ipconfig.csv") as stream:
        row = next(r for r in csv.DictReader(stream) if r["rank"] == "0")
    return row["grpc_server_ip"], int(row["grpc_server_port"])


def _descriptors_to_spare() -> int:
    """How many sockets this test process may hold without starving itself: its own open-file
    limit (raised to 8192 where the hard limit allows) less what it has open and a margin of 512."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    in_use = len(os.listdir("/proc/self/fd"))
    return max(0, min(soft, 8192) - in_use - 512)


def _hold(address, stop, tally, sources=range(2, 120), per_source=40, period=1.0):
    """Idle connections from 118 addresses (127.0.0.2 ...), each trying 40 every ``period`` seconds,
    kept open and opened again when closed, until ``stop``. Never more than this process can spare:
    when the server stops accepting, unanswered connects stay open in SYN_SENT and would otherwise
    take every descriptor of the pytest worker (stop 65's CI: the worker's later tests failed with
    "Too many open files")."""
    held = []
    budget = _descriptors_to_spare()
    try:
        while not stop.is_set():
            for source in sources:
                for _ in range(per_source):
                    if len(held) >= budget:
                        break
                    try:
                        sock = socket.socket()
                    except OSError:
                        break
                    sock.setblocking(False)
                    try:
                        sock.bind((f"127.0.0.{source}", 0))
                        sock.connect_ex(address)
                    except OSError:
                        sock.close()
                        continue
                    held.append(sock)
                    tally["opened"] += 1
                if stop.is_set():
                    break
            tally["most_held"] = max(tally["most_held"], len(held))
            stop.wait(period)
            alive = []
            for sock in held:  # drop what the server closed, keep the rest
                try:
                    if sock.recv(1) == b"":
                        sock.close()
                        continue
                except BlockingIOError:
                    alive.append(sock)
                    continue
                except OSError:
                    sock.close()
                    continue
                alive.append(sock)
            held = alive
    finally:
        for sock in held:
            sock.close()


def _addresses(run_dir):
    """Every rank's (ip, port) from the address file launch-silo writes."""
    with open(run_dir / "grpc_ipconfig.csv") as stream:
        return [(row["grpc_server_ip"], int(row["grpc_server_port"])) for row in csv.DictReader(stream)]


def _listening(address) -> bool:
    try:
        socket.create_connection(address, timeout=0.5).close()
        return True
    except OSError:
        return False


def _handshakes(address, ca, stop, tally):
    """TLS handshakes without a client certificate, as fast as one thread makes them."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    while not stop.is_set():
        try:
            with socket.create_connection(address, timeout=2, source_address=("127.0.0.250", 0)) as raw:
                with context.wrap_socket(raw) as tls:
                    tls.recv(1)
        except (OSError, ssl.SSLError):
            pass
        tally["handshakes"] += 1


@needs_mnist
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to limit open files")
def test_thousands_of_idle_connections_and_a_handshake_flood_change_nothing(mnist_root, tmp_path):
    run_dir = tmp_path / "silo"
    rounds = 25
    # handshake_timeout 2 s (default 5): idle connections are cut within the run's few seconds
    process = launch_silo(
        run_dir,
        {**SETTINGS, "comm_round": rounds, "data_cache_dir": mnist_root, "handshake_timeout": 2},
        open_files=1024,
    )
    deadline = time.monotonic() + 120
    while not (
        (run_dir / "tls" / "ca.pem").exists()
        and (run_dir / "run.log").exists()
        and "round 0 starts" in (run_dir / "run.log").read_text()
    ):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    shutil.copy(run_dir / "tls" / "ca.pem", tmp_path / "ca.pem")
    address = _server_address(run_dir)
    stop, tally = threading.Event(), {"opened": 0, "most_held": 0, "handshakes": 0}
    attackers = [
        threading.Thread(target=_hold, args=(address, stop, tally), daemon=True),
        threading.Thread(target=_handshakes, args=(address, tmp_path / "ca.pem", stop, tally), daemon=True),
    ]
    for attacker in attackers:
        attacker.start()
    try:
        out, _ = process.communicate(timeout=400)
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join(timeout=30)
    assert process.returncode == 0, failure_tail(out)
    assert tally["opened"] > 3000 and tally["most_held"] > 1000 and tally["handshakes"] > 50, tally
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == rounds and "lost_silos" not in summary
    refusals = summary["refusals"]
    # at the caps: the idle longest closed for the newcomer (those left to their first-request
    # deadline are cut and named idle-connection); handshakes without a certificate: refused in the handshake
    assert refusals["evicted"] > 1000 and refusals["handshake"] > 0, refusals
    # the caps sit below what 1024 open files hold (3 descriptors a connection, 256 kept for the run)
    assert "connections capped at 14 per peer address and 256 in total" in out and "2.0 s to a first request" in out
    assert set(refusals) <= set(CONNECTION_REASONS)  # no message refused
    assert "Too many open files" not in out and "File descriptor limit" not in out
    assert "refused a message" not in out  # the honest silos' messages all went through
    config = resolve(
        load_yaml(HF_YAML),
        {**SETTINGS, "comm_round": rounds, "data_cache_dir": mnist_root, "simulation_engine": "fedml"},
    )
    sp = single_process_at(launched_threads(2), config, tmp_path / "sp")
    assert_same_bits(torch.load(run_dir / "model.pt", weights_only=True), sp.final_state)


@needs_mnist
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to limit open files")
def test_an_outsider_on_the_silos_own_address_holding_connections_from_the_start_changes_nothing(mnist_root, tmp_path):
    """Issue 43: the silos and the outsider share 127.0.0.1, so the caps per address are shared too;
    connections that never carried a request make room for those that will."""
    run_dir = tmp_path / "silo"
    rounds = 10
    settings = {**SETTINGS, "comm_round": rounds, "data_cache_dir": mnist_root}
    process = launch_silo(run_dir, settings, open_files=1024)
    output = drained(process)  # read as it comes: the test does not wait on the launcher's output
    deadline = time.monotonic() + 120
    while not ((run_dir / "grpc_ipconfig.csv").exists() and _listening(_server_address(run_dir))):
        assert time.monotonic() < deadline and process.poll() is None, failure_tail(output())
        time.sleep(0.01)
    stop, tallies = threading.Event(), []

    def hold_once_listening(address, tally):
        while not (stop.is_set() or _listening(address)):  # (before that it could take the port itself)
            time.sleep(0.01)
        _hold(address, stop, tally, sources=[1], per_source=300, period=0.1)

    for address in _addresses(run_dir):  # the server's port and each silo's, from the moment they listen
        tallies.append({"opened": 0, "most_held": 0})
        threading.Thread(target=hold_once_listening, args=(address, tallies[-1]), daemon=True).start()
    listening = time.monotonic()
    while process.poll() is None and TRAINING_STARTED not in (run_dir / "run.log").read_text():
        time.sleep(0.05)
    silos_in = time.monotonic() - listening
    try:
        process.wait(timeout=400)
    finally:
        stop.set()
    out = output()
    assert process.returncode == 0, failure_tail(out)
    # a heavy flood: 17,038 connections in a fresh-clone run on 5 workers (7dce9b9), 20,000 and more
    # before the processes started faster (the run, and so the flood, is shorter now)
    assert sum(t["opened"] for t in tallies) > 10000 and tallies[0]["most_held"] > 250, tallies
    assert silos_in < 30, silos_in  # the silos' start-up (imports, data) takes ~5 s here
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == rounds and "lost_silos" not in summary
    assert summary["refusals"]["evicted"] > 1000, summary["refusals"]
    assert "connections capped at 14 per peer address" in out and "refused a message" not in out
    print(f"every silo online {silos_in:.1f} s after the server listened; refusals", summary["refusals"], tallies)
    config = resolve(load_yaml(HF_YAML), {**settings, "simulation_engine": "fedml"})
    sp = single_process_at(launched_threads(2), config, tmp_path / "sp")
    assert_same_bits(torch.load(run_dir / "model.pt", weights_only=True), sp.final_state)


@needs_mnist
def test_a_second_process_with_a_silos_key_announcing_mid_run_takes_nothing_from_it(mnist_root, tmp_path):
    """Issue 44: a twin (another process holding silo 2's key) announced once, and 21 s later the
    original silo was locked out and recorded as lost. Now the original keeps its seat."""
    from fedml_perfedavg.net import wire

    from tests.helpers import raw_send

    run_dir = tmp_path / "silo"
    rounds = 150  # about 10 s of training here: the twin announces early in it
    settings = {**SETTINGS, "comm_round": rounds, "data_cache_dir": mnist_root, "frequency_of_the_test": 50}
    process = launch_silo(run_dir, settings)
    deadline = time.monotonic() + 120
    while not ((run_dir / "run.log").exists() and TRAINING_STARTED in (run_dir / "run.log").read_text()):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)  # well inside training (about 10 s of it), not at the instant the seats are taken
    server_pid = json.loads((run_dir / "silo_processes.json").read_text())["0"]
    command = open(f"/proc/{server_pid}/cmdline", "rb").read().split(b"\0")
    run_id = command[command.index(b"--run_id") + 1].decode()
    announcement = wire.encode(
        wire.Envelope(
            type=wire.CLIENT_STATUS,
            sender=2,
            receiver=0,
            run_id=run_id,
            round=0,
            seq=0,
            params={"client_status": "ONLINE"},
            session="twinprocess",
        )
    )
    tls = run_dir / "tls"
    assert (
        raw_send(_server_address(run_dir), announcement, tls, 2, tls) == __import__("grpc").StatusCode.PERMISSION_DENIED
    )
    out, _ = process.communicate(timeout=400)
    assert process.returncode == 0, failure_tail(out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == rounds and "lost_silos" not in summary
    assert summary["refusals"] == {"twin-session": 1}
    assert "announced itself from a second process (session twinprocess)" in out
