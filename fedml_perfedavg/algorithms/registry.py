"""The algorithm registry (FedML 0.9.6 has none): ``train_args.federated_optimizer`` names.

Built-ins are ``PerFedAvg``, ``FedAvgUpdate`` (the paper's "FedAvg + update") and ``FedAvgARUBA``
(its appendix's FedAvg + ARUBA). An
algorithm is a :class:`~fedml_perfedavg.algorithms.base.FederatedAlgorithm` subclass with a
``from_config(model, config)`` classmethod. Add one from code with :func:`register`, or from
another package with an entry point in the group ``fedml_perfedavg.algorithms``::

    entry_points={"fedml_perfedavg.algorithms": ["MyAlg = my_pkg.my_alg:MyAlg"]}

Names FedML itself runs (``FedAvg``, ``FedProx``, ...) cannot be registered: with the plugin
imported they still mean FedML's own algorithms.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from importlib.metadata import entry_points
from typing import Any, Dict, List, Optional, Type

from torch import nn

from ..core.settings import declaration, settings_of
from .base import FederatedAlgorithm

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fedml_perfedavg.algorithms"
# simulation/simulator.py, cross_silo/fedml_server.py and the rest: the names FedML 0.9.6 dispatches on
# itself (tests/test_host_unchanged.py reads them from FedML's source).
FEDML_OWN = (
    "FedAvg",
    "FedOpt",
    "FedNova",
    "FedDyn",
    "FedProx",
    "SCAFFOLD",
    "Mime",
    "HierarchicalFL",
    "turbo_aggregate",
    "classical_vertical",
    "FedAvg_seq",
    "FedOpt_seq",
    "base_framework",
    "FedGKT",
    "FedNAS",
    "FedGAN",
    "split_nn",
    "decentralized_fl",
    "Async_FedAvg",
    "LSA",
    "SA",
    "FedSeg",
)

_BUILTIN: Dict[str, str] = {
    "PerFedAvg": "fedml_perfedavg.algorithms.perfedavg:PerFedAvg",
    "FedAvgUpdate": "fedml_perfedavg.algorithms.fedavg_update:FedAvgUpdate",
    "FedAvgARUBA": "fedml_perfedavg.algorithms.fedavg_aruba:FedAvgARUBA",
}
_REGISTERED: Dict[str, Type[FederatedAlgorithm]] = {}
BUILTIN_ALGORITHMS = tuple(_BUILTIN)


def register(name: str, cls: Type[FederatedAlgorithm]) -> None:
    """Make ``federated_optimizer: name`` run ``cls`` (a FederatedAlgorithm subclass)."""
    if name in FEDML_OWN:
        raise ValueError(f"{name!r} is FedML's own algorithm name; register under another name")
    if not (isinstance(cls, type) and issubclass(cls, FederatedAlgorithm)):
        raise TypeError(f"{cls!r} is not a FederatedAlgorithm subclass")
    for other in algorithm_names():
        if other != name:
            clash = settings_clash(
                name, {f.name: f for f in settings_of(cls.Settings)}, other, algorithm_settings(other)
            )
            if clash is not None:
                raise TypeError(clash)
    _REGISTERED[name] = cls


def settings_clash(
    name: str, mine: Dict[str, dataclasses.Field], other: str, theirs: Dict[str, dataclasses.Field]
) -> Optional[str]:
    """Why algorithms ``name`` and ``other`` cannot both be offered: a key of their own settings
    (one flat ``train_args`` namespace) that each declares with another meaning; None if none. One
    key may serve two algorithms only as one declaration (kind, default, choices, rule, section)."""
    for key, f in mine.items():
        if key in theirs and declaration(f) != declaration(theirs[key]):
            return (
                f"algorithm {name!r} declares the setting {key!r} as {declaration(f)}; algorithm {other!r} declares "
                f"it as {declaration(theirs[key])}: a key means one thing in train_args (name yours after "
                f"the algorithm, or declare it exactly as {other!r} does)"
            )
    return None


@functools.lru_cache(maxsize=None)
def _entry_points() -> Dict[str, Any]:
    # Installed packages' entry points, read once: scanning every distribution takes ~0.1 s.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def algorithm_names() -> List[str]:
    """Every name ``federated_optimizer`` may use for a plugin algorithm, built-ins first."""
    extra = (set(_REGISTERED) | set(_entry_points())) - set(_BUILTIN)
    return list(_BUILTIN) + sorted(n for n in extra if n not in FEDML_OWN)


def canonical_name(name: object) -> "str | None":
    """The plugin algorithm ``name`` means, matched case-insensitively (``perfedavg`` is
    ``PerFedAvg``), or None when it names none."""
    if not isinstance(name, str):
        return None
    names = algorithm_names()
    if name in names:
        return name
    matches = [n for n in names if n.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def algorithm_class(name: str) -> Type[FederatedAlgorithm]:
    """The class registered as ``name``."""
    if name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), attr)
    if name in _REGISTERED:
        return _REGISTERED[name]
    points = _entry_points()
    if name in points and name not in FEDML_OWN:
        return points[name].load()
    raise KeyError(f"train_args.federated_optimizer={name!r}: must be one of {algorithm_names()}")


def algorithm_settings(name: str) -> Dict[str, dataclasses.Field]:
    """The keys of ``name``'s own settings (its ``Settings`` dataclass), by name; none for an
    algorithm without, or one whose entry point cannot be loaded (choosing it names the error)."""
    try:
        cls = algorithm_class(name)
    except Exception as err:  # a third party's broken entry point: reported when it is chosen
        logger.warning("algorithm %r: its settings cannot be read (%s)", name, err)
        return {}
    return {f.name: f for f in settings_of(cls.Settings)}


def method_choices(name: str, values: Dict[str, Any]) -> List[str]:
    """The values in ``values`` (a run's train_args) of ``name``'s own settings that pick a
    variant of it (those with choices): ``["hf"]`` for PerFedAvg, none for FedAvgUpdate. Reports
    and wandb's tags name a method by them."""
    return [
        str(getattr(values.get(key), "value", values.get(key)))
        for key, f in algorithm_settings(name).items()
        if f.metadata.get("choices") and key in values
    ]


def create_algorithm(name: str, model: nn.Module, config) -> FederatedAlgorithm:
    """The algorithm object ``name`` for ``model`` and a run config."""
    return algorithm_class(name).from_config(model, config)
