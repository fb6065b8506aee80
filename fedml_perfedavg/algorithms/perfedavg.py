"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020), Algorithm 1: each sampled user takes tau
meta-steps w <- w - beta * grad F_i(w) from the global w, with the second-order term exact
(Hessian-vector product), by finite differences (HF) or dropped (FO); the server averages."""

from __future__ import annotations

from .base import FederatedAlgorithm


class PerFedAvg(FederatedAlgorithm):
    """Per-FedAvg; ``settings.local.variant`` picks the estimator (fo, hf, exact)."""

    name = "PerFedAvg"

    @property
    def label(self) -> str:
        return f"PerFedAvg ({self.settings.local.variant})"
