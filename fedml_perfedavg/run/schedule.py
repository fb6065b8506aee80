"""Which rounds of a run are evaluated, measured and checkpointed: one place, pure rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundSchedule:
    """``validation_args.frequency_of_the_test``, ``stationarity_every`` and
    ``common_args.checkpoint_every`` over ``comm_round`` rounds; the last round is always
    evaluated, measured (when measuring at all) and checkpointed (when checkpointing at all)."""

    comm_round: int
    frequency_of_the_test: int
    stationarity_every: int = 0
    checkpoint_every: int = 0

    @classmethod
    def from_config(cls, config: Any) -> "RoundSchedule":
        every = config.common.checkpoint_every
        if config.common.training_type == "cross_silo" and every:
            every = 1  # a crashed server resumes from the round it was in: nothing done by the silos is lost
        return cls(
            config.train.comm_round,
            config.validation.frequency_of_the_test,
            config.validation.stationarity_every,
            every,
        )

    def is_last(self, round_idx: int) -> bool:
        return round_idx == self.comm_round - 1

    def evaluates(self, round_idx: int) -> bool:
        """The personalized evaluation of the global model after this round."""
        return self.is_last(round_idx) or round_idx % self.frequency_of_the_test == 0

    def measures_stationarity(self, round_idx: int) -> bool:
        """The paper's ||grad F(w)||^2 with this round's evaluation."""
        every = self.stationarity_every
        return bool(every) and self.evaluates(round_idx) and (self.is_last(round_idx) or round_idx % every == 0)

    def checkpoints(self, round_idx: int) -> bool:
        """A checkpoint after this round (the last round's too: --resume with a larger comm_round
        continues a finished run)."""
        every = self.checkpoint_every
        return bool(every) and ((round_idx + 1) % every == 0 or self.is_last(round_idx))
