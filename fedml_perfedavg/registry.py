"""The plugin's algorithm registry (FedML 0.9.6 has none).

``train_args.federated_optimizer`` names an algorithm here. Built-ins are ``PerFedAvg``
and ``FedAvg``. Another package adds one by declaring an entry point in the group
``fedml_perfedavg.algorithms`` whose object is a factory with the signature of
:func:`fedml_perfedavg.trainer.create_perfedavg`::

    entry_points={"fedml_perfedavg.algorithms": ["MyAlg = my_pkg.alg:create"]}
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable, Dict, List

ENTRY_POINT_GROUP = "fedml_perfedavg.algorithms"

_BUILTIN: Dict[str, str] = {
    "PerFedAvg": "fedml_perfedavg.trainer:create_perfedavg",
    "FedAvg": "fedml_perfedavg.trainer:create_fedavg",
}


def _plugins() -> Dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def algorithm_names() -> List[str]:
    """Every algorithm name a config may use, built-ins first."""
    return list(_BUILTIN) + sorted(set(_plugins()) - set(_BUILTIN))


def algorithm_factory(name: str) -> Callable:
    """The factory ``(model, config, args, recorder) -> (ClientTrainer, ServerAggregator)``."""
    if name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), attr)
    plugins = _plugins()
    if name not in plugins:
        raise KeyError(f"train_args.federated_optimizer={name!r}: must be one of {algorithm_names()}")
    return plugins[name].load()
