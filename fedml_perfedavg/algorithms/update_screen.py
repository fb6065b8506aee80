"""Which client updates a round may average, for every algorithm alike: each update is checked
against the global model before any defense or average sees it, and the record of what was
rejected and which rounds had nothing left is kept for the summary and checkpoints."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import RunStopped
from ..core.guards import update_bound, update_problem
from ..core.types import StateDict

logger = logging.getLogger(__name__)


class UpdateScreen:
    """Updates that do not fit the global model (keys, shapes, dtypes, finiteness,
    ``max_update_ratio``, ``max_update_norm``) are rejected, logged and counted by round; a round
    with none left is skipped, and ``max_skipped_rounds`` such rounds stop the run."""

    def __init__(
        self,
        parameter_names: List[str],
        max_update_norm: Optional[float],
        max_update_ratio: Optional[float],
        max_skipped_rounds: int,
    ) -> None:
        self.parameter_names = parameter_names
        self.max_update_norm, self.max_update_ratio = max_update_norm, max_update_ratio
        self.max_skipped_rounds = max_skipped_rounds
        self.rejected: Dict[int, int] = {}  # round -> client updates rejected
        self.skipped_rounds = 0
        self._bound_logged = False

    def accept(
        self, round_idx: int, updates: Sequence[Tuple[float, StateDict]], global_state: StateDict
    ) -> List[Tuple[float, StateDict]]:
        """The updates of ``round_idx`` that fit ``global_state``, in their order."""
        if self.max_update_ratio is not None and not self._bound_logged:
            self._bound_logged = True
            logger.info(
                "client updates are bounded: ||w_i - w|| <= train_args.max_update_ratio=%g x max(||w||, 1) "
                "(%.4g in round %d); larger ones are rejected",
                self.max_update_ratio,
                update_bound(global_state, self.max_update_ratio, self.parameter_names),
                round_idx,
            )
        accepted = []
        for position, (samples, update) in enumerate(updates):
            problem = update_problem(
                update, global_state, self.max_update_norm, self.parameter_names, self.max_update_ratio
            )
            if problem is None:
                accepted.append((samples, update))
            else:
                logger.warning("round %d: rejected client update %d: %s", round_idx, position, problem)
        if len(accepted) < len(updates):
            self.rejected[round_idx] = len(updates) - len(accepted)
        return accepted

    def skip(self, round_idx: int) -> None:
        """``round_idx`` had no acceptable update (the global model is kept); :class:`RunStopped`
        at the ``max_skipped_rounds``-th such round."""
        self.skipped_rounds += 1
        logger.error(
            "round %d: no acceptable client update; the global model is kept (%d such rounds, "
            "train_args.max_skipped_rounds=%d)",
            round_idx,
            self.skipped_rounds,
            self.max_skipped_rounds,
        )
        if self.skipped_rounds >= self.max_skipped_rounds:
            raise RunStopped(
                f"{self.skipped_rounds} rounds had no acceptable client update (train_args."
                f"max_skipped_rounds={self.max_skipped_rounds}); last at round {round_idx}"
            )

    def state_dict(self) -> Dict[str, Any]:
        return {"skipped_rounds": self.skipped_rounds, "rejected": dict(self.rejected)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skipped_rounds = int(state["skipped_rounds"])
        self.rejected = {int(k): int(v) for k, v in state["rejected"].items()}
