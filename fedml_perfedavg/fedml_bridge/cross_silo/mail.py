"""What the cross-silo server sends its silos, apart from when it sends it (server.py): every
send has a deadline, a notice is never waited on long, and the end of a run reaches the silos
given up on too. FedML's server manager sends each message with no deadline, one after another,
so one silo that does not take a message holds up the others (cross_silo/server/fedml_server_manager.py)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from ..bootstrap import import_fedml
from .delivery import PeerUnreachable
from .roster import SiloRoster
from .transport import ROUND_KEY
from . import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)

NOTICE_SECONDS = 2.0  # a notice to a silo (a refusal, an acknowledgement) is not waited on longer
# The end of a run is told within this: a silo that misses it waits out its idle limit (minutes). A
# silo that was heard from and whose port now refuses connections has ended and is not waited for,
# so Ctrl-C stays quick; one never heard from may still be starting up and is retried.
FINISH_SECONDS = 5.0


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


class ServerMail:
    """The server's sends through ``transport`` (the plugin's gRPC manager), with ``roster``
    saying who was heard from and who was given up on."""

    def __init__(self, transport: Any, roster: SiloRoster) -> None:
        self.transport, self.roster = transport, roster

    def send(self, messages: List[Message], deadline: Optional[float]) -> Dict[int, PeerUnreachable]:
        """Send at once, each before ``deadline`` (the open phase's); returns the silos that could
        not be reached."""
        assert deadline is not None  # every phase that sends models has a deadline
        return self.transport.send_all(messages, deadline)

    def notify(self, messages: List[Message]) -> None:
        """Send notices without letting a silo that does not take them hold the server up."""
        for silo, err in sorted(self.transport.send_all(messages, time.monotonic() + NOTICE_SECONDS).items()):
            logger.info("a notice to silo rank %d was not delivered: %s", silo, err)

    def acknowledge(self, silo: int) -> None:
        """Answer a silo's announcement: "I hear you"."""
        self.notify([to_silo(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, silo)])

    def tell_refused(self, silo: int, problem: str) -> None:
        """Tell a refused silo why; it stops."""
        reason = f"refused by the server: {problem}"
        self.notify([to_silo(MyMessage.MSG_TYPE_S2C_FINISH, silo, reason=reason, refused=True)])

    def tell_if_left_out(self, silo: int) -> None:
        """A silo the server gave up on sent work (it answered late, or was frozen): tell it, once,
        to announce itself again, rather than leave it to notice the server's silence."""
        if self.roster.left_out_notice(silo):
            logger.info("silo rank %d was given up on and still sends work; it is told to announce itself", silo)
            self.notify([to_silo(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, silo, left_out=True)])

    def count_refusal(self, silo: int, reason: str, text: str) -> None:
        """Count and log (rate-limited) a refused message of ``silo``'s."""
        self.transport.refusals.refuse(f"rank {silo}", reason, text, f"silo rank {silo}")

    def refusal_totals(self) -> Dict[str, int]:
        return dict(self.transport.refusals.totals)

    def tell_run_over(self, reason: Optional[str], seconds: float) -> None:
        """Tell the live silos that the run is over (``reason``: it failed) within ``seconds``,
        then, within at most FINISH_SECONDS, those given up on (they may still be waiting, or be
        gone for good), without waiting on any that do not answer."""
        self.finish(self.roster.live, reason, seconds)
        self.finish(self.roster.given_up(), reason, min(seconds, FINISH_SECONDS))

    def finish(self, silos: List[int], reason: Optional[str], seconds: float) -> None:
        """Send ``silos`` FINISH within ``seconds``; best effort, for the run is ending either way."""
        if not silos:
            return
        finish = [to_silo(MyMessage.MSG_TYPE_S2C_FINISH, silo, reason=reason) for silo in silos]
        try:
            heard_from = set(self.roster.hellos)  # they listened: a closed port now means they ended
            untold = self.transport.send_all(finish, time.monotonic() + seconds, gone_if_refused=heard_from)
            for silo, err in sorted(untold.items()):
                logger.warning(
                    "silo rank %d was not told that the run is over (%s); if it is still running it stops "
                    "at its own idle limit",
                    silo,
                    err,
                )
        except Exception as err:  # noqa: BLE001 - best effort: the run is ending either way, for its own reason
            logger.warning("could not tell every silo to stop: %s", err)
