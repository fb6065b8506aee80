"""Which silos take part in a cross-silo run, apart from the phases (server.py): announcements
accepted or refused, silos given up on at a deadline and taken back when they announce themselves
again. FedML's server has no such notion: it waits for every silo it ever knew, forever."""

from __future__ import annotations

import enum
import logging
from typing import Any, Dict, List, Optional

from ...algorithms.base import RoundDriver
from ...core.errors import SiloFailure
from .mail import ServerMail
from .policy import SiloPolicy
from .roster import SiloRoster

logger = logging.getLogger(__name__)

DISAGREEMENT = "disagreement"  # a refused announcement, as summary.json's refusals count it


class TooFewSilos(SiloFailure):
    """Fewer than ``min_clients`` of a phase's silos are left: the server stops the run."""


class Greeting(enum.Enum):
    """What an accepted announcement means."""

    ONLINE = "came online before training"
    BACK = "was given up on and is back"
    RESTARTED = "takes part and restarted: its earlier process's open work will not come"
    KNOWN = "takes part, from the same process"


class SiloMembership:
    """``roster`` knows the silos; ``policy`` says how many must be left; ``driver`` records each
    silo given up on or taken back; ``mail`` tells a refused silo why."""

    def __init__(self, roster: SiloRoster, policy: SiloPolicy, driver: RoundDriver, mail: ServerMail) -> None:
        self.roster, self.policy, self.driver, self.mail = roster, policy, driver, mail

    def give_up_on(self, round_idx: int, silos: List[int], why: str, go_on: bool) -> None:
        """The run goes on without ``silos`` (``why``: what they failed to do), or, unless
        ``go_on``, stops (:class:`TooFewSilos`, with the silos still live so they are told)."""
        if not silos:
            return
        self.driver.record_lost_silos(round_idx, sorted(silos), why)
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

    def refuse(self, round_idx: int, silo: int, problem: str, training_started: bool) -> bool:
        """Refuse ``silo``'s announcement: it is told why and stops. Before training, the run
        stops if too few silos are left; after, it goes on. True if the silo was taking part."""
        logger.error("%s; it is refused", problem)
        self.mail.count_refusal(silo, DISAGREEMENT, problem)
        self.mail.tell_refused(silo, problem)
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
            self.driver.record_rejoined_silo(round_idx, silo, why)
            return Greeting.BACK
        return Greeting.RESTARTED if restarted else Greeting.KNOWN
