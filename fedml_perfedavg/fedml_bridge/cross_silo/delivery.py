"""How a cross-silo message reaches its peer: one gRPC channel per peer (under mutual TLS the
peer's certificate must name the rank meant), every send with a deadline, an unreachable peer
retried with backoff until then, several peers at once without one holding up the others, and
the messages to one peer in the order they were stamped.

FedML's transport (core/distributed/communication/grpc/grpc_comm_manager.py) opens a channel per
message, sends with no timeout and gives up at the first ``UNAVAILABLE``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, NamedTuple, Optional, Protocol, Tuple

from ...core.errors import ConfigError, SiloFailure
from ..bootstrap import import_fedml
from ...net.credentials import Credentials, rank_name

import_fedml()
import grpc  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb2  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pb2_grpc  # noqa: E402

logger = logging.getLogger(__name__)

_PROTOBUF_SLACK = 4096  # gRPC's own cap sits this far above ours, so our log sees what is a little over


class Outgoing(NamedTuple):
    """An encoded message: its receiver, its bytes, and its place in the sequence to that receiver
    (None: unordered)."""

    receiver: int
    data: bytes
    seq: Optional[int] = None


class SendLine(Protocol):
    """The order of the messages to each receiver (:class:`.conversations.Conversations`)."""

    def wait_turn(self, receiver: int, seq: int, deadline: float) -> bool: ...

    def left(self, receiver: int, seq: int) -> None: ...


class PeerUnreachable(SiloFailure):
    """A peer did not take a message before its deadline."""


class HandshakeFailed(PeerUnreachable):
    """A peer's TLS handshake keeps failing: the two parties' certificates are not from one CA
    (waiting for the peer's deadline would change nothing)."""


def handshake_cause(error: str) -> str:
    """What a gRPC TLS handshake error most likely means, in a party's words."""
    if "BAD_SIGNATURE" in error or "CERTIFICATE_VERIFY_FAILED" in error or "certificate signature" in error:
        return "its certificate is not signed by this party's CA (tls_dir's ca.pem): another run's CA?"
    if "ALERT" in error.upper():
        return "it refused this party's certificate (not from its CA: another run's?)"
    return "the two parties' certificates are not from one CA?"


def channel_options(size_cap: int, handshake_timeout: float) -> List[Tuple[str, int]]:
    """gRPC's options for every channel and the server: the size cap (with gRPC's own a little
    above ours, so our log sees what is a little over), no proxy, an exclusive port, quick
    reconnects, and as long for one connection attempt as the receiver allows a handshake.

    gRPC's ``min_reconnect_backoff_ms`` is not a backoff: it is the time a connection attempt
    (TCP and the TLS handshake) gets before it is abandoned, and the attempt's deadline is the
    larger of it and the current backoff (subchannel.cc; doc/connection-backoff.md calls it
    MIN_CONNECT_TIMEOUT). Set to the backoff's 100 ms, a peer whose handshake takes longer than
    the backoff's 1 s ceiling (a slow link, a loaded host) could never be reached, and one that
    took 0.4 s (a silo's first connection, measured) cost the server's one-second goodbye."""
    limit = size_cap + _PROTOBUF_SLACK
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.enable_http_proxy", 0),
        ("grpc.so_reuseport", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.min_reconnect_backoff_ms", int(1000 * handshake_timeout)),
    ]


class Delivery:
    """Sends encoded messages from ``rank`` to the ranks of ``addresses`` (rank -> (ip, port), read
    at each new channel). ``run_over()`` says a silo has its FINISH: the server stopped listening,
    so nothing more is sent. ``line``: a message with a sequence number waits for the ones stamped
    before it to the same receiver, so sends from several threads arrive in order."""

    SEND_GRACE_SECONDS = 2.0  # past a send's deadline, before it is counted as not delivered
    # gRPC keeps a channel's last connection error while it waits out its reconnect backoff (at
    # most max_reconnect_backoff_ms=1000 plus 20% jitter) and fails every call at once with it: a
    # "Connection refused" can be a second old, from before a restarted silo listened again. A
    # refusal says "nothing listens there" only once it has stood longer than that (a restarted
    # silo taken back at round 105 was given up on at round 106 as "ended": fresh-clone run, 64).
    REFUSAL_STANDS_SECONDS = 1.5
    # A failed TLS handshake is the certificates' doing and fails the same way until the deadline;
    # it is told as such once it has stood this long (the same backoff caveat as above).
    HANDSHAKE_STANDS_SECONDS = 2.0

    def __init__(
        self,
        rank: int,
        addresses: Mapping[int, Tuple[str, int]],
        ipconfig_path: str,
        credentials: Optional[Credentials],
        options: List[Tuple[str, int]],
        run_over: Callable[[], bool],
        line: Optional[SendLine] = None,
    ) -> None:
        self.rank, self.addresses, self.ipconfig_path = rank, addresses, ipconfig_path
        self.credentials, self.options, self.run_over = credentials, options, run_over
        self.line = line
        self._channels: Dict[int, Any] = {}
        self._lock = threading.Lock()  # the channels

    def _channel(self, receiver: int) -> Any:
        channel = self._channels.get(receiver)
        if channel is None:
            if receiver not in self.addresses:
                raise ConfigError(f"comm_args.grpc_ipconfig_path={self.ipconfig_path!r}: no row for rank {receiver}")
            ip, port = self.addresses[receiver]
            if self.credentials is None:
                channel = grpc.insecure_channel(f"{ip}:{port}", options=self.options)
            else:
                # The receiver's certificate must name the rank we mean to reach, whatever its address.
                channel = grpc.secure_channel(
                    f"{ip}:{port}",
                    grpc.ssl_channel_credentials(self.credentials.ca, self.credentials.key, self.credentials.cert),
                    options=[*self.options, ("grpc.ssl_target_name_override", rank_name(receiver))],
                )
            self._channels[receiver] = channel
        return channel

    def send(
        self,
        receiver: int,
        data: bytes,
        deadline: float,
        *,
        gone_if_refused: bool = False,
        seq: Optional[int] = None,
    ) -> Optional[str]:
        """Deliver encoded bytes to ``receiver`` before ``deadline`` (``time.monotonic()``),
        retrying an unreachable receiver with backoff until then; :class:`PeerUnreachable` when it
        did not take them in time. A receiver that refuses the message is logged, not raised: it
        logged why, and the protocol's deadlines go on; its words are returned (None: taken).
        ``gone_if_refused``: a receiver whose host
        refuses the connection (nothing listens on its port) for REFUSAL_STANDS_SECONDS is
        :class:`PeerUnreachable` then, before the deadline; only for a receiver known to have
        listened (it was heard from), since one still starting up refuses connections too and must
        be retried to the deadline. ``seq``: the message's place in the sequence to ``receiver``;
        it leaves once the ones before it have (see ``line``)."""
        if seq is None or self.line is None:
            return self._send(receiver, data, deadline, gone_if_refused)
        try:
            if not self.line.wait_turn(receiver, seq, deadline):
                ip, port = self.addresses[receiver]
                raise PeerUnreachable(
                    f"rank {receiver} at {ip}:{port} had not taken an earlier message from rank {self.rank} "
                    f"by this one's deadline; is it gone?"
                )
            return self._send(receiver, data, deadline, gone_if_refused)
        finally:
            self.line.left(receiver, seq)

    def _send(self, receiver: int, data: bytes, deadline: float, gone_if_refused: bool) -> Optional[str]:
        with self._lock:
            stub = pb2_grpc.gRPCCommManagerStub(self._channel(receiver))
        request = pb2.CommRequest(client_id=self.rank, message=data)
        ip, port = self.addresses[receiver]
        delay, last_error, window = 0.1, "no answer", max(0.0, deadline - time.monotonic())
        refused_since: Optional[float] = None
        handshake_failing_since: Optional[float] = None
        while True:
            if self.run_over():  # its finish waits in the queue; the server stopped listening
                logger.info("rank %d: the server ended the run; a message to rank %d is not sent", self.rank, receiver)
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerUnreachable(
                    f"rank {receiver} at {ip}:{port} did not take a message from rank {self.rank} "
                    f"within {window:.1f} s ({last_error}); is it gone?"
                )
            try:
                stub.sendMessage(request, timeout=left)
                return None
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    last_error = "it accepted no message before the deadline"
                    continue
                if code in (
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.UNIMPLEMENTED,
                ):
                    logger.warning(
                        "rank %d at %s:%d refused a message from rank %d: %s",
                        receiver,
                        ip,
                        port,
                        self.rank,
                        err.details(),
                    )
                    return str(err.details())
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise
                last_error = err.details() or "unavailable"
                if "handshake failed" not in last_error.lower():
                    handshake_failing_since = None
                elif handshake_failing_since is None:
                    handshake_failing_since = time.monotonic()
                elif time.monotonic() - handshake_failing_since >= self.HANDSHAKE_STANDS_SECONDS:
                    raise HandshakeFailed(
                        f"the TLS handshake with rank {receiver} at {ip}:{port} fails: {handshake_cause(last_error)} "
                        f"(gRPC: {last_error})"
                    ) from None
                if "Connection refused" not in last_error:  # the OS's words, via gRPC
                    refused_since = None
                elif refused_since is None:
                    refused_since = time.monotonic()
                elif gone_if_refused and time.monotonic() - refused_since >= self.REFUSAL_STANDS_SECONDS:
                    raise PeerUnreachable(
                        f"rank {receiver} at {ip}:{port} refuses connections (nothing listens there: it has ended)"
                    ) from None
            logger.info(
                "rank %d at %s:%d is not reachable yet; retrying in %.1f s (%s)", receiver, ip, port, delay, last_error
            )
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 2.0)

    def send_all(
        self,
        encoded: Iterable[Outgoing],
        deadline: float,
        *,
        gone_if_refused: Collection[int] = (),
    ) -> Dict[int, PeerUnreachable]:
        """Send messages to several receivers at once, each before ``deadline``: one that does not answer
        costs the others nothing. Returns the receivers that were unreachable. The deadline is
        held by this clock too: a send still running just after it (a gRPC call over a link that
        drops every packet did not always return at its own deadline) counts as not delivered,
        and :meth:`close` cancels it. ``gone_if_refused``: the receivers that have listened (were
        heard from), for whom a refused connection means they ended (see :meth:`send`)."""
        items = [Outgoing(*item) for item in encoded]
        outcome: Dict[int, Optional[BaseException]] = {}

        def deliver(receiver: int, data: bytes, seq: Optional[int]) -> None:
            try:
                self.send(receiver, data, deadline, gone_if_refused=receiver in gone_if_refused, seq=seq)
                outcome[receiver] = None
            except grpc.RpcError as err:  # e.g. CANCELLED while the peer shuts down: not delivered
                outcome[receiver] = PeerUnreachable(f"rank {receiver}: {err.code().name}: {err.details()}")
            except Exception as err:  # noqa: BLE001 - handed to the caller below
                outcome[receiver] = err

        threads = [
            threading.Thread(target=deliver, args=item, daemon=True, name=f"send-to-rank-{item[0]}") for item in items
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + self.SEND_GRACE_SECONDS)
        failed: Dict[int, PeerUnreachable] = {}
        for receiver, *_ in items:
            if receiver not in outcome:
                ip, port = self.addresses[receiver]
                failed[receiver] = PeerUnreachable(
                    f"rank {receiver} at {ip}:{port} did not take a message from rank "
                    f"{self.rank} by the deadline; is it gone?"
                )
            else:
                error = outcome[receiver]
                if isinstance(error, PeerUnreachable):
                    failed[receiver] = error
                elif error is not None:
                    raise error
        return failed

    def close(self) -> None:
        """Close every channel (a send under way is cancelled)."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
