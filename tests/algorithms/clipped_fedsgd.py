"""A test-only algorithm in one file, with a setting of its own: FedAvg whose local SGD steps
clip the gradient to ``clip_norm`` (per step, over all parameters). Importing this file is all it
takes: the config, its docs table, the cross-silo fingerprint and every backend pick it up."""

from dataclasses import dataclass

import torch
from torch.func import grad

from fedml_perfedavg.algorithms import FederatedAlgorithm, register
from fedml_perfedavg.core.settings import POSITIVE, setting


@dataclass(frozen=True)
class ClippedFedSGDSettings:
    clip_norm: float = setting(
        float,
        1.0,
        "ClippedFedSGD: each local step's gradient clipped to this L2 norm",
        rule=POSITIVE,
        section="train_args",
    )


class ClippedFedSGD(FederatedAlgorithm):
    name = "ClippedFedSGD"
    Settings = ClippedFedSGDSettings

    def local_update(self, params, batches):
        grad_fn = grad(self.loss_fn)
        clip = self.settings.own.clip_norm
        for t in range(batches.adapt_x.shape[0]):
            g = grad_fn(params, batches.adapt_x[t], batches.adapt_y[t])
            norm = torch.sqrt(sum((v * v).sum() for v in g.values()))
            scale = torch.clamp(clip / (norm + 1e-12), max=1.0)
            params = {k: params[k] - self.settings.beta * scale * g[k] for k in params}
        return params


register("ClippedFedSGD", ClippedFedSGD)
