"""What a data-owner silo keeps of a run, for its organization's own record (the server keeps
the run's): its user's evaluations, the last global model it evaluated and the round that keyed
that evaluation, the last round it trained, and why the server ended the run early, if it did.
The run layer may keep it as it changes (``keep``), so a silo process started again carries on
from it (run/silo_record.py's ``SiloProgress``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ...core.types import StateDict


@dataclass
class SiloOutcome:
    """Filled in by the silo's manager as the run goes (:mod:`.client`), read at its end."""

    user: Optional[int] = None  # the silo's own user
    evaluations: List[Dict[str, Any]] = field(default_factory=list)  # the counts sent, round by round
    model: Optional[StateDict] = None  # the last global model evaluated
    model_round: Optional[int] = None  # the round that keyed that evaluation (its personalization)
    ended_early: Optional[str] = None  # the server's reason, when it ended the run early
    trained_round: Optional[int] = None  # the last round the silo trained its user in
    keep: Optional[Callable[["SiloOutcome"], None]] = field(default=None, repr=False, compare=False)

    def evaluated(self, counts: Dict[str, Any], model: StateDict) -> None:
        self.evaluations.append(dict(counts))
        self.model, self.model_round = model, int(counts["round"])
        self._kept()

    def trained(self, round_idx: int) -> None:
        self.trained_round = int(round_idx)
        self._kept()

    def _kept(self) -> None:
        if self.keep is not None:
            self.keep(self)
