"""The FedML side of a config: FedML's flat ``args`` from a :class:`~.config.Config` and back, the
checks FedML's own entry points need of ``args`` (its algorithm name), and the cross-silo
transport's values. :mod:`.config` owns the schema; this module translates it."""

from __future__ import annotations

import argparse
import copy
import logging
from typing import Any, Dict, Optional

from ..algorithms.registry import FEDML_OWN, algorithm_names, canonical_name
from ..core.errors import ConfigError
from ..net.credentials import check_security
from ..fedml_bridge.install import YAML_SECTIONS
from ..core.settings import check_value, field_default, suggest
from .config import load_yaml, resolve
from .schema import BY_NAME, SAFEGUARD_SECTIONS, Config

logger = logging.getLogger(__name__)


def to_fedml_args(config: Config, **overrides: Any) -> argparse.Namespace:
    """A FedML ``args`` object: every section flattened, FedML's command-line keys set."""
    # gpu_mapping_*: FedML's MPI path reads them even on CPU.
    args = argparse.Namespace(
        yaml_config_file=config.source or "",
        run_id="0",
        rank=0,
        local_rank=0,
        node_rank=0,
        role="client",
        run_device_id="0",
        using_mlops=False,
        gpu_mapping_file=None,
        gpu_mapping_key=None,
    )
    # FedML flattens every section into one namespace: the safeguard sections go first, so a
    # name they share with the plugin (delta, alpha, beta) reads as the plugin's on ``args``.
    sections = config.sections()
    for section in sorted(sections, key=lambda name: name not in SAFEGUARD_SECTIONS):
        for name, value in sections[section].items():
            setattr(args, name, copy.deepcopy(value))
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def from_fedml_args(
    args: Any, enable_wandb: Optional[bool] = None, sections: Optional[Dict[str, Dict[str, Any]]] = None
) -> Config:
    """The config of a run started from FedML's entry points: the YAML FedML read
    (``args.yaml_config_file``, for sections and FedML's keys) with ``args``' current values,
    which a user's script may have changed. ``enable_wandb`` replaces ``args.enable_wandb``
    (which the run layer turns off for FedML's own wandb.init); ``sections`` replace the YAML
    (a config already resolved, ``--set`` values included)."""
    path = getattr(args, "yaml_config_file", "") or ""
    if sections is None:  # the sections fedml.init read (the file is read once), else the file
        sections = getattr(args, YAML_SECTIONS, None)
    sections = copy.deepcopy(sections) if sections is not None else load_yaml(path) if path else {}
    # A name in two sections (train_args.delta and dp_args.delta) is one attribute of FedML's
    # flattened args, holding whichever came last: those are read from the YAML, section by section.
    seen: Dict[str, int] = {}
    for values in sections.values():
        for name in values:
            seen[name] = seen.get(name, 0) + 1
    shared = {name for name, count in seen.items() if count > 1}
    current = {name: getattr(args, name) for name in BY_NAME if hasattr(args, name) and name not in shared}
    if enable_wandb is not None:
        current["enable_wandb"] = enable_wandb
    for values in sections.values():
        for name in list(values):
            if name in shared:
                continue
            if name in current:
                values[name] = current.pop(name)
            elif hasattr(args, name):
                values[name] = getattr(args, name)
    return resolve(sections, current, source=path or None)


# FedML's secure aggregation: its optimizer names, and the keys only it reads (cross_silo/lightsecagg).
FEDML_SECURE_AGGREGATION = {"LSA": "LightSecAgg (LSA)", "SA": "SecAgg (SA)"}


def check_algorithm_name(args: Any) -> None:
    """``args.federated_optimizer`` made the registry's spelling when it names a plugin algorithm
    in another case; left alone when it is one of FedML's own (but FedML's SA and LSA where the
    run asks for the plugin's transport, ``common_args.plugin_fixes``, which carries no pickles);
    else an error listing the names (FedML itself would raise a bare ``Exception`` only after the
    data has loaded)."""
    name = getattr(args, "federated_optimizer", None)
    canonical = canonical_name(name)
    if canonical is not None:
        if canonical != name:
            logger.info("train_args.federated_optimizer=%r read as %r", name, canonical)
            args.federated_optimizer = canonical
        return
    if name in FEDML_SECURE_AGGREGATION and getattr(args, "plugin_fixes", False) is True:
        raise ConfigError(
            f"train_args.federated_optimizer={name!r}: FedML's {FEDML_SECURE_AGGREGATION[name]} does not run with "
            f"common_args.plugin_fixes: true (the plugin's cross-silo transport carries its own protocol's messages "
            f"only, never pickles{'; and FedML 0.9.6 lacks the module SA needs' if name == 'SA' else ''}). For "
            f"secure aggregation use the plugin's: federated_optimizer: PerFedAvg (or FedAvgUpdate) with "
            f"secagg_args: {{enable_secagg: true}} (docs/security.md: Secure aggregation)"
        )
    if name is None or name in FEDML_OWN:
        return
    names = algorithm_names()
    raise ConfigError(
        f"train_args.federated_optimizer={name!r}: neither a plugin algorithm ({names}) nor one of "
        f"FedML's own ({list(FEDML_OWN)}){suggest(str(name), [*names, *FEDML_OWN])}"
    )


TRANSPORT_KEYS = (
    "tls_dir",
    "roster_path",
    "insecure",
    "max_message_bytes",
    "connect_timeout",
    "max_connections",
    "max_connections_per_peer",
    "handshake_timeout",
    "idle_timeout",
)


def transport_values(args: Any, config: Optional[Config] = None) -> Dict[str, Any]:
    """The cross-silo transport's comm_args values, typed and checked: a plugin run's ``config``'s;
    for FedML's own algorithms (which have no config), FedML's ``args`` by the same fields' rules."""
    if config is not None:
        return {name: config.setting(name) for name in TRANSPORT_KEYS}
    values = {}
    for name in TRANSPORT_KEYS:
        value = getattr(args, name, None)
        values[name] = field_default(BY_NAME[name]) if value is None else check_value(BY_NAME[name], value)
    check_security(values["tls_dir"], values["insecure"])
    return values
