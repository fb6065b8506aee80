"""Which silos take part in a cross-silo run, apart from the phases (:mod:`.protocol`):
announcements accepted or refused, silos given up on at a deadline and taken back when they
announce themselves again. FedML's server has no such notion: it waits for every silo it ever
knew, forever. Records and notices go to the event's :class:`~.events.Outbox`."""

from __future__ import annotations

import enum
import logging
from typing import Any, Dict, List, Optional

from ...core.errors import SiloFailure
from ...net import wire
from .events import NOTICE, Outbox, ToSilo
from .policy import ANNOUNCE_INTERVAL_SECONDS, NOTICE_SECONDS, SiloPolicy
from .roster import SiloRoster

logger = logging.getLogger(__name__)

DISAGREEMENT = wire.DISAGREEMENT  # a refused announcement, as summary.json's refusals count it
REPEATED = "repeated-announcement"  # one more announcement of a process already answered just now


class TooFewSilos(SiloFailure):
    """Fewer than ``min_clients`` of a phase's silos are left: the server stops the run."""


class Greeting(enum.Enum):
    """What an accepted announcement means."""

    ONLINE = "came online before training"
    BACK = "was given up on and is back"
    RESTARTED = "takes part and restarted: its earlier process's open work will not come"
    KNOWN = "takes part, from the same process"


class SiloMembership:
    """``roster`` knows the silos; ``policy`` says how many must be left; ``outbox`` takes the
    record of each silo given up on or taken back, and the notice that tells a refused silo why."""

    def __init__(self, roster: SiloRoster, policy: SiloPolicy, outbox: Outbox) -> None:
        self.roster, self.policy, self.outbox = roster, policy, outbox
        self.answered: Dict[int, float] = {}  # silo -> when its last announcement was answered

    def give_up_on(self, round_idx: int, silos: List[int], why: str, go_on: bool) -> None:
        """The run goes on without ``silos`` (``why``: what they failed to do), or, unless
        ``go_on``, stops (:class:`TooFewSilos`, with the silos still live so they are told)."""
        if not silos:
            return
        self.outbox.record("record_lost_silos", round_idx, sorted(silos), why)
        if not go_on:
            raise TooFewSilos(
                f"round {round_idx}: silo rank(s) {sorted(silos)} {why}; fewer than comm_args."
                f"min_clients_per_round={self.policy.min_clients} of the round's silos answered"
            )
        left = len([s for s in self.roster.live if s not in silos])
        logger.warning(
            "round %d: going on without silo rank(s) %s (%s); %d left, comm_args.min_clients_per_round=%d",
            round_idx,
            sorted(silos),
            why,
            left,
            self.policy.min_clients,
        )
        self.roster.drop(silos)

    def refuse(self, now: float, round_idx: int, silo: int, problem: str, training_started: bool) -> bool:
        """Refuse ``silo``'s announcement: it is told why and stops. Before training, the run
        stops if too few silos are left; after, it goes on. True if the silo was taking part."""
        logger.error("%s; it is refused", problem)
        self.outbox.refuse(silo, DISAGREEMENT, problem)
        told = ToSilo(wire.FINISH, silo, round_idx, reason=f"refused by the server: {problem}"[:2000], refused=True)
        self.outbox.send([told], now + NOTICE_SECONDS, NOTICE)
        if silo not in self.roster.live:
            return False
        left = [s for s in self.roster.live if s != silo]
        go_on = training_started or len(left) >= self.policy.min_clients
        self.roster.refuse(silo)  # it was told why; a stop that follows need not tell it again
        self.give_up_on(round_idx, [silo], f"refused: {problem}", go_on)
        return True

    def greet(
        self, round_idx: int, silo: int, announced: Dict[str, Any], session: Optional[str], training_started: bool
    ) -> Greeting:
        """Accept ``silo``'s announcement (:meth:`SiloRoster.problem_with` found nothing wrong)."""
        restarted = self.roster.greet(silo, announced, session)
        if not training_started:
            self.roster.online.add(silo)
            return Greeting.ONLINE
        if silo not in self.roster.live:
            self.roster.take_back(silo)
            why = "it announced itself again" + (" from a new process" if restarted else "")
            logger.warning(
                "round %d: silo rank %d is back (%s); it takes part from the next round", round_idx, silo, why
            )
            self.outbox.record("record_rejoined_silo", round_idx, silo, why)
            return Greeting.BACK
        return Greeting.RESTARTED if restarted else Greeting.KNOWN

    def tell_if_left_out(self, now: float, round_idx: int, silo: int) -> None:
        """A silo the server gave up on sent work (it answered late, or was frozen): tell it, once,
        to announce itself again, rather than leave it to notice the server's silence."""
        if self.roster.left_out_notice(silo):
            logger.info("silo rank %d was given up on and still sends work; it is told to announce itself", silo)
            self.outbox.send([ToSilo(wire.CHECK_STATUS, silo, round_idx, left_out=True)], now + NOTICE_SECONDS, NOTICE)

    def acknowledge(self, now: float, round_idx: int, silo: int, greeting: Greeting) -> None:
        """Answer a silo's announcement: "I hear you". A process already taking part is answered
        at most once per ANNOUNCE_INTERVAL_SECONDS; its other announcements are counted refusals."""
        if greeting is Greeting.KNOWN and now - self.answered.get(silo, -ANNOUNCE_INTERVAL_SECONDS) < (
            ANNOUNCE_INTERVAL_SECONDS
        ):
            why = f"silo rank {silo} announced itself again within {ANNOUNCE_INTERVAL_SECONDS:g} s; not answered"
            self.outbox.refuse(silo, REPEATED, why)
            return
        self.answered[silo] = now
        self.outbox.send([ToSilo(wire.CHECK_STATUS, silo, round_idx)], now + NOTICE_SECONDS, NOTICE)
