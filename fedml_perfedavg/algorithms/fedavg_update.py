"""The paper's baseline, "FedAvg + update": FedAvg's training (tau local SGD steps of size beta
on batches of D, plain average at the server), evaluated like every method with one
alpha-step of personalization on each user's training data.

It is not FedML's own ``FedAvg``, which averages by sample count and tests without
personalization; with the plugin imported, ``federated_optimizer: FedAvg`` still runs FedML's.
"""
from __future__ import annotations

from torch import nn

from .base import AlgorithmSettings, FederatedAlgorithm


class FedAvgUpdate(FederatedAlgorithm):
    """FedAvg + one-step personalization at evaluation (the paper's comparison)."""

    name = "FedAvgUpdate"

    def __init__(self, model: nn.Module, settings: AlgorithmSettings) -> None:
        if settings.local.method != "fedavg":
            raise ValueError(f"FedAvgUpdate needs LocalUpdateConfig(method='fedavg'), got {settings.local.method!r}")
        super().__init__(model, settings)

    @classmethod
    def from_config(cls, model: nn.Module, config) -> "FedAvgUpdate":
        return cls(model, AlgorithmSettings.from_config(config, "fedavg"))
