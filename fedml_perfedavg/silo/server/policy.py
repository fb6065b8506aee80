"""How cross-silo processes wait for each other and what they do when a peer is gone: pure
functions of the measured rounds, with no clock, socket or FedML in them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class SiloPolicy:
    """Deadlines follow the run: once ``ADAPT_AFTER_ROUNDS`` rounds were measured, the server
    waits ``round_timeout_factor`` times the median of the last ``RECENT_ROUNDS`` measured rounds
    (at least ``MIN_ADAPTIVE_SECONDS``, at most ``round_timeout``), and a silo gives up on a server
    it has not heard from for the factor times the slowest gap between the server's models. The
    median of recent rounds, not the slowest ever: one slow round (the first after a resume took
    34.8 s where the others took 3) would otherwise make every later lost silo cost ten times it."""

    connect_timeout: float  # keep retrying a peer that is not listening this long
    round_timeout: float  # the server waits this long for silos in any phase (the ceiling)
    min_clients: int  # after the deadline, go on if at least this many silos answered
    round_timeout_factor: float = 0.0  # 0: always round_timeout

    ADAPT_AFTER_ROUNDS = 2
    MIN_ADAPTIVE_SECONDS = 5.0
    RECENT_ROUNDS = 5

    def round_deadline(self, measured: Sequence[float]) -> float:
        """Seconds the server gives a round (sending its models and waiting for the updates), from
        the durations of the rounds measured so far (every silo answered in time), oldest first."""
        if not self.round_timeout_factor or len(measured) < self.ADAPT_AFTER_ROUNDS:
            return self.round_timeout
        typical = recent_median(measured, self.RECENT_ROUNDS)
        return min(self.round_timeout, max(self.MIN_ADAPTIVE_SECONDS, self.round_timeout_factor * typical))

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
        return min(
            self.client_idle_limit,
            max(self.MIN_ADAPTIVE_SECONDS, self.round_timeout_factor * slowest_gap) + self.MIN_ADAPTIVE_SECONDS,
        )

    def after_deadline(self, expected: Sequence[int], answered: Sequence[int]) -> Tuple[bool, list]:
        """At a deadline: (go on?, the silos given up on). The run goes on without the silos that
        did not answer if at least ``min_clients`` did."""
        missing = [s for s in expected if s not in set(answered)]
        return len(expected) - len(missing) >= self.min_clients, missing


def recent_median(measured: Sequence[float], last: int) -> float:
    """The median of the last ``last`` of ``measured``."""
    return statistics.median(measured[-last:])


NOTICE_SECONDS = 2.0  # a notice to a silo (a refusal, an acknowledgement) is not waited on longer
# The end of a run is told within this: a silo that misses it waits out its idle limit (minutes). A
# silo that was heard from and whose port now refuses connections has ended and is not waited for,
# so Ctrl-C stays quick; one never heard from may still be starting up and is retried.
FINISH_SECONDS = 5.0
# A silo that takes part and announces itself again from the same process is answered at most once
# in this long; the rest are counted as refusals (a flood of valid announcements costs the server
# nothing else).
ANNOUNCE_INTERVAL_SECONDS = 5.0
