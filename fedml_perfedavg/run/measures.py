"""What a run measures when it evaluates a global model: the personalized evaluation (the
algorithm's own), the algorithm's own scalars, and the paper's extra measures (stationarity
``||grad F(w)||^2`` and the random iterate of the remark after Theorem 4.5)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Sequence, Tuple

import torch
from torch import Tensor

from ..algorithms.base import FederatedAlgorithm, average
from ..core.client_maths import LocalBatches
from ..core.evaluation import EvaluationResult
from ..core.sampling import random_iterate_step
from ..core.stationarity import stationarity
from ..core.types import StateDict, UserSplit


class Measurements:
    """Evaluates global models of one run (``headline``: how the run reports a result)."""

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        users: Sequence[UserSplit],
        config,
        held_out: Sequence[int],
        headline: Callable[[EvaluationResult], Dict[str, float]],
        device,
    ) -> None:
        self.algorithm, self.users, self.config = algorithm, users, config
        self.trained = [i for i in range(len(users)) if i not in set(held_out)]
        self.headline = headline
        self.device = device

    def evaluate(
        self, round_idx: int, state: StateDict, previous: StateDict, measure_stationarity: bool
    ) -> Tuple[EvaluationResult, Dict[str, float]]:
        """The personalized evaluation of ``state`` (the model after ``round_idx``) and the extra
        scalars recorded with it (``previous``: the model the round started from)."""
        state = {k: v.to(self.device) for k, v in state.items()}
        result = self.algorithm.evaluate(round_idx, state, self.users)
        extra = {**self.algorithm.describe(state), **self.stationarity(state, "", measure_stationarity)}
        if self.config.validation.random_iterate:
            start = {k: v.to(self.device) for k, v in previous.items()}
            extra.update(self.random_iterate(round_idx, start, measure_stationarity))
        return result, extra

    def stationarity(self, state: StateDict, prefix: str, measure: bool) -> Dict[str, float]:
        """``||grad F(w)||^2`` of ``state`` over the users training covers, where ``measure``."""
        if not measure:
            return {}
        params, _ = self.algorithm.split_state(state)
        return {
            f"{prefix}stationarity": stationarity(
                self.algorithm.loss_fn, params, self.users, self.config.train.alpha, self.trained
            )
        }

    def random_iterate(self, round_idx: int, start: StateDict, measure: bool) -> Dict[str, float]:
        """The average of the round's clients' iterates at a uniform step t_k (recomputed from the
        round's start, with the round's own batches), evaluated like the global model."""
        step = random_iterate_step(self.config.common.random_seed, round_idx, self.config.train.local_steps)
        clients = self.algorithm.sample_clients(round_idx)
        iterates = [
            (
                1.0,
                client_iterate(self.algorithm, round_idx, c, start, self.users[c].train_x, self.users[c].train_y, step),
            )
            for c in clients
        ]
        state = average(iterates, "uniform")
        metrics = self.headline(self.algorithm.evaluate(round_idx, state, self.users))
        return {
            "random_iterate_step": step,
            **{f"random_iterate_{k}": metrics[k] for k in ("personalized_accuracy", "accuracy_before_adaptation")},
            **self.stationarity(state, "random_iterate_", measure),
        }


def client_iterate(
    algorithm: FederatedAlgorithm,
    round_idx: int,
    client_id: int,
    global_state: StateDict,
    x: Tensor,
    y: Tensor,
    steps: int,
) -> StateDict:
    """The client's state after the first ``steps`` of this round's local update (the same
    minibatches as ``algorithm.client_update``; 0 is the global state itself)."""
    if steps == 0:
        return OrderedDict((k, v.clone()) for k, v in global_state.items())
    batches = algorithm.client_minibatches(round_idx, client_id, x, y)
    with torch.no_grad():
        new_state = algorithm.local_training(
            {k: v.detach() for k, v in global_state.items()}, LocalBatches(*(t[:steps] for t in batches))
        )
    return OrderedDict((k, new_state[k]) for k in global_state)
