"""Cross-silo transport: FedML's gRPC communication manager
(core/distributed/communication/grpc/grpc_comm_manager.py) replaced, for every cross-silo run in
a process that imported the plugin (FedML's own optimizers too), because FedML's:

- calls ``pickle.loads`` on every message, so anyone who reaches a port runs code in the process;
  here messages are :mod:`.wire` data, checked against the protocol's schema and a size cap;
- binds with ``add_insecure_port`` and believes the sender rank written in the message; here
  ranks talk over mutual TLS (``comm_args.tls_dir``), a message's sender must be the rank in the
  peer's certificate, a silo takes messages from the server's certificate only, and a sender
  checks that the receiver's certificate names the rank it meant to reach;
- has no notion of replays; here each message carries the run id, the round and a per-peer
  sequence number, and an upload must answer the last model sent to that silo, once;
- ``send_message`` has no timeout (a frozen peer blocks the sender) and dies on the first
  ``UNAVAILABLE``; here every send has a deadline and retries an unreachable peer with backoff
  until it (:mod:`.delivery`);
- busy-spins a core while it waits; here the receive loop blocks, with an ``on_idle`` tick
  where the managers check their deadlines;
- shares its port (gRPC's default ``SO_REUSEPORT``); here the port is exclusive and a bind
  failure is :class:`PortUnavailable`, naming the rank and the address;
- accepts every connection and waits 120 s for its handshake, with no cap; here the port is the
  :mod:`.gate`'s (connections capped per peer address and in total, a first-request deadline, an
  idle limit), the descriptor limit is raised to the hard limit and the caps are set below it;
- logs nothing of a refusal it cannot see; here every refusal (a connection or a message) is
  counted by reason and logged with the peer's address, rate-limited (:mod:`.refusals`).

Without ``tls_dir`` a process refuses to start unless ``comm_args.insecure: true`` (plaintext and
unauthenticated: still no pickle, with a warning).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ...core.errors import ConfigError, SiloFailure
from ...stopping import interrupt_if_stopping
from ..bootstrap import TRANSPORT_VALUES, import_fedml
from . import READY_MESSAGE
from ...net import wire
from ...net.addresses import read_ipconfig
from .backends import check_cross_silo_backend
from ...net.conversations import Conversations
from .delivery import Delivery, Outgoing, PeerUnreachable, channel_options
from ...net.credentials import Credentials, check_security, load_credentials, peer_certificate_problem, rank_of_names
from ...net.gate import Backend, Gate, GateLimits, PortTaken
from ...net.refusals import RefusalLog

import_fedml()
import grpc  # noqa: E402
from fedml.core.distributed.communication.base_com_manager import BaseCommunicationManager  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb2  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pb2_grpc  # noqa: E402
from fedml.core.distributed.communication.message import Message  # noqa: E402

logger = logging.getLogger(__name__)

IDLE_TICK_SECONDS = 0.2
STOP_GRACE_SECONDS = 3.0  # a stopping rank still answers the requests it has taken this long
ROUND_KEY = "round"  # the round an incoming message was stamped with, on the FedML Message
SESSION_KEY = "plugin_session"  # the sending process's session, on the FedML Message
SIZE_KEY = "plugin_bytes"  # the bytes the message took on the wire, on the FedML Message
ARRIVED_KEY = "plugin_arrived"  # when it was taken (time.monotonic()), on the FedML Message
FALLBACK_SIZE_CAP = 256 << 20  # where no model told the transport its size
MODEL_SIZE_CAP = "model_size_cap"  # on FedML's args: the cap FedMLRunner's model gives (wire.default_size_cap)
DESCRIPTORS_RESERVED = 256  # for the run's own files, channels and gRPC's threads
DESCRIPTORS_PER_CONNECTION = 3  # a gated connection: the peer's socket, the gate's to gRPC, gRPC's accepted one
DEFAULT_MAX_CONNECTIONS = 1024
# Reasons a message is refused, beside wire's (counted by these codes).
IDENTITY, OTHER_RUN, INTERNAL = "identity", "other-run", "internal"


class PortUnavailable(SiloFailure):
    """A rank cannot listen on the address the address file gives it."""


@dataclass(frozen=True)
class TransportSettings:
    """What the transport needs, checked once (by the run's config rules)."""

    run_id: str
    credentials: Optional[Credentials]  # None: comm_args.insecure
    size_cap: int
    connect_timeout: float
    max_connections: Optional[int] = None  # None: DEFAULT_MAX_CONNECTIONS, within the descriptor limit
    max_connections_per_peer: Optional[int] = None  # None: 2 x the run's ranks + 8 (see connection_limits)
    handshake_timeout: float = 5.0
    idle_timeout: float = 300.0

    @classmethod
    def of(cls, args: Any, rank: int) -> "TransportSettings":
        """The settings for ``rank`` from FedML's ``args`` as the plugin's ``fedml.init`` left them
        (:data:`~fedml_perfedavg.fedml_bridge.bootstrap.TRANSPORT_VALUES`)."""
        values = getattr(args, TRANSPORT_VALUES, None)
        if values is None:
            raise ConfigError(
                "the plugin's cross-silo transport reads its comm_args from FedML's args as the plugin's "
                "fedml.init sets them (a cross-silo run that selects a plugin algorithm or sets "
                "common_args.plugin_fixes: true); call fedml.init(args) first"
            )
        return cls.from_values(values, str(getattr(args, "run_id", "0")), rank, getattr(args, MODEL_SIZE_CAP, None))

    @classmethod
    def from_values(
        cls, values: Mapping[str, Any], run_id: str, rank: int, model_size_cap: Optional[int]
    ) -> "TransportSettings":
        """The settings from comm_args' typed, checked ``values`` (``fedml_args.TRANSPORT_KEYS`` of the run
        config), this rank's credentials loaded; without ``max_message_bytes``, the cap the
        model's size gives (:data:`MODEL_SIZE_CAP`), else :data:`FALLBACK_SIZE_CAP`."""
        check_security(values["tls_dir"], values["insecure"])  # this process's own rule, whoever set the values
        cap = values["max_message_bytes"] or model_size_cap
        if cap is None:
            cap = FALLBACK_SIZE_CAP
            logger.info("comm_args.max_message_bytes not set and no model known: messages are capped at %d bytes", cap)
        return cls(
            run_id,
            load_credentials(str(values["tls_dir"]), rank, values["roster_path"]) if values["tls_dir"] else None,
            int(cap),
            values["connect_timeout"],
            values["max_connections"],
            values["max_connections_per_peer"],
            values["handshake_timeout"],
            values["idle_timeout"],
        )


def raise_descriptor_limit() -> int:
    """Raise this process's open-file limit to its hard limit (a port under attack holds many
    sockets); returns the limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
            soft = target
        except (ValueError, OSError) as err:
            logger.warning("open-file limit stays at %d (raising it to %d failed: %s)", soft, target, err)
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def connection_limits(settings: TransportSettings, ranks: int, descriptors: int) -> GateLimits:
    """The gate's caps: per peer, 2 connections for each rank of the run and 8 more (every rank of
    a run on one machine shares one address) unless set; in total DEFAULT_MAX_CONNECTIONS unless
    set; both below what the descriptor limit can hold."""
    budget = max(8, (descriptors - DESCRIPTORS_RESERVED) // DESCRIPTORS_PER_CONNECTION)
    total = settings.max_connections or DEFAULT_MAX_CONNECTIONS
    if total > budget:
        logger.warning(
            "comm_args.max_connections=%d is more than the open-file limit (%d) holds: %d connections at most",
            total,
            descriptors,
            budget,
        )
        total = budget
    per_peer = min(settings.max_connections_per_peer or 2 * ranks + 8, total)
    return GateLimits(
        per_peer=per_peer,
        total=total,
        first_request_seconds=settings.handshake_timeout,
        idle_seconds=settings.idle_timeout,
        tls=settings.credentials is not None,
    )


class _Servicer:
    """gRPC's side of receiving: every message is checked here, in gRPC's threads, before it is
    queued for the managers; a refusal is logged with the peer's address and told to the sender."""

    def __init__(self, transport: "SecureGRPCCommManager") -> None:
        self.transport = transport

    def sendMessage(self, request, context):  # noqa: N802 - FedML's service method name
        transport = self.transport
        transport.gate.note_request(context.peer())
        try:
            transport.accept(request.message, context)
        except Exception as err:  # noqa: BLE001 - whatever a peer's bytes do, it is a refusal, counted and logged
            rejected = (
                err
                if isinstance(err, wire.Rejected)
                else wire.Rejected(f"could not be read ({type(err).__name__}: {wire.short(str(err), 80)})", INTERNAL)
            )
            if rejected.counted:
                with transport.rejected_lock:
                    transport.rejected += 1
                host, where = transport.gate.peer_of(context.peer())
                transport.refusals.refuse(host, rejected.reason, str(rejected), where)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, rejected.words())
        return pb2.CommResponse()

    def handleReceiveMessage(self, request, context):  # noqa: N802 - FedML's service declares it
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not used")


def listen(transport: "SecureGRPCCommManager", address: Tuple[str, int], ranks: int) -> Tuple[Any, Gate]:
    """Start ``transport``'s gRPC server on a private loopback port and its :class:`Gate` on
    ``address`` in front of it (the caps of :func:`connection_limits`); :class:`PortUnavailable`
    naming the rank and the address if the port is taken. Returns (the gRPC server, the gate)."""
    settings, rank = transport.settings, transport.rank
    ip, port = address
    descriptors = raise_descriptor_limit()
    limits = connection_limits(settings, ranks, descriptors)
    server_options = [
        *channel_options(settings.size_cap, settings.handshake_timeout),
        ("grpc.server_handshake_timeout_ms", int(1000 * limits.first_request_seconds)),
        ("grpc.max_connection_idle_ms", int(1000 * limits.idle_seconds)),
        ("grpc.max_allowed_incoming_connections", limits.total + 8),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max(4, transport.client_num + 2)), options=server_options
    )
    pb2_grpc.add_gRPCCommManagerServicer_to_server(_Servicer(transport), server)
    credentials, backend = settings.credentials, Backend()
    if credentials is None:
        bound = server.add_insecure_port(backend.address)
    else:
        bound = server.add_secure_port(
            backend.address,
            grpc.ssl_server_credentials(
                [(credentials.key, credentials.cert)], root_certificates=credentials.ca, require_client_auth=True
            ),
        )
    if not bound:
        backend.remove()
        raise PortUnavailable(f"rank {rank}: gRPC could not listen on {backend.path} (behind the gate)")
    gate = Gate((ip, port), backend, limits, transport._connection_refused)
    try:
        gate.start()
    except PortTaken as err:
        server.stop(None)
        backend.remove()
        raise PortUnavailable(
            f"rank {rank} cannot listen on {ip}:{port} (comm_args.grpc_ipconfig_path="
            f"{transport.grpc_ipconfig_path!r}): the port is in use, maybe by a process of an earlier run, or the "
            f"address is not this host's ({err}); stop it (`ss -ltnp | grep {port}` shows which) or give rank "
            f"{rank} another port in the address file"
        ) from None
    server.start()
    logger.info(
        "rank %d: connections capped at %d per peer address and %d in total (comm_args."
        "max_connections_per_peer, max_connections; open-file limit %d), %.1f s to a first request "
        "(comm_args.handshake_timeout), %.0f s idle (comm_args.idle_timeout)",
        rank,
        limits.per_peer,
        limits.total,
        descriptors,
        limits.first_request_seconds,
        limits.idle_seconds,
    )
    if credentials is None:
        logger.warning(
            "rank %d: comm_args.insecure: plaintext and unauthenticated; any process that reaches "
            "%s:%d can speak for any rank (messages are still never unpickled)",
            rank,
            ip,
            port,
        )
    logger.info(READY_MESSAGE, rank, ip, port)
    return server, gate


def check_route(
    envelope: wire.Envelope, peer_rank: Optional[int], rank: int, ranks: Collection[int], run_id: str
) -> None:
    """:class:`wire.Rejected` unless ``envelope`` may reach ``rank`` (of ``ranks``) in run
    ``run_id``: its sender is the rank the peer's certificate names (``peer_rank``; None on an
    insecure transport), it is addressed here, and it is a kind the server takes from a silo or a
    silo from the server."""
    sender, kind = envelope.sender, envelope.type
    if peer_rank is not None and sender != peer_rank:
        raise wire.Rejected(
            f"type {kind} claims sender rank {sender}, but the peer's certificate is rank {peer_rank}'s", IDENTITY
        )
    if envelope.receiver != rank:
        raise wire.Rejected(f"type {kind} is addressed to rank {envelope.receiver}, this is rank {rank}", IDENTITY)
    if rank == 0:
        if kind not in wire.FROM_SILO or sender == 0 or sender not in ranks:
            raise wire.Rejected(f"the server takes no message of type {kind} from rank {sender}", IDENTITY)
    elif kind not in wire.FROM_SERVER or sender != 0:
        raise wire.Rejected(
            f"a silo takes messages from the server (rank 0) only; got type {kind} from rank {sender}", IDENTITY
        )
    if envelope.run_id != run_id:
        raise wire.Rejected(
            f"type {kind} from rank {sender} is for run {wire.short(envelope.run_id)}, not this run ({run_id!r})",
            OTHER_RUN,
        )


def to_message(envelope: wire.Envelope) -> Message:
    """The FedML ``Message`` a checked envelope stands for (its round and session as the plugin's keys)."""
    message = Message(envelope.type, envelope.sender, envelope.receiver)
    for key, value in envelope.params.items():
        message.add_params(key, value)
    if envelope.model is not None:
        message.add_params(wire.MODEL_KEY, envelope.model)
    message.add_params(ROUND_KEY, envelope.round)
    message.add_params(SESSION_KEY, envelope.session)
    message.add_params(SIZE_KEY, envelope.size)
    message.add_params(ARRIVED_KEY, envelope.arrived)
    return message


class SecureGRPCCommManager(BaseCommunicationManager):
    """A FedML communication manager (``BaseCommunicationManager``'s methods) over gRPC with the
    checks in the module doc. Built by FedML's ``FedMLCommManager`` for ``backend: GRPC`` with
    FedML's arguments."""

    retry_seconds: float  # a send without its own deadline gets this long (the managers shorten it)

    def __init__(self, grpc_ipconfig_path, topic="fedml", client_rank=0, client_num=0, args=None):
        self.rank = int(client_rank)
        self.client_num = int(client_num)
        self.args = args
        self.settings = TransportSettings.of(args, self.rank)
        self.retry_seconds = self.settings.connect_timeout
        self.session = secrets.token_hex(8)  # this process: a silo that restarts is a new session
        self.resumes = ""  # the server: the session of the server process it resumes (its checkpoint's)
        self.refusals = RefusalLog(self.rank, logger)
        self.addresses = read_ipconfig(grpc_ipconfig_path)
        self.grpc_ipconfig_path = grpc_ipconfig_path
        if self.rank not in self.addresses:
            raise ConfigError(
                f"comm_args.grpc_ipconfig_path={grpc_ipconfig_path!r}: no row for rank {self.rank}; "
                f"FedML would listen on every interface"
            )
        self._observers: List[Any] = []
        self._queue: "queue.Queue[wire.Envelope]" = queue.Queue()
        self.conversations = Conversations(self.rank)
        self.rejected, self.rejected_lock = 0, threading.Lock()  # messages refused (from gRPC's threads)
        # the server: why an announcement (an ONLINE status's hello) is refused, or None; the
        # silo hears it in the answer to its send, even where the server cannot reach it back
        self.screen_announcement: Optional[Callable[[int, Any], Optional[str]]] = None
        # the server: set once it ended the run (its reason; "" when it finished): a silo that
        # announces itself after that (one still starting) is told so in the answer, not left waiting
        self.ended: Optional[str] = None
        self.told_run_over: Set[int] = set()  # silos told so in the answer to their announcement
        self.is_running = False
        self.delivery = Delivery(
            self.rank,
            self.addresses,
            grpc_ipconfig_path,
            self.settings.credentials,
            channel_options(self.settings.size_cap, self.settings.handshake_timeout),
            lambda: self.conversations.finish_received,
            line=self.conversations,
        )
        self._server, self.gate = listen(self, self.addresses[self.rank], len(self.addresses))
        self.is_running = True

    # -- receiving --------------------------------------------------------------------------------
    def _peer_rank(self, context) -> Optional[int]:
        """The rank the peer's certificate names (None on an insecure transport)."""
        if self.settings.credentials is None:
            return None
        auth = context.auth_context() or {}
        names = [n.decode("utf-8", "replace") for n in auth.get("x509_subject_alternative_name", [])]
        rank = rank_of_names(names)
        if rank is None:
            raise wire.Rejected(f"the peer's certificate names no rank (DNS names {wire.short(names)})", IDENTITY)
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        problem = peer_certificate_problem(pem)
        if problem is not None:
            raise wire.Rejected(f"the peer's certificate (rank {rank}) {problem}", IDENTITY)
        problem = self.settings.credentials.peer_problem(rank, pem)
        if problem is not None:  # signed by the run's CA, but not the key the roster pins for the rank
            raise wire.Rejected(f"the peer naming rank {rank}: {problem}", IDENTITY)
        return rank

    def sightings(self, ranks: Iterable[int]) -> str:
        """What this rank refused from the addresses of ``ranks`` (ranks that never came online),
        in words; "" when nothing."""
        seen = [self.refusals.seen_from(self.addresses[r][0]) for r in sorted(ranks) if r in self.addresses]
        return "; ".join(s for s in seen if s)

    def _connection_refused(self, host: str, port: int, reason: str, text: str) -> None:
        self.refusals.refuse(host, reason, text, f"{host}:{port}{self._rows_at(host)}")

    def _rows_at(self, host: str) -> str:
        """Which ranks the address file places at ``host``, in words, so that a refused connection
        from an organization's host names it when it happens (a silo with another run's CA), not
        only when its seat is given up on; "" where this rank shares the host (loopback)."""
        own = self.addresses.get(self.rank, ("", 0))[0]
        ranks = sorted(r for r, (ip, _) in self.addresses.items() if ip == host and r != self.rank)
        if not ranks or host == own:
            return ""
        return (
            f" (the address file's row of rank {ranks[0]})"
            if len(ranks) == 1
            else f" (the address file's rows of ranks {ranks})"
        )

    def accept(self, data: bytes, context) -> None:
        """Check one message (bytes from the wire) and queue it; :class:`wire.Rejected` if it is
        not one this rank takes now."""
        peer_rank = self._peer_rank(context)
        envelope = wire.decode(data, self.settings.size_cap)
        check_route(envelope, peer_rank, self.rank, self.addresses, self.settings.run_id)
        self.conversations.admit(envelope)
        envelope.arrived = time.monotonic()
        refusal = self._announcement_refusal(envelope)
        self._queue.put(envelope)  # a refused announcement too: the protocol refuses it, counts it and decides
        if refusal is not None:
            raise refusal

    def _announcement_refusal(self, envelope: wire.Envelope) -> Optional[wire.Rejected]:
        if envelope.type != wire.CLIENT_STATUS or envelope.params.get("client_status") != "ONLINE":
            return None
        if self.ended is not None:
            self.told_run_over.add(envelope.sender)
            return wire.Rejected(self.ended or wire.RUN_FINISHED, wire.RUN_OVER, counted=False)
        screen = self.screen_announcement
        problem = screen(envelope.sender, envelope.params.get(wire.HELLO)) if screen else None
        return None if problem is None else wire.Rejected(problem, wire.DISAGREEMENT, counted=False)

    def backlog(self) -> int:
        """Messages taken and not yet handed to the managers."""
        return self._queue.qsize()

    def handle_receive_message(self) -> None:
        self._notify_connection_ready()
        self.message_handling_subroutine()

    def message_handling_subroutine(self) -> None:
        """Hand each queued message to the managers; at least every IDLE_TICK_SECONDS, whatever
        the load, tick them (their deadlines fire on time even while messages keep coming)."""
        last_tick = time.monotonic()
        while self.is_running:
            interrupt_if_stopping()
            try:
                envelope = self._queue.get(timeout=IDLE_TICK_SECONDS)
            except queue.Empty:
                envelope = None
            if envelope is not None:
                message = to_message(envelope)
                for observer in list(self._observers):
                    observer.receive_message(message.get_type(), message)
            if envelope is None or time.monotonic() - last_tick >= IDLE_TICK_SECONDS:
                last_tick = time.monotonic()
                self._tick()

    def _tick(self) -> None:
        self.refusals.tick()
        for observer in list(self._observers):
            on_idle = getattr(observer, "on_idle", None)
            if on_idle is not None and self.is_running:
                on_idle()

    def _notify_connection_ready(self) -> None:
        message = Message(0, self.rank, self.rank)  # FedML's MSG_TYPE_CONNECTION_IS_READY
        for observer in list(self._observers):
            observer.receive_message(0, message)

    # -- sending ----------------------------------------------------------------------------------
    def _envelope(self, message) -> wire.Envelope:
        params = dict(message.get_params())
        kind = int(params.pop("msg_type"))
        sender, receiver = int(params.pop("sender")), int(params.pop("receiver"))
        if sender != self.rank:
            raise ValueError(f"rank {self.rank} cannot send a message as rank {sender}")
        model = params.pop(wire.MODEL_KEY, None)
        stamped = params.pop(ROUND_KEY, None)  # a round the sender names (an evaluation's), else the current one
        params.pop(SESSION_KEY, None)
        params.pop(SIZE_KEY, None)
        params.pop(ARRIVED_KEY, None)
        for key in [k for k, v in params.items() if v is None]:
            del params[key]
        for key, value in params.items():  # numpy and 0-dim tensor scalars travel as plain numbers
            if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
                params[key] = value.item()
        if self.rank == 0:
            round_idx, reply_to = int(getattr(self.args, "round_idx", 0) or 0), -1
        else:
            last_model = self.conversations.last_model
            reply_to, round_idx = last_model if kind == wire.UPLOAD else (-1, last_model[1])
        if stamped is not None:
            round_idx = int(stamped)
        seq = self.conversations.next_seq(kind, receiver)
        return wire.Envelope(
            type=kind,
            sender=sender,
            receiver=receiver,
            run_id=self.settings.run_id,
            round=round_idx,
            seq=seq,
            params=params,
            model=model,
            reply_to=reply_to,
            session=self.session,
            resumes=self.resumes,
        )

    def send_message(self, message, deadline: Optional[float] = None) -> Optional[str]:
        """Send ``message`` (a FedML ``Message``) before ``deadline`` (``time.monotonic()``; default:
        ``retry_seconds`` from now), retrying an unreachable receiver with backoff until then.
        :class:`PeerUnreachable` when it did not take it in time. A receiver that refuses the
        message is logged, not raised: it logged why, and the protocol's deadlines go on; its
        words are returned (None: taken)."""
        [outgoing] = self.encode_all([message])
        return self.delivery.send(
            *outgoing[:2],
            time.monotonic() + self.retry_seconds if deadline is None else deadline,
            seq=outgoing.seq,
        )

    def send_all(
        self, messages: Iterable[Any], deadline: float, *, gone_if_refused: Collection[int] = ()
    ) -> Dict[int, PeerUnreachable]:
        """Send FedML ``Message`` s to several receivers at once, each before ``deadline``
        (:meth:`.Delivery.send_all`); returns the receivers that were unreachable."""
        return self.delivery.send_all(self.encode_all(messages), deadline, gone_if_refused=gone_if_refused)

    def encode_all(self, messages: Iterable[Any]) -> List[Outgoing]:
        """FedML ``Message`` s encoded and stamped now (the round the sender is in, the next
        sequence number to each receiver); every one must then go to :class:`.Delivery`, which
        sends each after those stamped before it to its receiver."""
        stamped: List[Tuple[int, int]] = []
        encoded: List[Outgoing] = []
        try:
            for message in messages:
                envelope = self._envelope(message)
                stamped.append((envelope.receiver, envelope.seq))
                encoded.append(Outgoing(envelope.receiver, wire.encode(envelope), envelope.seq))
        except BaseException:
            for receiver, seq in stamped:  # none of them goes: the ones stamped after must not wait for them
                self.conversations.left(receiver, seq)
            raise
        return encoded

    # -- FedML's BaseCommunicationManager, the rest ---------------------------------------------------
    def add_observer(self, observer) -> None:
        self._observers.append(observer)

    def remove_observer(self, observer) -> None:
        self._observers.remove(observer)

    def notify(self, message) -> None:
        for observer in list(self._observers):
            observer.receive_message(message.get_type(), message)

    def stop_receive_message(self) -> None:
        if not self.is_running:
            return
        self.is_running = False
        # Requests in flight (the one that ended the run, say) are answered, then the door closes:
        # with 1 s of grace a loaded machine's silo could close before its answer to the server's
        # FINISH went out, and the server logged that it had not told the silo (CI run of 98ddab7).
        self._server.stop(STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 1.0)
        self.gate.stop()
        self.delivery.close()


class OwnTransport:
    """Mixed into the plugin's cross-silo managers (server.py, client.py) before FedML's: their gRPC
    transport is :class:`SecureGRPCCommManager`, built here, where FedML's ``_init_manager``
    (core/distributed/fedml_comm_manager.py) would look FedML's up by its module's name; so FedML's
    own algorithms in the same process keep FedML's transport unless their user asks for the
    plugin's (install.py ``apply_to_fedml_algorithms``). FedML's pickling transports are refused."""

    backend: str
    args: Any
    rank: int
    size: int
    com_manager: Any

    def _init_manager(self) -> None:
        check_cross_silo_backend(self.args)
        if self.backend != "GRPC":
            super()._init_manager()  # type: ignore[misc]
            return
        self.com_manager = SecureGRPCCommManager(
            grpc_ipconfig_path=self.args.grpc_ipconfig_path, client_rank=self.rank, client_num=self.size, args=self.args
        )
        self.com_manager.add_observer(self)
