"""The gate in front of a cross-silo port: connections capped per peer address and in total, a
deadline for the first request, and every connection it refuses or cuts named and counted; the
refusal log that no peer can flood."""

import logging
import socket
import time

import pytest

from fedml_perfedavg.net.gate import Backend, Gate, GateLimits, PortTaken
from fedml_perfedavg.net.refusals import BURST, REPORT_SECONDS, WINDOW_SECONDS, RefusalLog


class Echo:
    """A backend that echoes what it gets (stands in for gRPC behind the gate), on the gate's
    Unix socket."""

    def __init__(self):
        import threading

        self.backend = Backend()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.backend.path)
        self.sock.listen(64)
        self.peers = []
        self.running = True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import threading

        while self.running:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer)  # the gate's side: the name gRPC would know the peer by
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                conn.sendall(data)

    def close(self):
        self.running = False
        self.sock.close()


@pytest.fixture
def gate():
    backend = Echo()
    refused = []
    limits = GateLimits(per_peer=3, total=5, first_request_seconds=1.0, idle_seconds=30.0, tls=True)
    door = Gate(
        ("127.0.0.1", 0), backend.backend, limits, lambda host, port, reason, text: refused.append((host, reason, text))
    )
    door.start()
    door.address = ("127.0.0.1", door.port)
    door.refused = refused
    door.echo = backend
    yield door
    door.stop()
    backend.close()


def _connect(address, source="127.0.0.1"):
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(5)
    sock.connect(tuple(address))
    return sock


def _closed(sock, within=5.0) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _wait(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_bytes_pass_both_ways_untouched(gate):
    sock = _connect(gate.address)
    sock.sendall(b"\x16\x03\x01hello")
    assert sock.recv(100) == b"\x16\x03\x01hello"
    sock.close()


def _echoes(sock, data=b"\x16ok") -> bool:
    try:
        sock.sendall(data)
        return sock.recv(10) == data
    except OSError:
        return False


def _authenticated(gate, source):
    """A connection from ``source`` that carried a request, as the transport tells the gate when
    one reaches gRPC."""
    sock = _connect(gate.address, source)
    assert _echoes(sock)  # through the gate: the backend has taken it
    gate.note_request(f"unix:{gate.echo.peers[-1]}")
    assert _echoes(sock)  # bytes after the request: the gate sees it is no longer waiting
    return sock


def test_one_address_holds_its_share_of_waiting_connections_and_a_newcomer_closes_the_idle_longest(gate):
    held = [_connect(gate.address, "127.0.0.2") for _ in range(3)]
    _wait(lambda: gate.open_connections == 3)
    newcomer = _connect(gate.address, "127.0.0.2")
    assert _echoes(newcomer)  # served: the cap per address made room
    assert _closed(held[0], 2.0) and not _closed(held[1], 0.2)  # the idle longest went, the others stay
    _wait(lambda: gate.refused)
    assert [r[:2] for r in gate.refused] == [("127.0.0.2", "evicted")]
    assert "to make room for a newcomer from 127.0.0.2" in gate.refused[0][2]
    assert gate.open_connections == 3
    for sock in held + [newcomer]:
        sock.close()


def test_a_waiting_connection_that_moved_bytes_lately_is_not_the_one_closed(gate):
    first, second, third = (_connect(gate.address, "127.0.0.2") for _ in range(3))
    _wait(lambda: gate.open_connections == 3)
    assert _echoes(first)  # a handshake under way: now the idle longest is the second
    newcomer = _connect(gate.address, "127.0.0.2")
    assert _closed(second, 2.0) and _echoes(first) and _echoes(newcomer) and _echoes(third)
    for sock in (first, second, third, newcomer):
        sock.close()


def test_connections_past_their_handshake_do_not_count_against_an_address_and_are_never_closed_for_room(gate):
    silos = [_authenticated(gate, "127.0.0.1") for _ in range(3)]
    outsiders = [_connect(gate.address, "127.0.0.1") for _ in range(2)]  # the same address: still let in
    _wait(lambda: gate.open_connections == 5)
    assert all(_echoes(sock) for sock in outsiders)
    # The total cap (5) is reached: a newcomer closes the idle-longest waiting connection, never a silo's
    late = _connect(gate.address, "127.0.0.1")
    assert _closed(outsiders[0], 2.0) and _echoes(late) and all(_echoes(sock) for sock in silos)
    assert [r[1] for r in gate.refused] == ["evicted"]
    for sock in silos + outsiders + [late]:
        sock.close()


def test_the_total_cap_holds_whatever_the_addresses(gate):
    held = [_authenticated(gate, f"127.0.0.{i}") for i in range(2, 7)]
    _wait(lambda: gate.open_connections == 5)
    extra = _connect(gate.address, "127.0.0.9")
    assert _closed(extra, 2.0)  # nothing waiting to close for it: the newcomer goes
    _wait(lambda: gate.refused)
    assert gate.refused[-1][1] == "connection-cap"
    assert "the cap in total (comm_args.max_connections), every one past its handshake" in gate.refused[-1][2]
    assert all(_echoes(sock) for sock in held)
    for sock in held + [extra]:
        sock.close()


@pytest.mark.parametrize(
    "sent,reason", [(b"", "idle-connection"), (b"PRI * HTTP/2.0", "not-tls"), (b"\x16\x03\x01\x00", "handshake")]
)
def test_a_connection_without_a_request_is_cut_at_its_deadline_and_named(gate, sent, reason):
    sock = _connect(gate.address, "127.0.0.3")
    if sent:
        sock.sendall(sent)
        sock.recv(100)
    started = time.monotonic()
    assert _closed(sock, 5.0)
    assert 0.5 < time.monotonic() - started < 3.0  # the first-request deadline (1 s), swept every 0.25 s
    _wait(lambda: gate.refused)
    host, why, text = gate.refused[-1]
    assert (host, why) == ("127.0.0.3", reason) and "closed without a request" in text


def test_the_public_port_is_exclusive():
    backend = Echo()
    limits = GateLimits(per_peer=3, total=5, first_request_seconds=1.0, idle_seconds=30.0)
    first = Gate(("127.0.0.1", 0), backend.backend, limits, lambda *a: None)
    first.start()
    port = first.port
    try:
        with pytest.raises(PortTaken, match=f"127.0.0.1:{port}"):
            Gate(("127.0.0.1", port), Backend(), limits, lambda *a: None).start()
    finally:
        first.stop()
        backend.close()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_refusals_are_counted_all_but_logged_a_few_per_peer_and_reason(caplog):
    clock = Clock()
    log = RefusalLog(0, logging.getLogger("test.refusals"), clock)
    flood = "x" * 60_000
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(600):
            log.refuse("10.9.9.9", "malformed", f"field {flood}")
        log.refuse("10.9.9.8", "malformed", "other peer")
        log.refuse("10.9.9.9", "replay", "other reason")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == BURST + 2
    assert all(len(line) < 500 for line in lines)  # fields cut: 600 x 60 KB would be 36 MB of log
    assert log.totals == {"malformed": 601, "replay": 1}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        log.tick()  # not yet time for the report
        clock.now += WINDOW_SECONDS
        log.refuse("10.9.9.9", "malformed", "again")  # one line per window after the burst
        clock.now += REPORT_SECONDS
        log.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "again" in lines[0]
    assert f"{600 - BURST} more refusals in the last" in lines[1]
    assert "totals so far: {'malformed': 602, 'replay': 1}" in lines[1]


def test_refusals_from_rotating_addresses_share_one_log_budget(caplog):
    """Issue 44: 20,000 source addresses wrote 5.2 MB of refusal lines; now at most GLOBAL_LINES a window."""
    from fedml_perfedavg.net.refusals import GLOBAL_LINES

    clock = Clock()
    log = RefusalLog(0, logging.getLogger("test.refusals"), clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for i in range(20_000):
            log.refuse(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", "connection-cap", "over the cap")
        clock.now += WINDOW_SECONDS
        log.refuse("10.200.0.1", "connection-cap", "the next window")
        clock.now += REPORT_SECONDS
        log.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == GLOBAL_LINES + 2 and "the next window" in lines[-2]
    assert f"{20_000 - GLOBAL_LINES} more refusals" in lines[-1]
    assert log.totals == {"connection-cap": 20_001}
    assert sum(len(line) for line in lines) < 20_000  # 20,000 addresses: kilobytes, not megabytes
