"""What the cross-silo server's protocol is waiting for (:mod:`.protocol` decides when): the open
round's silos and their updates, the open evaluation's silos and their counts (data-owner mode),
and the silos' own evaluations of the models they received (shared mode). What a silo sends is
checked here against what the roster knows, never taken from the message. Nothing here reads a
clock or sends: refusals and records go to the event's :class:`~.events.Outbox`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set

from .events import Outbox
from .roster import Assignment, SiloRoster, silo_accuracies

logger = logging.getLogger(__name__)

SAMPLE_COUNT, BAD_FIGURES = "sample-count", "bad-figures"  # kinds of refused messages (summary.json)
Refuse = Callable[[int, str, str], None]  # (silo, kind, why)


@dataclass
class OpenRound:
    """Round ``index``: its silos (``expected``; data-owner mode: offline ones too), the live ones
    sent its model (silo -> (position in the sample, user)) and those that answered."""

    index: int
    expected: List[int]
    assigned: Assignment
    answered: Set[int] = field(default_factory=set)
    updates: Dict[int, tuple] = field(default_factory=dict)  # position -> (sample count, model)

    def offline(self) -> List[int]:
        return [s for s in self.expected if s not in self.assigned]

    def takes(self, silo: int, stamped: Any) -> bool:
        """Whether an update from ``silo`` stamped ``stamped`` is one this round waits for."""
        return silo in self.assigned and stamped == self.index and silo not in self.answered

    def take(self, silo: int, declared: Any, model: Any, roster: SiloRoster, refuse: Refuse) -> bool:
        """Note ``silo``'s answer; keep its model if it declares its user's true sample count."""
        self.answered.add(silo)
        position, user = self.assigned[silo]
        known = roster.counts_of(silo, user)[0]
        if declared != known:
            refuse(
                silo,
                SAMPLE_COUNT,
                f"round {self.index}: silo rank {silo} sent num_samples={declared!r} for user {user}, who has "
                f"{known} training samples; its update is rejected",
            )
            return False
        self.updates[position] = (known, model)
        return True

    def complete(self) -> bool:
        """Every silo sent the model answered."""
        return set(self.assigned) <= self.answered

    def answered_by_all(self) -> bool:
        """Every silo of the round answered (only such rounds measure what a round takes)."""
        return self.complete() and set(self.expected) <= self.answered

    def forget(self, silo: int) -> bool:
        """``silo`` restarted or left: an update it still owed will not come (one it sent stays).
        True if one was still awaited."""
        if silo in self.assigned and silo not in self.answered:
            self.assigned.pop(silo)
            return True
        return False

    def user_of(self, silo: int) -> Optional[int]:
        return self.assigned[silo][1] if silo in self.assigned else None


class OpenEvaluation:
    """Data-owner mode: every live silo evaluates the model after ``round_idx`` on its own data."""

    def __init__(self, round_idx: int, silos: List[int], now: float = 0.0) -> None:
        self.round_idx = round_idx
        self.awaiting: Set[int] = set(silos)
        self.counts: Dict[int, Dict[str, Any]] = {}  # user -> counts
        self.started = now

    def take(self, silo: int, counts: Dict[str, Any], roster: SiloRoster, refuse: Refuse) -> None:
        """Note ``silo``'s counts, if they are of its own user's test split after this round."""
        self.awaiting.discard(silo)
        problem = roster.figures_problem(silo, counts, silo - 1, self.round_idx)
        if problem is not None:
            refuse(silo, BAD_FIGURES, f"{problem}; user {silo - 1} is missing from round {self.round_idx}'s evaluation")
        else:
            self.counts[silo - 1] = counts

    def record(self, outbox: Outbox, silos: List[int]) -> None:
        """Record the counts; the users of ``silos`` without any are listed as missing."""
        missing = [s - 1 for s in silos if s - 1 not in self.counts]
        outbox.record("record_federated_evaluation", self.round_idx, dict(self.counts), missing, self.started)


class SiloOwnEvaluations:
    """Shared mode: each silo's personalized evaluation of the model it received, sent with its
    update or goodbye, logged and recorded once per round."""

    def __init__(self, roster: SiloRoster, outbox: Outbox) -> None:
        self.roster, self.outbox = roster, outbox
        self.reported: Dict[int, Dict[str, Any]] = {}  # silo -> its last counts

    def note(self, silo: int, counts: Optional[Dict[str, Any]], user: Optional[int], round_idx: int) -> None:
        if counts is None or user is None:
            return
        problem = self.roster.figures_problem(silo, counts, user, round_idx)
        if problem is not None:
            self.outbox.refuse(silo, BAD_FIGURES, f"{problem}; its figures are not recorded")
            return
        self.reported[silo] = counts

    def log(self, label: str) -> None:
        if not self.reported:
            return
        mean, entries = silo_accuracies(self.reported)
        logger.info(
            "%s: silos' own personalized accuracy %.4f (model they received, mean of %d silos, each on its user: %s)",
            label,
            mean,
            len(entries),
            ", ".join(f"rank {s} user {e['user']} {e['accuracy']:.4f}" for s, e in entries.items()),
        )
        self.outbox.record("record_silo_evaluation", label, mean, entries)
        self.reported = {}
