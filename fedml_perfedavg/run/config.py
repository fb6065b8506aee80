"""Reading a run's configuration: FedML's sectioned YAML and ``--set`` pairs, merged with the
defaults into a validated :class:`~.schema.Config` (:func:`load`, :func:`resolve`).

The schema (each key's section, type, default and allowed values) is :mod:`.schema`; the rules
that relate keys, :mod:`.rules`; FedML's own keys (``learning_rate`` is beta, the unused ones named
in a warning), :mod:`.fedml_keys`. Errors name ``section.key=value`` and what is allowed; keys the
chosen algorithm does not use are named in a warning. FedML's flat ``args`` to and from a config,
and the transport's values: :mod:`.fedml_args`; the command line's options: :mod:`.options`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from typing import Any, Dict, Optional, Sequence, Tuple

import yaml

from ..algorithms.registry import (
    algorithm_names,
    algorithm_settings,
    canonical_name,
)
from ..core.errors import ConfigError
from ..core.settings import check_value, field_default, suggest
from ..fedml_bridge import safeguard_keys as fedml_safeguards
from .fedml_keys import FEDML_KEYS, FEDML_PASSTHROUGH, FEDML_SECURE_AGGREGATION_KEYS, read_fedml_keys
from .rules import check_rules
from .schema import BY_NAME, SAFEGUARD_SECTIONS, SECTIONS, Config, algorithm_fields

logger = logging.getLogger(__name__)

__all__ = ["Config", "ConfigError", "load", "load_yaml", "parse_overrides", "resolve"]


def _yaml_number(value: Any) -> Any:
    """``1e-5`` as a float: PyYAML follows YAML 1.1, where an exponent without a dot is a string."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) and any(c.isdigit() for c in value) else value
    return value


def load_yaml(path: str) -> Dict[str, Dict[str, Any]]:
    """Read a FedML-style YAML; unlike FedML, a missing or unreadable file is an error."""
    if os.path.isdir(path):
        raise ConfigError(f"--cf {path!r}: is a folder; give a YAML file (e.g. yaml_configs/quickstart_mnist_hf.yaml)")
    if not os.path.isfile(path):
        raise ConfigError(f"--cf {path!r}: no such file")
    try:
        with open(path) as stream:
            data = yaml.safe_load(stream)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--cf {path!r}: cannot be read as YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"--cf {path!r}: must map section names (e.g. train_args) to mappings of keys")
    return {section: dict(values or {}) for section, values in data.items()}


def parse_overrides(pairs: Sequence[str]) -> Dict[str, Any]:
    """``["comm_round=20", "train_args.alpha=0.05"]`` -> {"comm_round": 20, "alpha": 0.05}."""
    out = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set comm_round=20")
        section, _, short = name.rpartition(".")
        if section in SAFEGUARD_SECTIONS:  # kept with its section: dp_args.delta is not train_args.delta
            out[name] = yaml.safe_load(raw)
            continue
        name = short
        if name in fedml_safeguards.HOME_SECTION:
            out[f"{fedml_safeguards.HOME_SECTION[name]}.{name}"] = yaml.safe_load(raw)
            continue
        if name not in BY_NAME and name not in FEDML_KEYS and name not in FEDML_PASSTHROUGH:
            raise ConfigError(f"--set {pair!r}: unknown key {name!r}{suggest(name, BY_NAME)}")
        out[name] = yaml.safe_load(raw)
    return out


_WARNED: set = set()


def _warn_once(message: str) -> None:
    """A config warning, once per process: a run reads its config more than once (the command
    line, ``fedml.init``, the runner), and the same words each time help nobody."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


def resolve(
    sections: Dict[str, Dict[str, Any]], overrides: Optional[Dict[str, Any]] = None, source: Optional[str] = None
) -> Config:
    """Merge YAML sections, defaults and overrides into a validated :class:`Config`."""
    overrides = dict(overrides or {})
    for dotted in [k for k in overrides if "." in k]:  # --set dp_args.epsilon=0.5
        section, _, name = dotted.partition(".")
        sections = {**sections, section: {**sections.get(section, {}), name: overrides.pop(dotted)}}
    given, where, extra, safeguards = _sort_keys(sections)
    given.update(overrides)
    if canonical_name(given.get("federated_optimizer")) is not None:  # plugin names in any case
        given["federated_optimizer"] = canonical_name(given["federated_optimizer"])
    for warning in read_fedml_keys(given, where):
        _warn_once(warning)
    index = dict(BY_NAME)
    values = {name: check_value(f, copy.deepcopy(given.get(name, field_default(f)))) for name, f in index.items()}
    for name in set(given) - set(index):
        extra[name] = (extra.get(name, (where.get(name, "train_args"), None))[0], given[name])
    own_keys = algorithm_fields()
    chosen = values["federated_optimizer"]
    chosen_keys = set(algorithm_settings(chosen)) if chosen in algorithm_names() else set()
    _name_other_algorithms_keys(given, own_keys, chosen_keys, chosen)
    config = Config.of_values(
        values,
        source=source,
        extra=extra,
        safeguards=safeguards,
        # The chosen algorithm's own keys alone (another's, given, were checked and named above).
        algorithm_values={k: v for k, v in values.items() if k in chosen_keys},
    )
    check_rules(config)
    return config


def _sort_keys(
    sections: Dict[str, Dict[str, Any]],
) -> Tuple[Dict[str, Any], Dict[str, str], Dict[str, Tuple[str, Any]], Dict[str, Dict[str, Any]]]:
    """Each YAML key to its place: (the plugin's and FedML's known keys given, the section each
    FedML key came from, keys passed to FedML unchecked, FedML's attack/defense sections); a key
    in the wrong section, an unknown key close to a known one, or FedML's LSA keys raise."""
    given: Dict[str, Any] = {}
    where: Dict[str, str] = {}
    extra: Dict[str, Tuple[str, Any]] = {}
    safeguards: Dict[str, Dict[str, Any]] = {}
    for section, values in sections.items():
        if section not in SECTIONS + SAFEGUARD_SECTIONS:
            allowed = list(SECTIONS + SAFEGUARD_SECTIONS)
            raise ConfigError(f"section {section!r}: unknown; allowed: {allowed}{suggest(section, allowed)}")
        for name, value in values.items():
            home = section if section in SAFEGUARD_SECTIONS else fedml_safeguards.HOME_SECTION.get(name)
            if home is not None:
                safeguards.setdefault(home, {})[name] = _yaml_number(value)
                continue
            if name in fedml_safeguards.SHARED_KEYS:  # FedML's attack and defense both read it: both get it
                for home in fedml_safeguards.SHARED_KEYS[name]:
                    safeguards.setdefault(home, {}).setdefault(name, _yaml_number(value))
                continue
            f = BY_NAME.get(name)
            if f is None:
                suggestion = suggest(name, BY_NAME)
                known = name in FEDML_KEYS or name in FEDML_PASSTHROUGH
                if name in FEDML_SECURE_AGGREGATION_KEYS:
                    raise ConfigError(
                        f"{section}.{name}={value!r}: a key of FedML's secure aggregation (LSA), which the plugin "
                        f"does not run: with it the updates would be averaged in the clear. For secure "
                        f"aggregation use secagg_args: {{enable_secagg: true}} (docs/security.md: Secure "
                        f"aggregation), and remove {name}"
                    )
                if not known and suggestion:
                    raise ConfigError(f"{section}.{name}={value!r}: unknown key{suggestion}")
                if not known:
                    _warn_once(f"{section}.{name}: not a key of this plugin; passed to FedML unchecked")
                extra[name] = (section, value)
                where[name] = section
                if name in FEDML_KEYS or name == "partition_alpha":  # read by _fedml_key_meanings
                    given[name] = value
            elif f.metadata["section"] != section:
                raise ConfigError(f"{section}.{name}={value!r}: belongs in section {f.metadata['section']!r}")
            else:
                given[name] = value
    return given, where, extra, safeguards


def _name_other_algorithms_keys(
    given: Dict[str, Any], own_keys: Dict[str, dataclasses.Field], read: set, chosen: str
) -> None:
    """A warning for each algorithm key given that the chosen algorithm does not ``read`` (a YAML
    kept from a run of another algorithm): used by none, not silently."""
    for name in sorted(set(given) & set(own_keys) - read):
        owners = [a for a in algorithm_names() if name in algorithm_settings(a)]
        _warn_once(
            f"train_args.{name}={given[name]!r} is {' and '.join(owners)}'s; "
            f"train_args.federated_optimizer={chosen!r} does not read it"
        )


def load(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Load, override (``--set`` pairs) and validate a config file."""
    sections = load_yaml(path) if path else {}
    return resolve(sections, parse_overrides(overrides), source=path)
