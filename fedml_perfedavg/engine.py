"""Batched single-process simulation: a round's sampled clients train as one computation.

The per-client maths is :func:`fedml_perfedavg.algorithm.local_update`, vmapped over the
clients of a round (their parameters stacked, their minibatches gathered from tensors that
were put on the device once). Client sampling, minibatches, aggregation (the plugin's
``ServerAggregator``) and evaluation are exactly those of the per-client path, so both
give the same model up to floating-point summation order.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch
from torch.func import vmap

from .algorithm import LocalBatches, LocalUpdateConfig, LossFn, Params, local_update
from .evaluation import UserSplit, personalized_evaluation_batched
from .guards import apply_divergence_policy, nonfinite_clients
from .sampling import Purpose, generator_for, sample_clients, sample_local_batches

logger = logging.getLogger(__name__)


def stack_batches(batches: Sequence[LocalBatches]) -> LocalBatches:
    """Stack per-client ``LocalBatches`` along a new leading client dimension."""
    return LocalBatches(*(torch.stack(tensors) for tensors in zip(*batches)))


def round_batches(users: Sequence[UserSplit], clients: Sequence[int], seed: int, round_idx: int,
                  steps: int, batch_sizes: Sequence[int]) -> LocalBatches:
    """Every sampled client's minibatches for a round, drawn with the per-client path's keys."""
    return stack_batches([
        sample_local_batches(users[c].train_x, users[c].train_y, steps, batch_sizes,
                             generator_for(seed, round_idx, c, Purpose.LOCAL_TRAINING))
        for c in clients
    ])


def batched_local_update(loss_fn: LossFn, update: LocalUpdateConfig) -> Callable[[Params, LocalBatches], Params]:
    """``(w, batches with a client dim) -> stacked client models``, all starting from the same w."""
    return vmap(lambda params, batches: local_update(loss_fn, params, batches, update), in_dims=(None, 0))


class BatchedSimulation:
    """The round loop of the batched engine, using the plugin's trainer and aggregator objects."""

    def __init__(self, config, users: Sequence[UserSplit], trainer, aggregator, recorder=None) -> None:
        self.config = config
        self.users = users
        self.trainer = trainer
        self.aggregator = aggregator
        self.recorder = recorder
        self.model = aggregator.model
        self.step = batched_local_update(trainer.loss_fn, trainer.update)
        if getattr(config, "compile_local_update", False):
            # The round is thousands of tiny kernels: on a GPU, CUDA graphs ("reduce-overhead")
            # replay them without per-kernel launch cost. Shapes are the same every round.
            on_cuda = next(self.model.parameters()).is_cuda
            self.step = torch.compile(self.step, mode="reduce-overhead" if on_cuda else "default", dynamic=False)
        self.batch_sizes = trainer.batch_sizes
        self.sample_counts = [len(u.train_y) for u in users]

    def global_params(self) -> Params:
        return {k: p.detach() for k, p in self.model.named_parameters()}

    def train_round(self, round_idx: int) -> List[int]:
        """One round: sample, train the sampled clients together, aggregate. Returns the clients."""
        config = self.config
        clients = sample_clients(config.random_seed, round_idx, config.client_num_in_total,
                                 config.client_num_per_round, config.new_user_fraction)
        batches = round_batches(self.users, clients, config.random_seed, round_idx, config.local_steps,
                                self.batch_sizes)
        with torch.no_grad():
            stacked = self.step(self.global_params(), batches)
        for position in nonfinite_clients(stacked):
            apply_divergence_policy(config, round_idx, clients[position])
        buffers = {k: b for k, b in self.model.state_dict().items() if k not in stacked}
        updates = [(self.sample_counts[c], {**{k: v[i] for k, v in stacked.items()}, **buffers})
                   for i, c in enumerate(clients)]
        self.aggregator.args.round_idx = round_idx
        updates, _ = self.aggregator.on_before_aggregation(updates)
        new_global = self.aggregator.on_after_aggregation(self.aggregator.aggregate(updates))
        self.aggregator.set_model_params(new_global)
        return clients

    def evaluate(self, round_idx: int):
        """Personalized evaluation of all users, batched."""
        config = self.config
        result = personalized_evaluation_batched(self.model, self.trainer.loss_fn, self.global_params(), self.users,
                                                 config.alpha, config.adapt_steps, config.batch_size,
                                                 config.random_seed, round_idx)
        if self.recorder is not None:
            self.recorder.record_evaluation(round_idx, result)
        return result

    def run(self, start_round: int = 0, checkpoint: Optional[Callable[[int], None]] = None) -> None:
        """Rounds ``start_round``.. ``comm_round - 1``, evaluating where FedML's sp loop would
        (round 0, every ``frequency_of_the_test`` rounds, the last round), and calling
        ``checkpoint(next_round)`` every ``checkpoint_every`` rounds."""
        last = self.config.comm_round - 1
        every = self.config.checkpoint_every
        for round_idx in range(start_round, self.config.comm_round):
            self.train_round(round_idx)
            if round_idx == last or round_idx % self.config.frequency_of_the_test == 0:
                self.evaluate(round_idx)
            if checkpoint is not None and every and (round_idx + 1) % every == 0 and round_idx != last:
                checkpoint(round_idx + 1)
