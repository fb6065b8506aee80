"""Data: the paper's user split (:mod:`.partition`), loading MNIST / CIFAR-10
(:mod:`.loading`), and FedML's dataset format both ways (:mod:`.fedml_format`)."""

from .fedml_format import client_tensors, to_fedml_dataset, users_from_fedml_dataset
from .loading import DATASETS, FederatedData, load_federated
from .partition import PARTITIONS

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "FederatedData",
    "client_tensors",
    "load_federated",
    "to_fedml_dataset",
    "users_from_fedml_dataset",
]
