"""Several runs as one computation: the seeds of a Table 1 cell, round by round.

Each run keeps everything of its own (algorithm object, keyed sampling and minibatches, data
split, global model, aggregation, evaluation, run directory): only the local training of all
runs' sampled clients is one hand-batched computation per round (clients of every run stacked
along the leading dimension, each starting from its own run's global model). So each run gets
what it would get alone, up to the floating-point order of the batched products (tested equal
in float64). It needs every run on the batched engine's hand-batched path with the same client
maths (the local step, alpha, beta, delta, tau, batch sizes) and parameter shapes: the seeds
of one cell and method.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core.client_maths import LocalBatches, StepFigures, mean_figures
from ..algorithms.base import NO_HOOKS
from .batched import BatchedSimulation
from .captured import CapturedTraining

logger = logging.getLogger(__name__)


def why_not_together(engines: Sequence[BatchedSimulation]) -> Optional[str]:
    """Why these engines cannot train as one computation, or None if they can."""
    if not engines:
        return "no runs"
    first = engines[0]
    for position, engine in enumerate(engines):
        if engine.hand_batched is None or not engine.batched:
            return f"run {position} is not on the hand-batched path"
        if engine.algorithm.hooks is not NO_HOOKS:
            return f"run {position} applies FedML's DP, attacks or defenses (round hooks)"
        if engine.algorithm.standard_update != first.algorithm.standard_update:
            return f"run {position} has other client maths ({engine.algorithm.standard_update})"
        if engine.algorithm.settings.batch_sizes != first.algorithm.settings.batch_sizes:
            return f"run {position} has other batch sizes"
        if repr(engine.algorithm.network) != repr(first.algorithm.network):
            return f"run {position} has another network"
        if (engine.captured is None) != (first.captured is None):
            return f"run {position} and run 0 differ in device_args.capture_rounds"
        if any(engine.state[k].shape != first.state[k].shape for k in first.algorithm.parameter_names):
            return f"run {position} has other parameter shapes"
    return None


class GridSimulation:
    """The rounds of several batched-engine runs, their clients' local training stacked."""

    def __init__(self, engines: Sequence[BatchedSimulation]) -> None:
        why = why_not_together(engines)
        if why is not None:
            raise ValueError(f"these runs cannot train as one computation: {why}")
        self.engines = list(engines)
        # All runs' training data in one tensor, so a round's minibatches of every run are one
        # gather per role (concatenating per-run batches would copy them all again).
        self._data = None
        if all(engine.minibatches.gathers for engine in self.engines):
            xs, ys = zip(*(engine.minibatches.training_data for engine in self.engines))
            self._data = (torch.cat(xs), torch.cat(ys))
            self._run_offsets, offset = [], 0
            for y in ys:
                self._run_offsets.append(offset)
                offset += len(y)
        #: Every run's clients' training as one CUDA graph where the runs ask for their rounds captured.
        first = self.engines[0]
        self.captured: Optional[CapturedTraining] = None
        if first.captured is not None and self._data is not None:
            self.captured = CapturedTraining(self._indexed_training, first.captured.device)

    def _indexed_training(
        self, start: Dict[str, Tensor], index: List[Tensor]
    ) -> Tuple[Dict[str, Tensor], Optional[Tensor]]:
        """Every run's clients' local update from ``start`` on their minibatches at ``index``
        (into all runs' data), and their training figures where recorded."""
        return self._training(start, self.engines[0].minibatches.gather(index, self._data, lazy_inputs=True))

    def _training(self, start: Dict[str, Tensor], batches: LocalBatches) -> Tuple[Dict[str, Tensor], Optional[Tensor]]:
        """Every run's clients' local update from ``start`` on ``batches``, and their training figures."""
        first = self.engines[0]
        figures: Optional[List[StepFigures]] = [] if first.reports_training else None
        trained = first.train_from(start, batches, figures)
        return trained, None if figures is None else mean_figures(figures)

    def train_round(self, round_idx: int) -> None:
        """One round of every run: each samples its clients and draws its batches; all clients
        train together; each run aggregates and evaluates its own."""
        chosen: List[List[int]] = []
        starts: List[Dict[str, Tensor]] = []
        batches: List[Any] = []
        for position, engine in enumerate(self.engines):
            clients = engine.driver.sample_clients(round_idx)
            params, _ = engine.algorithm.split_state(engine.state)
            chosen.append(clients)
            starts.append({k: v.detach().unsqueeze(0).expand(len(clients), *v.shape) for k, v in params.items()})
            if self._data is not None:
                batches.append(
                    [i + self._run_offsets[position] for i in engine.minibatches.batch_index(round_idx, clients)]
                )
            else:
                batches.append(engine.minibatches.round_batches(round_idx, clients))
        start = {k: torch.cat([s[k] for s in starts]) for k in starts[0]}
        with torch.no_grad():
            if self._data is not None:
                index = [torch.cat(role) for role in zip(*batches)]
                train = self.captured if self.captured is not None else self._indexed_training
                trained, every = train(start, index)
            else:
                trained, every = self._training(start, LocalBatches(*(torch.cat(t) for t in zip(*batches))))
        offset = 0
        for engine, clients in zip(self.engines, chosen):
            mine = {k: v[offset : offset + len(clients)] for k, v in trained.items()}
            samples = [engine.sample_counts[c] for c in clients]
            figures_of_mine = None if every is None else every[offset : offset + len(clients)]
            updates = engine.algorithm.finish_clients(round_idx, clients, samples, mine, engine.state, figures_of_mine)
            offset += len(clients)
            engine.finish_round(round_idx, updates, clients)

    def run(self, start_round: int, rounds: int) -> List[dict]:
        """Rounds ``start_round`` .. ``rounds - 1`` of every run; returns their final states."""
        logger.info("grid: %d runs' clients train as one computation per round", len(self.engines))
        for round_idx in range(start_round, rounds):
            self.train_round(round_idx)
        return [engine.state for engine in self.engines]
