"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020), Algorithm 1: each sampled user takes tau
meta-steps w <- w - beta * grad F_i(w) from the global w, with the second-order term exact
(Hessian-vector product), by finite differences (HF) or dropped (FO); the server averages."""
from __future__ import annotations

from torch import nn

from .base import AlgorithmSettings, FederatedAlgorithm


class PerFedAvg(FederatedAlgorithm):
    """Per-FedAvg; ``settings.local.variant`` picks the estimator (fo, hf, exact)."""

    name = "PerFedAvg"

    def __init__(self, model: nn.Module, settings: AlgorithmSettings) -> None:
        if settings.local.method != "perfedavg":
            raise ValueError(f"PerFedAvg needs LocalUpdateConfig(method='perfedavg'), got {settings.local.method!r}")
        super().__init__(model, settings)

    @property
    def label(self) -> str:
        return f"PerFedAvg ({self.settings.local.variant})"

    @classmethod
    def from_config(cls, model: nn.Module, config) -> "PerFedAvg":
        return cls(model, AlgorithmSettings.from_config(config, "perfedavg"))
