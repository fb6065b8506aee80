"""Federated algorithms as objects that own a round (sample, client update, aggregate,
evaluate), one file each, all following :class:`.base.FederatedAlgorithm`; the registry maps
``train_args.federated_optimizer`` names to them."""

from .base import AlgorithmSettings, ClientUpdate, FederatedAlgorithm
from .gradient_steps import GradientSteps
from .registry import algorithm_class, algorithm_names, create_algorithm, register

__all__ = [
    "AlgorithmSettings",
    "ClientUpdate",
    "FederatedAlgorithm",
    "GradientSteps",
    "algorithm_class",
    "algorithm_names",
    "create_algorithm",
    "register",
]
