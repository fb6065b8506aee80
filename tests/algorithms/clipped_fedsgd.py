"""A test-only algorithm in one file, with settings and a per-client state of its own: FedAvg
whose local SGD steps clip the gradient to ``clip_norm`` (per step, over all parameters) and
follow each client's own momentum, which the client keeps from one of its rounds to its next;
each evaluation reports each user's momentum norm beside the protocol's accuracies. Importing
this file is all it takes: the config, its docs table, the cross-silo fingerprint and every
backend pick it up."""

from dataclasses import dataclass

import torch
from torch.func import grad

from fedml_perfedavg.algorithms import FederatedAlgorithm, register
from fedml_perfedavg.core.settings import NON_NEGATIVE, POSITIVE, setting


@dataclass(frozen=True)
class ClippedFedSGDSettings:
    clip_norm: float = setting(
        float,
        1.0,
        "ClippedFedSGD: each local step's gradient clipped to this L2 norm",
        rule=POSITIVE,
        section="train_args",
    )
    client_momentum: float = setting(
        float,
        0.5,
        "ClippedFedSGD: each client's own momentum, kept between its rounds",
        rule=NON_NEGATIVE,
        section="train_args",
    )


class ClippedFedSGD(FederatedAlgorithm):
    name = "ClippedFedSGD"
    Settings = ClippedFedSGDSettings
    keeps_client_state = True  # each client's momentum
    batch_roles = frozenset({0})  # its steps read D alone
    metric_names = ("momentum_norm",)  # a figure of its own in every evaluation, per user

    def initial_client_state(self, client_id, global_state):
        return {k: torch.zeros_like(global_state[k]) for k in self.parameter_names}

    def local_training_with_state(self, state, batches, momentum):
        params, buffers = self.split_state(state)
        grad_fn = grad(self.loss_fn)
        own = self.settings.own
        for t in range(batches.x.shape[0]):
            g = grad_fn(params, batches.x[t], batches.y[t])
            norm = torch.sqrt(sum((v * v).sum() for v in g.values()))
            scale = torch.clamp(own.clip_norm / (norm + 1e-12), max=1.0)
            momentum = {k: own.client_momentum * momentum[k] + scale * g[k] for k in params}
            params = {k: params[k] - self.settings.beta * momentum[k] for k in params}
        return {**buffers, **params}, momentum

    def user_metrics(self, round_idx, global_state, user, user_id):
        momentum = self.client_states.get(user_id) or {}
        return {"momentum_norm": float(torch.sqrt(sum((v * v).sum() for v in momentum.values()) + torch.zeros(())))}


register("ClippedFedSGD", ClippedFedSGD)
