"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020), Algorithm 1: each sampled user takes tau
meta-steps w <- w - beta * grad F_i(w) from the global w, with the second-order term exact
(Hessian-vector product), by finite differences (HF) or dropped (FO); the server averages.
The estimator is one setting, ``perfedavg_variant``, as learn2learn's MAML has ``first_order``."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.client_maths import VARIANTS, LocalUpdateConfig, Step
from ..core.settings import POSITIVE, setting
from .gradient_steps import GradientSteps


@dataclass(frozen=True)
class PerFedAvgSettings:
    """Per-FedAvg's own keys (``train_args``); alpha, beta, tau and the batches are every method's."""

    perfedavg_variant: Step = setting(
        str, Step.HF, "PerFedAvg: meta-gradient estimator", VARIANTS, section="train_args"
    )
    delta: float = setting(
        float, 0.001, "PerFedAvg: finite-difference width of the HF variant", rule=POSITIVE, section="train_args"
    )


class PerFedAvg(GradientSteps):
    """Per-FedAvg; ``perfedavg_variant`` picks the estimator (fo, hf, exact)."""

    name = "PerFedAvg"
    Settings = PerFedAvgSettings

    def standard_maths(self) -> LocalUpdateConfig:
        s, own = self.settings, self.settings.own
        return LocalUpdateConfig(own.perfedavg_variant, s.alpha, s.beta, own.delta, s.local_steps)

    @property
    def label(self) -> str:
        return f"PerFedAvg ({self.settings.own.perfedavg_variant})"
