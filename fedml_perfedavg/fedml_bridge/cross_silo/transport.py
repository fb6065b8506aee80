"""Cross-silo transport: FedML's gRPC communication manager with three defects fixed
(core/distributed/communication/grpc/grpc_comm_manager.py):

- ``send_message`` dies on the first ``UNAVAILABLE``, so a silo started before the server
  crashes; here it retries with exponential backoff for ``connect_timeout`` seconds.
- ``message_handling_subroutine`` polls ``message_q.qsize()`` with its sleep outside the loop,
  so every waiting process spins a core; here it blocks on the queue and gives observers an
  ``on_idle`` tick, where deadlines are checked.
- it learns the address of any unknown sender from the message itself; here messages from
  ranks that are not in the address file are dropped.
- its gRPC server binds with gRPC's default ``SO_REUSEPORT``, so a second process given the
  same address file (a leftover run) silently shares the port and part of the messages, and
  a port held by another program ends in a raw ``Failed to bind`` traceback; here the port is
  exclusive and a bind failure is :class:`PortUnavailable`, naming the rank and the address.
  Once bound, each rank logs :data:`READY_MESSAGE`, which ``launch-silo`` waits for.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ...core.guards import SiloFailure
from ..bootstrap import import_fedml, replaced

import_fedml()
import grpc  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager as grpc_module  # noqa: E402

logger = logging.getLogger(__name__)

SILO_METRICS = "plugin_silo_metrics"  # message parameter: a silo's own personalized evaluation
IDLE_TICK_SECONDS = 0.2
READY_MESSAGE = "gRPC rank %d listening on %s:%d"  # logged once the port is bound
TRAINING_STARTED = "online; round 0 starts"  # the server's log line once every silo came online


@dataclass(frozen=True)
class SiloPolicy:
    """How cross-silo processes wait for each other and what they do when a peer is gone.

    Deadlines follow the run: once ``ADAPT_AFTER_ROUNDS`` rounds were measured, the server
    waits ``round_timeout_factor`` times the slowest round so far (at least
    ``MIN_ADAPTIVE_SECONDS``, at most ``round_timeout``), and a silo gives up on a server it
    has not heard from for the factor times the slowest gap between the server's models."""

    connect_timeout: float  # keep retrying a peer that is not listening this long
    round_timeout: float  # the server waits this long for silos in any phase (the ceiling)
    min_clients: int  # after the deadline, go on if at least this many silos answered
    round_timeout_factor: float = 0.0  # 0: always round_timeout

    ADAPT_AFTER_ROUNDS = 2
    MIN_ADAPTIVE_SECONDS = 5.0

    def round_deadline(self, slowest_round: Optional[float], rounds_measured: int) -> float:
        """Seconds the server waits for a round's updates."""
        if not self.round_timeout_factor or slowest_round is None or rounds_measured < self.ADAPT_AFTER_ROUNDS:
            return self.round_timeout
        return min(self.round_timeout, max(self.MIN_ADAPTIVE_SECONDS, self.round_timeout_factor * slowest_round))

    @property
    def client_idle_limit(self) -> float:
        """A silo that hears nothing from the server this long gives up (before it has measured rounds)."""
        return 2 * self.round_timeout + self.connect_timeout

    def client_idle_deadline(self, slowest_gap: Optional[float], gaps_measured: int) -> float:
        """A silo's wait for the server: the factor times the slowest gap between the server's
        models (a gap holds a whole round and the server's evaluation, so this outlasts the
        server's own deadline for a round with a dead silo), plus a margin."""
        if not self.round_timeout_factor or slowest_gap is None or gaps_measured < self.ADAPT_AFTER_ROUNDS:
            return self.client_idle_limit
        return min(self.client_idle_limit, max(self.MIN_ADAPTIVE_SECONDS, self.round_timeout_factor * slowest_gap)
                   + self.MIN_ADAPTIVE_SECONDS)


class PeerUnreachable(SiloFailure):
    """A peer stayed unreachable for the whole retry window."""


class PortUnavailable(SiloFailure):
    """A rank cannot listen on the address the address file gives it."""


class PluginGRPCCommManager(grpc_module.GRPCCommManager):
    """FedML's gRPC transport with retry, a blocking receive loop, a sender check and an
    exclusive port."""

    retry_seconds: float = 60.0  # set per run from comm_args.connect_timeout (see ``with_retry``)

    def __init__(self, grpc_ipconfig_path, topic="fedml", client_rank=0, client_num=0, args=None):
        shared_server = grpc.server

        def exclusive_server(*server_args, options=(), **kwargs):
            return shared_server(*server_args, options=[*(options or ()), ("grpc.so_reuseport", 0)], **kwargs)

        with replaced(grpc, "server", exclusive_server):
            try:
                super().__init__(grpc_ipconfig_path, topic, client_rank, client_num, args)
            except RuntimeError as err:
                if "bind" not in str(err).lower():
                    raise
                mapping = self.grpc_mappings.get(client_rank)
                where = f"{mapping.grpc_server_ip}:{mapping.grpc_server_port}" if mapping else "its address"
                raise PortUnavailable(
                    f"rank {client_rank} cannot listen on {where} (comm_args.grpc_ipconfig_path="
                    f"{grpc_ipconfig_path!r}): the port is in use, maybe by a process of an earlier run; stop it "
                    f"(`ss -ltnp | grep {where.rsplit(':', 1)[-1]}` shows which) or give rank {client_rank} "
                    f"another port in the address file") from None
        mapping = self.grpc_mappings[client_rank]
        logger.info(READY_MESSAGE, client_rank, mapping.grpc_server_ip, mapping.grpc_server_port)

    def send_message(self, msg):
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.1
        while True:
            try:
                return super().send_message(msg)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                receiver = int(msg.get_receiver_id())
                mapping = self.grpc_mappings[receiver]
                where = f"{mapping.grpc_server_ip}:{mapping.grpc_server_port}"
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerUnreachable(f"rank {receiver} at {where} did not answer rank {self.client_rank} "
                                          f"for {self.retry_seconds:.1f} s (comm_args.connect_timeout, or the "
                                          f"adaptive round deadline once the run is under way); is it gone?") from None
                logger.info("rank %d at %s is not reachable yet; retrying in %.1f s", receiver, where, delay)
                time.sleep(min(delay, left))
                delay = min(2 * delay, 5.0)

    def message_handling_subroutine(self):
        while self.is_running:
            try:
                msg_pkl = self.grpc_servicer.message_q.get(timeout=IDLE_TICK_SECONDS)
            except queue.Empty:
                for observer in list(self._observers):
                    on_idle = getattr(observer, "on_idle", None)
                    if on_idle is not None:
                        on_idle()
                continue
            msg = pickle.loads(msg_pkl)  # only trusted silos may connect (README)
            sender = int(msg.get_sender_id())
            if sender not in self.grpc_mappings:
                logger.warning("dropped a message from rank %d, which is not in %s", sender, self.grpc_ipconfig_path)
                continue
            for observer in list(self._observers):
                observer.receive_message(msg.get_type(), msg)


def with_retry(policy: SiloPolicy) -> type:
    """The transport class for one run: retries for ``policy.connect_timeout``."""
    return type("PluginGRPCCommManager", (PluginGRPCCommManager,), {"retry_seconds": policy.connect_timeout})


@contextlib.contextmanager
def no_retry(manager: Any) -> Iterator[None]:
    """Within the block, ``manager``'s sends fail at once on an unreachable peer."""
    comm = manager.com_manager
    saved = comm.retry_seconds
    comm.retry_seconds = 0.0
    try:
        yield
    finally:
        comm.retry_seconds = saved
