"""Cross-silo transport: FedML's gRPC communication manager with three defects fixed
(core/distributed/communication/grpc/grpc_comm_manager.py):

- ``send_message`` dies on the first ``UNAVAILABLE``, so a silo started before the server
  crashes; here it retries with exponential backoff for ``connect_timeout`` seconds.
- ``message_handling_subroutine`` polls ``message_q.qsize()`` with its sleep outside the loop,
  so every waiting process spins a core; here it blocks on the queue and gives observers an
  ``on_idle`` tick, where deadlines are checked.
- it learns the address of any unknown sender from the message itself; here messages from
  ranks that are not in the address file are dropped.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import queue
import time
from dataclasses import dataclass
from typing import Any, Iterator

from ...core.guards import SiloFailure
from ..bootstrap import import_fedml

import_fedml()
import grpc  # noqa: E402
from fedml.core.distributed.communication.grpc import grpc_comm_manager as grpc_module  # noqa: E402

logger = logging.getLogger(__name__)

SILO_METRICS = "plugin_silo_metrics"  # message parameter: a silo's own personalized evaluation
IDLE_TICK_SECONDS = 0.2


@dataclass(frozen=True)
class SiloPolicy:
    """How cross-silo processes wait for each other and what they do when a peer is gone."""

    connect_timeout: float  # keep retrying a peer that is not listening this long
    round_timeout: float  # the server waits this long for silos in any phase
    min_clients: int  # after round_timeout, go on if at least this many silos answered

    @property
    def client_idle_limit(self) -> float:
        """A silo that hears nothing from the server this long gives up."""
        return 2 * self.round_timeout + self.connect_timeout


class PeerUnreachable(SiloFailure):
    """A peer stayed unreachable for the whole retry window."""


class PluginGRPCCommManager(grpc_module.GRPCCommManager):
    """FedML's gRPC transport with retry, a blocking receive loop and a sender check."""

    retry_seconds: float = 60.0  # set per run from comm_args.connect_timeout (see ``with_retry``)

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
                                          f"for {self.retry_seconds:g} s (comm_args.connect_timeout)") from None
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
