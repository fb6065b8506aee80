"""What a data-owner silo keeps of a run, for its organization's own record (the server keeps
the run's): its user's evaluations, the last global model it evaluated and the round that keyed
that evaluation, the last round it trained and its answer to that round (so a server that resumes
gets it again, never a retraining), the survivor list it unmasked that round for, and why the
server ended the run early, if it did.
The run layer may keep it as it changes (``keep``), so a silo process started again carries on
from it (run/silo_record.py's ``SiloProgress``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.types import StateDict


def state_digest(state: Dict[str, torch.Tensor]) -> str:
    """A digest of a model's every name, dtype, shape and bit (which model a round was trained on)."""
    digest = hashlib.sha256(b"pfa-model")
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(b"|%s|%s|%s|" % (name.encode(), str(tensor.dtype).encode(), str(tuple(tensor.shape)).encode()))
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class StoredAnswer:
    """A silo's answer to the last round it trained: the model it was sent (digest), the model it
    trained and the samples it declared."""

    round_idx: int
    model_digest: str
    weights: StateDict
    samples: int


@dataclass
class SiloOutcome:
    """Filled in by the silo's manager as the run goes (:mod:`.client`), read at its end."""

    user: Optional[int] = None  # the silo's own user
    evaluations: List[Dict[str, Any]] = field(default_factory=list)  # the counts sent, round by round
    model: Optional[StateDict] = None  # the last global model evaluated
    model_round: Optional[int] = None  # the round that keyed that evaluation (its personalization)
    ended_early: Optional[str] = None  # the server's reason, when it ended the run early
    trained_round: Optional[int] = None  # the last round the silo trained its user in
    answer: Optional[StoredAnswer] = None  # its answer to that round
    unmasked: Optional[Tuple[int, Tuple[int, ...]]] = None  # (round, survivors) it last revealed shares for
    # (round, survivors) it last revealed its evaluation's shares for (secure aggregation sums evaluations too)
    unmasked_evaluation: Optional[Tuple[int, Tuple[int, ...]]] = None
    keep: Optional[Callable[["SiloOutcome"], None]] = field(default=None, repr=False, compare=False)

    def evaluated(self, counts: Dict[str, Any], model: StateDict) -> None:
        self.evaluations.append(dict(counts))
        self.model, self.model_round = model, int(counts["round"])
        self._kept()

    def trained(self, round_idx: int, answer: Optional[StoredAnswer] = None) -> None:
        self.trained_round, self.answer = int(round_idx), answer
        self._kept()

    def unmasking_problem(self, round_idx: int, survivors: Sequence[int], evaluation: bool = False) -> Optional[str]:
        """Why the silo must not reveal its shares of round ``round_idx`` (``evaluation``: of the
        evaluation after it) for ``survivors`` (it did so for another list: two sums over two lists
        give the missing silos' inputs by subtraction), or None. Changes nothing."""
        listed = tuple(sorted(int(s) for s in survivors))
        done = self.unmasked_evaluation if evaluation else self.unmasked
        if done is not None and done[0] == int(round_idx) and done[1] != listed:
            what = f"the evaluation after round {round_idx}" if evaluation else f"round {round_idx}"
            inputs = "figures" if evaluation else "updates"
            return (
                f"{what} was already unmasked for the survivors {list(done[1])}; a second sum over {list(listed)} "
                f"would give the missing silos' {inputs} by subtraction"
            )
        return None

    def unmasked_for(self, round_idx: int, survivors: Sequence[int], evaluation: bool = False) -> None:
        """The silo's shares of round ``round_idx`` (``evaluation``: of its evaluation) for
        ``survivors`` are about to leave: kept before they do (a round declined before this point
        is not recorded, so a resumed server may run it again)."""
        listed = (int(round_idx), tuple(sorted(int(s) for s in survivors)))
        if evaluation:
            self.unmasked_evaluation = listed
        else:
            self.unmasked = listed
        self._kept()

    def _kept(self) -> None:
        if self.keep is not None:
            self.keep(self)
