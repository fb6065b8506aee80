"""The cross-silo server's phases and its one deadline (FedML's server manager has neither: it
waits for every silo forever). What the deadlines are is :class:`~.policy.SiloPolicy`'s; this is
where the server keeps which phase is open, since when, and what its rounds took."""

from __future__ import annotations

import enum
import logging
from typing import List, Optional

from .policy import SiloPolicy, recent_median

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
    the durations of the rounds measured so far, from which ``policy`` adapts the round deadline.
    It reads no clock: every call says what time it is."""

    def __init__(self, policy: SiloPolicy) -> None:
        self.policy = policy
        self.phase = Phase.STARTING
        self.opened = 0.0
        self.deadline: Optional[float] = None
        self.measured: List[float] = []  # the durations of the rounds every silo answered in time
        self._logged_deadline: Optional[float] = None

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
        self.measured.append(now - self.opened)

    @property
    def rounds_measured(self) -> int:
        return len(self.measured)

    def round_seconds(self) -> float:
        """The round deadline as of the rounds measured so far; logged when it adapts first, and
        whenever it moves by more than a fifth since it was last logged."""
        wait = self.policy.round_deadline(self.measured)
        logged = self._logged_deadline
        if wait < self.policy.round_timeout and (logged is None or abs(wait - logged) > 0.2 * logged):
            self._logged_deadline = wait
            logger.info(
                "round deadline now %.1f s: %g x the median of the last %d measured rounds (%.2f s; comm_args."
                "round_timeout_factor), at least %g s, at most comm_args.round_timeout=%g s",
                wait,
                self.policy.round_timeout_factor,
                min(self.policy.RECENT_ROUNDS, len(self.measured)),
                recent_median(self.measured, self.policy.RECENT_ROUNDS),
                self.policy.MIN_ADAPTIVE_SECONDS,
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
