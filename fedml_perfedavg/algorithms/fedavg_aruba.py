"""FedAvg + ARUBA (Khodak, Balcan, Talwalkar 2019, "Adaptive Gradient-Based Meta-Learning
Methods", the federated variant), the comparison of Fallah et al. (2020)'s appendix.

ARUBA learns a per-coordinate learning rate eta across tasks (here: each client's round is a
task), from how far the tasks' solutions move from the shared initialization (b) and how large
their gradients are (g). Multiplication, division and square root are coordinate-wise:

    client i, from the global w:   theta <- theta - eta * grad f_i(theta; D_s)   for s = 1..tau
                                   sends theta_i and G_i = sum_s grad f_i(theta_s; D_s)^2
    server, t = client tasks seen: w     <- mean_i theta_i                      (Algorithm 1's average)
                                   b     <- b + sum_i (w_old - theta_i)^2 / 2
                                   g     <- g + sum_i G_i
                                   eta   <- sqrt((epsilon^2 (t + 1)^-p + b) / (zeta^2 + g))

so eta starts at epsilon / zeta. At evaluation each user refines the global model with one
step of the learned eta on its training data (``theta = w - eta * grad f_i(w; D)``), where the
other methods take an alpha-step; the batches and the test protocol are the same.

eta, b, g, the client's G and t are the server's state, beside the model in the global state
(``aruba_*``, :meth:`FedAvgARUBA.initial_server_state`), so they travel with the model on every
backend (sp, MPI, cross-silo) and are in ``model.pt``; nothing is registered on the caller's model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch
from torch import nn
from torch.func import grad

from ..core.client_maths import LocalBatches
from ..core.settings import NON_NEGATIVE, POSITIVE, check_settings, setting
from ..core.types import Params, StateDict
from .base import AlgorithmSettings, FederatedAlgorithm, average

logger = logging.getLogger(__name__)

ROLES = ("lr", "b", "g", "grad_sq")
TASKS = "aruba_tasks"


@dataclass(frozen=True)
class ArubaSettings:
    """ARUBA's hyper-parameters (``train_args``): eta starts at epsilon / zeta; epsilon^2 (t + 1)^-p
    keeps eta from collapsing while few tasks have been seen."""

    aruba_epsilon: float = setting(
        float,
        0.03,
        "FedAvgARUBA: epsilon; the learned per-coordinate step starts at aruba_epsilon / aruba_zeta "
        "(0.03 / 0.1: tuned on MNIST tau=4, benchmarks/results/aruba_tuning.md)",
        rule=POSITIVE,
        section="train_args",
    )
    aruba_zeta: float = setting(
        float, 0.1, "FedAvgARUBA: zeta, the prior on the squared-gradient sum", rule=POSITIVE, section="train_args"
    )
    aruba_p: float = setting(
        float, 1.0, "FedAvgARUBA: epsilon^2 decays as (tasks + 1)^-p", rule=NON_NEGATIVE, section="train_args"
    )


def statistic_name(role: str, parameter: str) -> str:
    """The global state's name of ARUBA's ``role`` statistic of ``parameter``."""
    return f"aruba_{role}__{parameter.replace('.', '__')}"


class FedAvgARUBA(FederatedAlgorithm):
    """FedAvg whose local and refinement steps use ARUBA's learned per-coordinate rates."""

    name = "FedAvgARUBA"
    Settings = ArubaSettings
    returns_whole_state = True  # the client's squared gradients travel in its state
    dp_refusal_reason = (
        "ARUBA learns per-coordinate step sizes from each client's updates outside the mechanism; use "
        "PerFedAvg or FedAvgUpdate"
    )
    batch_roles = frozenset({0})  # its local steps read D alone (FedAvg's steps with learned step sizes)

    def __init__(self, model: nn.Module, settings: AlgorithmSettings) -> None:
        aruba = settings.own if settings.own is not None else ArubaSettings()
        check_settings(aruba)
        self.aruba = aruba
        super().__init__(model, settings)
        self.statistics = {role: {n: statistic_name(role, n) for n in self.parameter_names} for role in ROLES}
        logger.info(
            "FedAvgARUBA: local and refinement steps take learned per-coordinate rates starting at "
            "aruba_epsilon / aruba_zeta = %.4g; train_args.beta and alpha do not set them (alpha still "
            "defines F for the stationarity measure)",
            self.initial_rate,
        )

    @property
    def label(self) -> str:
        return "FedAvg + ARUBA"

    @property
    def initial_rate(self) -> float:
        """eta before any task: epsilon / zeta."""
        return self.aruba.aruba_epsilon / self.aruba.aruba_zeta

    def initial_server_state(self, model_state: StateDict) -> StateDict:
        """eta = epsilon / zeta, b = g = G = 0 for each parameter; no task seen."""
        eta0 = self.initial_rate
        state: Dict[str, torch.Tensor] = {}
        for role in ROLES:
            for parameter, name in self.statistics[role].items():
                state[name] = torch.full_like(model_state[parameter], eta0 if role == "lr" else 0.0)
        state[TASKS] = torch.zeros((), dtype=torch.float64)
        return state

    def learning_rates(self, state: StateDict) -> Params:
        """eta, per parameter, as held in a model state."""
        return {n: state[b] for n, b in self.statistics["lr"].items()}

    # -- client -----------------------------------------------------------------------------
    def local_training(self, state: StateDict, batches: LocalBatches) -> StateDict:
        """tau steps of size eta on batches of D; the state sent back carries G_i."""
        params, _ = self.split_state(state)
        eta = self.learning_rates(state)
        grad_fn = grad(self.loss_fn)
        squares = {n: torch.zeros_like(v) for n, v in params.items()}
        for t in range(batches.x.shape[0]):
            g = grad_fn(params, batches.x[t], batches.y[t])
            squares = {n: squares[n] + g[n] * g[n] for n in params}
            params = {n: params[n] - eta[n] * g[n] for n in params}
        out: Dict[str, torch.Tensor] = dict(state)
        out.update(params)
        out.update({self.statistics["grad_sq"][n]: squares[n] for n in params})
        return out

    # -- server -----------------------------------------------------------------------------
    def combine(
        self, round_idx: int, accepted: Sequence[Tuple[float, StateDict]], global_state: StateDict
    ) -> StateDict:
        new = average(accepted, self.settings.aggregation)
        device = next(iter(global_state.values())).device
        tasks = float(global_state[TASKS]) + len(accepted)
        s = self.aruba
        decay = s.aruba_epsilon**2 * (tasks + 1.0) ** (-s.aruba_p)
        for n in self.parameter_names:
            old = global_state[n]
            moved = sum((old - update[n].to(device)) ** 2 for _, update in accepted) / 2.0
            squares = sum(update[self.statistics["grad_sq"][n]].to(device) for _, update in accepted)
            b = global_state[self.statistics["b"][n]] + moved
            g = global_state[self.statistics["g"][n]] + squares
            new[self.statistics["b"][n]] = b
            new[self.statistics["g"][n]] = g
            new[self.statistics["lr"][n]] = torch.sqrt((decay + b) / (s.aruba_zeta**2 + g))
            new[self.statistics["grad_sq"][n]] = torch.zeros_like(old)
        new[TASKS] = torch.tensor(tasks, dtype=global_state[TASKS].dtype, device=global_state[TASKS].device)
        return OrderedDict((k, new[k]) for k in global_state)

    # -- evaluation -------------------------------------------------------------------------
    def refinement_step_sizes(self, global_state: StateDict) -> Params:
        """The refinement step at evaluation takes eta (the rates learned so far), not alpha."""
        return self.learning_rates(global_state)

    def describe(self, global_state: StateDict) -> Dict[str, float]:
        """Summary statistics of the learned rates (logged with each evaluation)."""
        rates = torch.cat([v.flatten() for v in self.learning_rates(global_state).values()])
        return {
            "aruba_lr_mean": float(rates.mean()),
            "aruba_lr_min": float(rates.min()),
            "aruba_lr_max": float(rates.max()),
            "aruba_tasks": float(global_state[TASKS]),
        }
