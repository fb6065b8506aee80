"""The paper's baseline, "FedAvg + update": FedAvg's training (tau local SGD steps of size beta
on batches of D, plain average at the server), evaluated like every method with one
alpha-step of personalization on each user's training data.

It is not FedML's own ``FedAvg``, which averages by sample count and tests without
personalization; with the plugin imported, ``federated_optimizer: FedAvg`` still runs FedML's.
"""

from __future__ import annotations

from ..core.client_maths import LocalUpdateConfig, Step
from .gradient_steps import GradientSteps


class FedAvgUpdate(GradientSteps):
    """FedAvg + one-step personalization at evaluation (the paper's comparison)."""

    name = "FedAvgUpdate"

    def standard_maths(self) -> LocalUpdateConfig:
        s = self.settings
        return LocalUpdateConfig(Step.SGD, s.alpha, s.beta, local_steps=s.local_steps)
