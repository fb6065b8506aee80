"""How the cross-silo server's sends are carried out (what and when is the protocol's,
:mod:`.protocol`): every send has a deadline, several silos are sent to at once, a notice is never
waited on long, and the end of a run reaches the silos given up on too. FedML's server manager
sends each message with no deadline, one after another, so one silo that does not take a message
holds up the others (cross_silo/server/fedml_server_manager.py)."""

from __future__ import annotations

import logging
import threading
import time
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..bootstrap import import_fedml
from ...silo.server.events import EndRun, ToSilo
from .transport import ROUND_KEY
from ...net import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


def to_silo(
    msg_type: int,
    silo: int,
    model: Any = None,
    user: Optional[int] = None,
    round_idx: Optional[int] = None,
    reason: Optional[str] = None,
    refused: bool = False,
    left_out: bool = False,
) -> Message:
    """A message from the server (rank 0) to ``silo``: FedML's keys, and the plugin's round stamp,
    reason (cut at 2000 characters), refusal and left-out flags where given."""
    message = Message(msg_type, 0, silo)
    if model is not None:
        message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, model)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(0 if user is None else user))
    if round_idx is not None:
        message.add_params(ROUND_KEY, round_idx)
    if reason is not None:
        message.add_params(wire.REASON, reason[:2000])
    if refused:
        message.add_params(wire.REFUSED, True)
    if left_out:
        message.add_params(wire.LEFT_OUT, True)
    return message


def fedml_message(message: ToSilo) -> Message:
    """The FedML ``Message`` a protocol's :class:`~.events.ToSilo` stands for."""
    fedml = to_silo(
        message.kind,
        message.silo,
        message.model,
        message.user,
        message.round,
        message.reason,
        message.refused,
        message.left_out,
    )
    for key, value in (message.params or {}).items():
        fedml.add_params(key, value)
    return fedml


class ServerSends:
    """The server's sends through ``transport`` (the plugin's gRPC manager)."""

    NOTICE_GRACE_SECONDS = 2.0  # past a notice's deadline, as a send's (delivery.py)

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.notices: List[Tuple[threading.Thread, float]] = []  # (its delivery, its deadline) still under way

    def send(
        self,
        messages: Sequence[ToSilo],
        deadline: float,
        heard_from: AbstractSet[int],
        report: Callable[[Union[Dict[int, str], BaseException]], None],
    ) -> None:
        """Send at once, each before ``deadline``, without waiting: the messages are stamped now,
        delivered in the background, and ``report`` hears of the silos that could not be reached
        (silo -> why; at once for those ``heard_from`` whose port refuses connections: they
        ended), or of an error. A silo that takes TCP and never its model holds nothing up."""
        encoded = self.transport.encode_all([fedml_message(m) for m in messages])

        def deliver() -> None:
            try:
                failed = self.transport.delivery.send_all(encoded, deadline, gone_if_refused=heard_from)
            except Exception as error:  # noqa: BLE001 - the server raises it in its own thread
                report(error)
                return
            if failed:
                report({silo: str(err) for silo, err in failed.items()})

        threading.Thread(target=deliver, daemon=True, name="server-sends").start()

    def notify(self, messages: Sequence[ToSilo], deadline: float) -> None:
        """Send notices in the background: a silo that does not take them (its port closed, a
        flood of announcements from it) never holds the server's protocol up."""
        fedml_messages = [fedml_message(m) for m in messages]

        def deliver() -> None:
            try:
                failed = {s: str(e) for s, e in self.transport.send_all(fedml_messages, deadline).items()}
            except Exception as error:  # noqa: BLE001 - a notice is best effort; the protocol's deadlines go on
                failed = {m.silo: str(error) for m in messages}
            for silo, why in sorted(failed.items()):
                logger.info("a notice to silo rank %d was not delivered: %s", silo, why)

        thread = threading.Thread(target=deliver, daemon=True, name="server-notices")
        thread.start()
        self.notices = [(t, d) for t, d in self.notices if t.is_alive()] + [(thread, deadline)]

    def wait_for_notices(self) -> None:
        """Wait until each notice under way was delivered or its deadline passed: a run that ends
        right after refusing a silo would otherwise stop the transport under the refusal (CANCELLED),
        and that silo, told nothing, would wait out its idle limit."""
        for thread, deadline in self.notices:
            thread.join(max(0.0, deadline - time.monotonic()) + self.NOTICE_GRACE_SECONDS)
        self.notices = [(t, d) for t, d in self.notices if t.is_alive()]

    def count_refusal(self, silo: int, reason: str, text: str) -> None:
        """Count and log (rate-limited) a refused message of ``silo``'s."""
        self.transport.refusals.refuse(f"rank {silo}", reason, text, f"silo rank {silo}")

    def refusal_totals(self) -> Dict[str, int]:
        return dict(self.transport.refusals.totals)

    def end_run(self, end: EndRun, round_idx: int) -> None:
        """Tell ``end.live`` that the run is over within ``end.seconds``, then ``end.given_up``
        (they may still be waiting, or be gone for good) within ``end.given_up_seconds``, without
        waiting on any that do not answer; the notices under way (a refusal) first reach their silos."""
        self.wait_for_notices()
        self.finish(end.live, end, end.seconds, round_idx)
        self.finish(end.given_up, end, end.given_up_seconds, round_idx)

    def finish(self, silos: Sequence[int], end: EndRun, seconds: float, round_idx: int) -> None:
        """Send ``silos`` FINISH within ``seconds``; best effort, for the run is ending either way."""
        if not silos:
            return
        finish = [to_silo(MyMessage.MSG_TYPE_S2C_FINISH, s, round_idx=round_idx, reason=end.reason) for s in silos]
        try:
            # They listened: a closed port now means they ended.
            untold = self.transport.send_all(finish, time.monotonic() + seconds, gone_if_refused=set(end.heard_from))
            for silo, err in sorted(untold.items()):
                if silo in getattr(self.transport, "told_run_over", ()):
                    logger.info("silo rank %d heard that the run is over when it announced itself", silo)
                    continue
                logger.warning(
                    "silo rank %d was not told that the run is over (%s); if it is still running it stops "
                    "at its own idle limit",
                    silo,
                    err,
                )
        except Exception as err:  # noqa: BLE001 - best effort: the run is ending either way, for its own reason
            logger.warning("could not tell every silo to stop: %s", err)
