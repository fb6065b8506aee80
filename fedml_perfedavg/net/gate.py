"""The door in front of a cross-silo port: connections are counted and bounded before any TLS.

gRPC accepts every TCP connection and keeps it until its TLS handshake ends or times out (120 s
by default), with no cap per peer or in total: an outsider with no certificate who holds
thousands of idle connections exhausts the process's file descriptors, and the run dies
(``Too many open files``) or an honest silo cannot get in. gRPC's Python API offers no hook
before the handshake, so the port a peer reaches is this gate's: it accepts, applies

- a cap on concurrent connections per peer address and in total. Only connections that have not
  yet carried a request count against the cap per address: one that has is past mutual TLS (a
  silo's), and an outsider who shares a silo's address (a NAT, a cloud egress) cannot take its share.
  At a cap, room is made by closing a waiting connection (no request yet): the oldest that has
  sent nothing, else the one idle longest, so a silo mid-handshake is not the one closed for
  connections that sit there; only when every connection in the way is past its handshake is the
  newcomer closed at once. Either is counted,
- a deadline for a connection's first request (the TLS handshake and gRPC's preface included),
- an idle limit once it has carried requests,

and forwards the bytes, untouched, to the process's gRPC server on a Unix socket in a directory
only this user can enter (:class:`Backend`): no other process reaches gRPC but through the gate,
and no TCP port is left for a local flood. TLS is still end to end: the gate holds no key and
reads nothing but the first byte. A connection
that closes without ever carrying a request (a failed or abandoned handshake, plaintext to a TLS
port, an idle one cut at its deadline) is reported with its peer's address to ``on_refusal``,
which the transport rate-limits and counts.

The gate runs an ``asyncio`` loop in one daemon thread per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

CONNECTION_CAP, HANDSHAKE, PLAINTEXT, IDLE = "connection-cap", "handshake", "not-tls", "idle-connection"
EVICTED = "evicted"  # a waiting connection closed to make room for a newcomer
DESCRIPTORS = "descriptors"
#: What a refusal of a connection (not of a message) is counted as.
CONNECTION_REASONS = (CONNECTION_CAP, HANDSHAKE, PLAINTEXT, IDLE, EVICTED, DESCRIPTORS)
_SWEEP_SECONDS = 0.25
_CHUNK = 1 << 20
# A TLS handshake (hello, certificates, finished) takes a few KB each way; a connection that sent more
# than this is carrying a message (a large model over a slow link may take longer than the first-request
# deadline to arrive whole) and is held to the idle limit instead. gRPC's own handshake deadline still
# ends a handshake that never completes, whatever was sent.
HANDSHAKE_BYTES = 64 * 1024
# How far into the waiting queue a search for a silent connection to close goes (a bound per accept).
_VICTIM_SCAN = 64


@dataclass(frozen=True)
class GateLimits:
    """How many connections a port holds and for how long (see the module doc)."""

    per_peer: int  # concurrent connections from one address
    total: int  # concurrent connections in all
    first_request_seconds: float  # from accept to the first request that reached the servicer
    idle_seconds: float  # no bytes either way, after a request
    tls: bool = True  # what the first bytes must look like


@dataclass
class _Connection:
    host: str
    port: int
    opened: float
    last_activity: float
    requests: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    first_byte: Optional[int] = None
    closing: bool = False
    evicted: bool = False
    raw: Optional[socket.socket] = None  # the accepted socket, until asyncio holds it
    writers: list = field(default_factory=list)

    def close(self) -> None:
        """Both sides go at once (what was buffered is dropped)."""
        self.closing = True
        if not self.writers and self.raw is not None:
            self.raw.close()  # its handler has not taken it yet: the descriptor goes now
        for writer in self.writers:
            try:
                writer.transport.abort()
            except Exception:  # noqa: BLE001 - already closed
                pass

    @property
    def waiting(self) -> bool:
        """No request yet, nor a message under way: not known to hold a certificate, so it may be
        closed to make room (see :meth:`ConnectionBook.make_room`)."""
        return self.requests == 0 and self.bytes_in < HANDSHAKE_BYTES

    def refusal(self, tls: bool) -> Tuple[str, str]:
        """(reason, text) for a connection that closed without carrying a request."""
        lasted = time.monotonic() - self.opened
        traffic = f"{self.bytes_in} bytes in, {self.bytes_out} out, {lasted:.2f} s"
        if self.bytes_in == 0:
            reason, what = IDLE, "sent nothing"
        elif tls and self.first_byte != 0x16:
            reason, what = PLAINTEXT, "did not start a TLS handshake (plaintext to a TLS port?)"
        elif tls:
            reason, what = (
                HANDSHAKE,
                "TLS handshake failed or was not finished in time (no client certificate from the run's CA?)",
            )
        else:
            reason, what = HANDSHAKE, "made no request in time"
        return reason, f"connection closed without a request: {what} ({traffic})"


class ConnectionBook:
    """The gate's open connections: counted per peer address and in total within ``limits``,
    found again from gRPC's side of them, and due to close at their deadlines (the module doc).
    Used from the gate's thread only (a request noted from gRPC's threads only raises a count,
    which the book reads lazily)."""

    def __init__(self, limits: GateLimits) -> None:
        self.limits = limits
        self._open: Dict[int, _Connection] = {}  # id -> connection
        # The waiting connections, idle longest first, in all and per address. An entry whose
        # connection has since carried a request is dropped when it is met (see _oldest_waiting).
        self._waiting: "OrderedDict[int, _Connection]" = OrderedDict()
        self._waiting_from: Dict[str, "OrderedDict[int, _Connection]"] = {}
        self._by_backend_name: Dict[str, _Connection] = {}
        self.accepted = 0
        self.most_open = 0  # the highest number of concurrent connections seen

    def __len__(self) -> int:
        return len(self._open)

    def connections(self) -> List[_Connection]:
        return list(self._open.values())

    def make_room(self, host: str) -> Tuple[List[_Connection], Optional[str]]:
        """Room for one more connection from ``host``: (the waiting connections to close for it,
        already released from the book; None, or why the newcomer itself must be closed: the
        connections in the way have all carried requests)."""
        closing: List[_Connection] = []
        from_host = self._waiting_from.get(host)
        while from_host is not None and len(from_host) >= self.limits.per_peer:
            victim = self._oldest_waiting(from_host)
            if victim is None:
                break
            closing.append(self._evict(victim))
        if len(self._open) >= self.limits.total:
            victim = self._oldest_waiting(self._waiting)
            if victim is None:
                return closing, (
                    f"{len(self._open)} connections open, the cap in total (comm_args.max_connections), "
                    f"every one past its handshake"
                )
            closing.append(self._evict(victim))
        return closing, None

    def _oldest_waiting(self, queue: "OrderedDict[int, _Connection]") -> Optional[_Connection]:
        """The waiting connection to close first: the oldest that has sent nothing (the cheapest
        way to hold a place), else the one idle longest (a handshake under way keeps moving back)."""
        stale, talking, silent = [], None, None
        for examined, connection in enumerate(queue.values()):
            if not connection.waiting:
                stale.append(connection)  # it has carried a request (or a message) since
            elif connection.bytes_in == 0:
                silent = connection
                break
            elif talking is None:
                talking = connection
            if examined >= _VICTIM_SCAN:
                break
        for connection in stale:
            self._stop_waiting(connection)
        return silent or talking

    def _stop_waiting(self, connection: _Connection) -> None:
        key = id(connection)
        self._waiting.pop(key, None)
        from_host = self._waiting_from.get(connection.host)
        if from_host is not None:
            from_host.pop(key, None)
            if not from_host:
                del self._waiting_from[connection.host]

    def _evict(self, connection: _Connection) -> _Connection:
        connection.evicted = True
        self.release(connection)
        return connection

    def moved(self, connection: _Connection, data: bytes, inbound: bool) -> None:
        """``data`` went through ``connection`` (``inbound``: from the peer): counted, and a waiting
        connection goes to the back of the queues."""
        connection.last_activity = time.monotonic()
        if inbound:
            if connection.first_byte is None:
                connection.first_byte = data[0]
            connection.bytes_in += len(data)
        else:
            connection.bytes_out += len(data)
        key = id(connection)
        if key in self._waiting:
            if connection.waiting:
                self._waiting.move_to_end(key)
                self._waiting_from[connection.host].move_to_end(key)
            else:
                self._stop_waiting(connection)

    def open(self, host: str, port: int) -> _Connection:
        now = time.monotonic()
        connection = _Connection(host, port, now, now)
        key = id(connection)
        self._open[key] = connection
        self._waiting[key] = connection
        self._waiting_from.setdefault(host, OrderedDict())[key] = connection
        self.most_open = max(self.most_open, len(self._open))
        return connection

    def release(self, connection: _Connection) -> None:
        """``connection`` no longer counts (again: nothing)."""
        self._open.pop(id(connection), None)
        self._stop_waiting(connection)

    def bind_backend(self, name: str, connection: Optional[_Connection]) -> None:
        """``connection`` reaches gRPC from the Unix socket name ``name`` (None: no longer)."""
        if connection is None:
            self._by_backend_name.pop(name, None)
        else:
            self._by_backend_name[name] = connection

    def connection_of(self, grpc_peer: str) -> Optional[_Connection]:
        """The connection behind gRPC's peer string for the backend side (``unix:PATH``)."""
        return self._by_backend_name.get(grpc_peer[len("unix:") :]) if grpc_peer.startswith("unix:") else None

    def overdue(self, now: float) -> List[_Connection]:
        """Connections past their deadline: no request (nor a message under way) within
        ``first_request_seconds``, or no bytes either way for ``idle_seconds``."""
        due = []
        for connection in self._open.values():
            started = connection.requests > 0 or connection.bytes_in >= HANDSHAKE_BYTES
            if not started and now - connection.opened > self.limits.first_request_seconds:
                due.append(connection)
            elif started and now - connection.last_activity > self.limits.idle_seconds:
                due.append(connection)
        return due


def _evicted(victim: _Connection, newcomer: str) -> str:
    return (
        f"connection closed to make room for a newcomer from {newcomer}: no request after "
        f"{time.monotonic() - victim.opened:.2f} s, idle longest ({victim.bytes_in} bytes in)"
    )


class Backend:
    """Where gRPC listens behind the gate: a Unix socket in a fresh directory only this user can
    enter (mode 0700). Each of the gate's connections to it binds a name of its own in that
    directory, which gRPC reports as the request's peer (``unix:PATH``): so a request is matched
    to the connection it came through."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="fedml-perfedavg-gate-")  # 0700
        self.path = os.path.join(self.directory, "grpc.sock")
        self._count = itertools.count()

    @property
    def address(self) -> str:
        """gRPC's name for it (``server.add_secure_port``)."""
        return "unix:" + self.path

    async def connect(self) -> Tuple[socket.socket, str]:
        """A connected socket to gRPC, and the name it is known by there."""
        name = os.path.join(self.directory, f"c{next(self._count)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name)  # the socket keeps its name; the directory does not fill up
        return sock, name

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class PortTaken(OSError):
    """The public address cannot be bound (in use, or not this host's)."""


def listen_exclusively(ip: str, port: int) -> socket.socket:
    """A non-blocking socket listening on ``ip:port`` that no other process shares;
    :class:`PortTaken` if it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR only lets a port in TIME_WAIT be bound again; never SO_REUSEPORT (sharing).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise PortTaken(err.errno or errno.EADDRINUSE, f"{ip}:{port}: {err.strerror}") from None
    sock.setblocking(False)
    return sock


class Gate:
    """Accepts on ``public`` and forwards to ``backend`` (gRPC's Unix socket) within ``limits``.
    ``on_refusal(host, port, reason, text)`` hears of every connection refused or closed without a
    request (called from the gate's thread)."""

    def __init__(
        self,
        public: Tuple[str, int],
        backend: Backend,
        limits: GateLimits,
        on_refusal: Callable[[str, int, str, str], None],
    ) -> None:
        self.public, self.backend, self.limits, self.on_refusal = public, backend, limits, on_refusal
        self._loop = asyncio.new_event_loop()
        self._sock: Optional[socket.socket] = None
        self._sweeper: Optional[asyncio.Task] = None
        self._thread: Optional[threading.Thread] = None
        self.book = ConnectionBook(limits)

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the public address (exclusively) and start serving; :class:`PortTaken` if it cannot."""
        ip, port = self.public
        self._sock = sock = listen_exclusively(ip, port)
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.add_reader(sock.fileno(), self._accept)
            self._sweeper = self._loop.create_task(self._sweep())
            self._loop.call_soon(ready.set)
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True, name=f"gate-{ip}:{port}")
        self._thread.start()
        ready.wait(10)

    @property
    def _listener(self) -> socket.socket:
        assert self._sock is not None, "the gate is not started"
        return self._sock

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def _accept(self) -> None:
        """Take the waiting connections one by one; one over a cap is closed before the next is
        taken, so the descriptors in use stay within the caps (asyncio's own accept loop takes a
        hundred at a time before any handler runs)."""
        for _ in range(64):
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors or memory: pause, the sweeps free some
                self._loop.remove_reader(self._listener.fileno())
                self._loop.call_later(0.5, self._loop.add_reader, self._listener.fileno(), self._accept)
                self.on_refusal("-", 0, DESCRIPTORS, f"accepting paused for 0.5 s: {err.strerror}")
                return
            host, port = str(peer[0]), int(peer[1])
            self.book.accepted += 1
            closing, over = self.book.make_room(host)
            for victim in closing:
                victim.close()
                self.on_refusal(victim.host, victim.port, EVICTED, _evicted(victim, host))
            if over is not None:
                conn.close()
                self.on_refusal(host, port, CONNECTION_CAP, f"connection closed at once: {over}")
                continue
            conn.setblocking(False)
            connection = self.book.open(host, port)  # counted now, before the next accept
            connection.raw = conn
            self._loop.create_task(self._handle(conn, connection))

    def stop(self) -> None:
        """Close the public port and every connection through it."""
        if self._thread is None:
            return

        async def end() -> None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            sweepers = [self._sweeper] if self._sweeper is not None else []
            for sweeper in sweepers:
                sweeper.cancel()
            for connection in self.book.connections():
                connection.close()  # their handlers end on their own (a cancelled one would be logged)
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait([*sweepers, *handlers], timeout=2.0)

        try:
            asyncio.run_coroutine_threadsafe(end(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - the loop may already be gone; the process is ending this part
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._thread = None
        if not self._loop.is_running():
            self._loop.close()
        self.backend.remove()  # gRPC's socket and its directory (gRPC is stopped, or is being)

    # -- what the transport asks ------------------------------------------------------------------
    def peer_of(self, grpc_peer: str) -> Tuple[str, str]:
        """(host, "host:port") of the real peer behind a request gRPC saw come from the gate."""
        connection = self.book.connection_of(grpc_peer)
        if connection is None:
            return grpc_peer, grpc_peer
        return connection.host, f"{connection.host}:{connection.port}"

    def note_request(self, grpc_peer: str) -> None:
        """A request reached the servicer through this connection: its handshake is done."""
        connection = self.book.connection_of(grpc_peer)
        if connection is not None:
            connection.requests += 1
            connection.last_activity = time.monotonic()

    @property
    def open_connections(self) -> int:
        return len(self.book)

    # -- the loop -----------------------------------------------------------------------------------
    async def _handle(self, conn: socket.socket, connection: _Connection) -> None:
        try:
            if connection.closing:  # closed for room before this handler ran
                return
            connection.raw = None  # asyncio owns the descriptor from here: it is closed through it
            try:
                reader, writer = await asyncio.open_connection(sock=conn, limit=_CHUNK)
            except (OSError, ValueError):
                conn.close()
                return
            connection.writers.append(writer)
            if connection.closing:  # closed for room while asyncio took it
                return
            # gRPC is reached only once the peer has said something: a connection that sits silent
            # (the cheapest way to hold a place) costs one descriptor, not three, and no handshake work.
            try:
                first = await reader.read(_CHUNK)
            except (OSError, asyncio.IncompleteReadError):
                return
            if not first or connection.closing:
                return
            self.book.moved(connection, first, inbound=True)
            try:
                backend_sock, backend_name = await asyncio.wait_for(self.backend.connect(), 5.0)
                backend_reader, backend_writer = await asyncio.open_unix_connection(sock=backend_sock, limit=_CHUNK)
            except (OSError, asyncio.TimeoutError):
                return  # the process's own gRPC server is gone: it is shutting down
            connection.writers.append(backend_writer)
            self.book.bind_backend(backend_name, connection)
            try:
                backend_writer.write(first)
                await asyncio.gather(
                    self._pipe(reader, backend_writer, connection, inbound=True),
                    self._pipe(backend_reader, writer, connection, inbound=False),
                )
            finally:
                self.book.bind_backend(backend_name, None)
        finally:
            connection.close()
            conn.close()  # aborted with its transport already, or never handed to one
            self.book.release(connection)
            if connection.requests == 0 and not connection.evicted:  # an evicted one was reported then
                reason, text = connection.refusal(self.limits.tls)
                self.on_refusal(connection.host, connection.port, reason, text)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, connection: _Connection, inbound: bool
    ) -> None:
        try:
            while not connection.closing:
                data = await source.read(_CHUNK)
                if not data:
                    break
                self.book.moved(connection, data, inbound)
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            connection.close()  # broken: both sides go at once
            return
        # One side ended: what it sent last is delivered, then the other side is closed too.
        connection.closing = True
        try:
            sink.close()
            await asyncio.wait_for(sink.wait_closed(), 2.0)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        connection.close()

    async def _sweep(self) -> None:
        """Close connections past their deadline (:meth:`ConnectionBook.overdue`)."""
        while True:
            await asyncio.sleep(_SWEEP_SECONDS)
            for connection in self.book.overdue(time.monotonic()):
                connection.close()
