"""The cross-silo server's phases and its one deadline (FedML's server manager has neither: it
waits for every silo forever). What the deadlines are is :class:`~.policy.SiloPolicy`'s; this is
where the server keeps which phase is open, since when, and what its rounds took."""

from __future__ import annotations

import enum
import logging
from typing import Optional

from .policy import SiloPolicy

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    ONLINE = "coming online"
    TRAINING = "training"
    EVALUATING = "evaluating"
    FINISHING = "finishing"
    DONE = "done"


# DONE is also where a stopped run goes, from any phase.
TRANSITIONS = {
    Phase.STARTING: {Phase.ONLINE, Phase.DONE},
    Phase.ONLINE: {Phase.TRAINING, Phase.DONE},
    Phase.TRAINING: {Phase.TRAINING, Phase.EVALUATING, Phase.FINISHING, Phase.DONE},
    Phase.EVALUATING: {Phase.TRAINING, Phase.DONE},
    Phase.FINISHING: {Phase.DONE},
    Phase.DONE: set(),
}


class PhaseClock:
    """The open phase, when it opened and its deadline (on the events' clock; None: none), and
    the slowest of the rounds measured so far, from which ``policy`` adapts the round deadline.
    It reads no clock: every call says what time it is."""

    def __init__(self, policy: SiloPolicy) -> None:
        self.policy = policy
        self.phase = Phase.STARTING
        self.opened = 0.0
        self.deadline: Optional[float] = None
        self.slowest_round: Optional[float] = None  # of the rounds every silo answered in time
        self.rounds_measured = 0
        self._adaptive_logged = False

    def enter(self, phase: Phase, now: float, seconds: Optional[float] = None) -> None:
        """Open ``phase`` at ``now``, with a deadline ``seconds`` away (None: none)."""
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"cross-silo server: no transition from {self.phase.name} to {phase.name}")
        self.phase = phase
        self.opened = now
        self.deadline = None if seconds is None else self.opened + seconds

    def disarm(self) -> None:
        """The open phase's deadline was acted on (or no longer applies): it passes no more."""
        self.deadline = None

    def passed(self, now: float) -> bool:
        """Whether the open phase has a deadline and it has passed at ``now``."""
        return self.deadline is not None and now >= self.deadline

    def measure_round(self, now: float) -> None:
        """The open round was answered by every silo in time: it counts toward the adaptive deadline."""
        self.slowest_round = max(now - self.opened, self.slowest_round or 0.0)
        self.rounds_measured += 1

    def round_seconds(self) -> float:
        """The round deadline as of the rounds measured so far; logged the first time it adapts."""
        wait = self.policy.round_deadline(self.slowest_round, self.rounds_measured)
        if wait < self.policy.round_timeout and not self._adaptive_logged:
            self._adaptive_logged = True
            logger.info(
                "round deadline now %.1f s: %g x the slowest round so far (%.2f s; comm_args."
                "round_timeout_factor), at most comm_args.round_timeout=%g s",
                wait,
                self.policy.round_timeout_factor,
                self.slowest_round,
                self.policy.round_timeout,
            )
        return wait

    def deadline_words(self, now: float) -> str:
        """The passed deadline, and when at ``now`` it was acted on (the deadline actually
        applied, which the record keeps), in words for a log line."""
        assert self.deadline is not None
        return (
            f"{self.deadline - self.opened:.1f} s (the round deadline, see comm_args.round_timeout_factor; "
            f"acted on {now - self.opened:.1f} s after the phase opened)"
        )
