"""FedML's own keys in a plugin YAML: those read as FedML means them (``learning_rate`` is
train_args.beta), those the plugin does not use (named in a warning), those that configure FedML
itself and pass through, and those of FedML's secure aggregation, which the plugin refuses."""

from __future__ import annotations

from typing import Any, Dict, List

from ..core.errors import ConfigError
from ..core.settings import check_value
from ..data.partition import PARTITIONS
from .schema import BY_NAME

# FedML's own keys Per-FedAvg reads as FedML means them (learning_rate), or names in a warning
# because it does not use them; FEDML_PASSTHROUGH below lists those that configure FedML itself.
FEDML_KEYS: Dict[str, str] = {
    "learning_rate": "read as train_args.beta (the step size applied to the model)",
    "epochs": "not used: each sampled user takes train_args.local_steps (tau) steps per round",
    "client_optimizer": "not used: Per-FedAvg's steps are its own (alpha inner step, beta outer step)",
    "weight_decay": "not used: Per-FedAvg's steps have no weight decay",
    "server_optimizer": "not used: the server averages the returned models (train_args.aggregation)",
    "server_lr": "not used: the server averages the returned models (train_args.aggregation)",
    "momentum": "not used: Per-FedAvg's steps have no momentum",
}
FEDML_PASSTHROUGH = {
    "partition_alpha",  # FedML's Dirichlet split: used by its loaders except MNIST's (see read_fedml_keys)
    "scenario",
    "using_mlops",
    "config_version",
    "client_id_list",
    "worker_num",
    "gpu_mapping_file",
    "gpu_mapping_key",
    "is_mobile",
    "log_file_dir",
    "enable_tracking",
    "using_memory_profiler",
    "test_on_clients",
    "device_type",
    "rank",
    "role",
    "run_id",
    "process_id",
    "run_device_id",
    "local_rank",
    "node_rank",
}

# The keys only FedML's secure aggregation reads (cross_silo/lightsecagg).
FEDML_SECURE_AGGREGATION_KEYS = (
    "prime_number",
    "precision_parameter",
    "privacy_guarantee",
    "targeted_number_active_clients",
)


def read_fedml_keys(given: Dict[str, Any], where: Dict[str, str]) -> List[str]:
    """FedML's keys as FedML means them, in ``given`` (the keys given, by name; ``where``: the
    section each came from): ``learning_rate`` becomes beta; returns a warning for each key given
    that the plugin does not use."""
    warnings: List[str] = []
    if "learning_rate" in given:
        lr = given["learning_rate"]
        try:
            check_value(BY_NAME["beta"], lr)
        except ConfigError as err:
            raise ConfigError(
                str(err).replace(
                    f"train_args.beta={lr!r}",
                    f"{where.get('learning_rate', 'train_args')}.learning_rate={lr!r} (read as train_args.beta)",
                )
            ) from None
        if "beta" in given and check_value(BY_NAME["beta"], given["beta"]) != check_value(BY_NAME["beta"], lr):
            raise ConfigError(
                f"{where.get('learning_rate', 'train_args')}.learning_rate={lr!r} and train_args.beta="
                f"{given['beta']!r} both set the step size applied to the model; give one, or the "
                f"same value"
            )
        given.setdefault("beta", lr)
    partition, dataset = given.get("partition_method", "paper"), given.get("dataset", "mnist")
    if partition not in PARTITIONS and dataset == "mnist":
        warnings.append(
            f"data_args.partition_method={partition!r} is not used: FedML's MNIST loader reads LEAF's fixed "
            f"per-writer split (fedml/data/MNIST/data_loader.py); partition_method paper gives the paper's"
        )
    if "partition_alpha" in given:
        if partition in PARTITIONS:
            warnings.append(
                f"data_args.partition_alpha={given['partition_alpha']!r} is not used: the paper's split "
                f"(partition_method {partition!r}) has no Dirichlet parameter"
            )
        elif dataset == "mnist":
            warnings.append(
                f"data_args.partition_alpha={given['partition_alpha']!r} is not used: FedML's MNIST loader "
                f"reads LEAF's fixed per-writer split"
            )
    for name, meaning in FEDML_KEYS.items():
        if name == "learning_rate" or name not in given:
            continue
        value = given[name]
        if name == "client_optimizer" and str(value).lower() == "sgd":
            continue  # plain gradient steps are what Per-FedAvg takes
        if name in ("weight_decay", "momentum") and not value:
            continue
        warnings.append(f"{where.get(name, 'train_args')}.{name}={value!r} is {meaning}")
    return warnings
