"""A tiny federated setup for run-layer tests: 6 users of 4x4 images, 3 classes."""

import torch

from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.data.loading import FederatedData
from fedml_perfedavg.run.config import resolve


def tiny_data(num_users=6, seed=0, nan_user=None):
    g = torch.Generator().manual_seed(seed)
    users = []
    for i in range(num_users):
        x = torch.rand(24, 1, 4, 4, generator=g)
        if i == nan_user:
            x[3, 0, 0, 0] = float("nan")
        users.append(
            UserSplit(
                x,
                torch.randint(0, 3, (24,), generator=g),
                torch.rand(8, 1, 4, 4, generator=g),
                torch.randint(0, 3, (8,), generator=g),
            )
        )
    return FederatedData(users, 3, (1, 4, 4))


#: DP-SGD at sigma 1, C 1 (the ``dp_args`` overrides of a run's config).
DP_SGD = {
    "dp_args.enable_dp": True,
    "dp_args.dp_solution_type": "dpsgd",
    "dp_args.noise_multiplier": 1.0,
    "dp_args.max_grad_norm": 1.0,
    "dp_args.delta": 1e-5,
}


def tiny_config(**overrides):
    base = dict(
        client_num_in_total=6,
        client_num_per_round=6,
        comm_round=6,
        local_steps=2,
        batch_size=8,
        meta_batch_size=8,
        hessian_batch_size=8,
        beta=0.1,
        alpha=0.05,
        show_progress=False,
        frequency_of_the_test=2,
        checkpoint_every=2,
        hidden_sizes=[5],
    )
    base.update(overrides)
    return resolve({}, base)


def killed_at_round(monkeypatch, round_idx, error=None):
    """Make the batched engine raise ``error`` (default: KeyboardInterrupt, a simulated kill) when
    it reaches ``round_idx``; returns a function that puts the engine back."""
    from fedml_perfedavg.engine.batched import BatchedSimulation

    original = BatchedSimulation.train_round

    def train_round(self, current):
        if current == round_idx:
            raise error if error is not None else KeyboardInterrupt("simulated kill")
        return original(self, current)

    monkeypatch.setattr(BatchedSimulation, "train_round", train_round)
    return lambda: monkeypatch.setattr(BatchedSimulation, "train_round", original)
