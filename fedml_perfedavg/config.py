"""The plugin's configuration: FedML-style sectioned YAML, typed keys, validation, overrides.

Every key the plugin reads is declared once in ``SCHEMA`` with its section, default, type
and rule. Errors name the key, the given value and what is allowed.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration key has a value the plugin cannot run with."""


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    default: Any
    kind: type  # int, float, bool, str or list
    help: str
    choices: Optional[Tuple[Any, ...]] = None
    check: Optional[Callable[[Any], bool]] = None
    rule: str = ""  # what ``check`` allows, for error messages
    optional: bool = False  # ``None`` (YAML null) allowed


positive = (lambda v: v > 0, "> 0")
at_least_one = (lambda v: v >= 1, ">= 1")
non_negative = (lambda v: v >= 0, ">= 0")


def _key(section, name, default, kind, help, choices=None, rule=None, optional=False):
    check, text = rule if rule else (None, "")
    return Key(section, name, default, kind, help, choices, check, text, optional)


SCHEMA: List[Key] = [
    _key("common_args", "training_type", "simulation", str, "FedML platform", ("simulation", "cross_silo")),
    _key("common_args", "random_seed", 0, int, "seed of the partition, sampling, init and batches", rule=non_negative),
    _key("common_args", "output_dir", "runs", str, "folder under which each run gets its own directory"),
    _key("common_args", "fedml_home", "run_dir", str, "where FedML writes its .fedml files", ("run_dir", "user")),
    _key("common_args", "checkpoint_every", 100, int, "checkpoint every this many rounds (0: never; batched "
         "engine)", rule=non_negative),
    _key("common_args", "run_name", None, str, "run directory name (default: config name + time)", optional=True),
    _key("data_args", "dataset", "mnist", str, "dataset", ("mnist", "cifar10")),
    _key("data_args", "data_cache_dir", "./data", str, "torchvision root holding MNIST/ or cifar-10-batches-py/"),
    _key("data_args", "download", False, bool, "download the dataset through torchvision if missing"),
    _key("data_args", "partition_method", "paper", str, "user split", ("paper", "paper_diff_hetero")),
    _key("data_args", "images_per_class", None, int, "the paper's a (default 196 MNIST, 68 CIFAR-10)",
         rule=(lambda v: v >= 2 and v % 2 == 0, "an even number >= 2"), optional=True),
    _key("data_args", "test_images_per_class", None, int, "test a (default: a scaled by test/train size)",
         rule=(lambda v: v >= 2 and v % 2 == 0, "an even number >= 2"), optional=True),
    _key("model_args", "model", "mlp", str, "model", ("mlp", "cnn")),
    _key("model_args", "hidden_sizes", [80, 60], list, "MLP hidden layer widths",
         rule=(lambda v: len(v) > 0 and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in v),
               "a non-empty list of positive integers")),
    _key("train_args", "federated_optimizer", "PerFedAvg", str, "algorithm (see the registry)"),
    _key("train_args", "perfedavg_variant", "hf", str, "meta-gradient estimator", ("fo", "hf", "exact")),
    _key("train_args", "client_num_in_total", 50, int, "n, number of users", rule=at_least_one),
    _key("train_args", "client_num_per_round", 10, int, "r*n, users sampled per round", rule=at_least_one),
    _key("train_args", "new_user_fraction", 0.0, float, "fraction of users never trained on, reported apart "
         "as new users", rule=(lambda v: 0 <= v < 1, "in [0, 1)")),
    _key("train_args", "comm_round", 1000, int, "K, number of rounds", rule=at_least_one),
    _key("train_args", "local_steps", 10, int, "tau, local steps per round", rule=at_least_one),
    _key("train_args", "alpha", 0.01, float, "personalization (inner) step size", rule=positive),
    _key("train_args", "beta", 0.001, float, "meta step size; FedAvg's local SGD step size", rule=positive),
    _key("train_args", "delta", 0.001, float, "finite-difference width of the HF variant", rule=positive),
    _key("train_args", "batch_size", 40, int, "|D|: batch of the inner step (and of FedAvg)", rule=at_least_one),
    _key("train_args", "meta_batch_size", 40, int, "|D'|: batch of the outer gradient", rule=at_least_one),
    _key("train_args", "hessian_batch_size", 40, int, "|D''|: batch of the Hessian term", rule=at_least_one),
    _key("train_args", "aggregation", "uniform", str, "server average of returned models",
         ("uniform", "sample_weighted")),
    _key("train_args", "on_divergence", "stop", str,
         "non-finite values in local training: stop the run, or drop that client's update", ("stop", "skip_client")),
    _key("train_args", "max_update_norm", None, float, "reject client updates whose L2 distance to the global "
         "model exceeds this", rule=positive, optional=True),
    _key("train_args", "max_skipped_rounds", 3, int, "stop after this many rounds without an acceptable update",
         rule=at_least_one),
    _key("train_args", "simulation_engine", "batched", str,
         "sp round loop: batched (all sampled clients as one vmapped computation) or fedml (FedML's per-client loop)",
         ("batched", "fedml")),
    _key("validation_args", "frequency_of_the_test", 10, int, "evaluate every this many rounds", rule=at_least_one),
    _key("validation_args", "adapt_steps", 1, int, "alpha-steps of personalization at evaluation",
         rule=non_negative),
    _key("device_args", "using_gpu", False, bool, "run on CUDA"),
    _key("device_args", "gpu_id", 0, int, "CUDA device index", rule=non_negative),
    _key("device_args", "compile_local_update", False, bool, "batched engine: torch.compile the vmapped local "
         "update (CUDA graphs on GPU, ~8x faster rounds after about a minute of compiling; rarely pays on CPU)"),
    _key("comm_args", "backend", "sp", str, "FedML backend (sp, MPI: simulation; GRPC: cross_silo)",
         ("sp", "MPI", "GRPC")),
    _key("comm_args", "grpc_ipconfig_path", None, str, "cross-silo address file, CSV eid,rank,grpc_server_ip,"
         "grpc_server_port with a row per rank (launch-silo writes one on 127.0.0.1)", optional=True),
    _key("comm_args", "connect_timeout", 60.0, float, "cross-silo: seconds processes wait for each other to come "
         "up (a silo retries an unreachable server with backoff; the server waits for silos to come online)",
         rule=positive),
    _key("comm_args", "round_timeout", 600.0, float, "cross-silo: seconds the server waits for a round's silo "
         "updates (and the final goodbyes) before applying min_clients_per_round", rule=positive),
    _key("comm_args", "min_clients_per_round", None, int, "cross-silo: after round_timeout, go on without the "
         "silos that did not answer if at least this many did; else stop naming them (default: all)",
         rule=at_least_one, optional=True),
    _key("tracking_args", "enable_wandb", False, bool, "log to wandb (offline unless WANDB_MODE says otherwise)"),
    _key("tracking_args", "wandb_project", "fedml-perfedavg", str, "wandb project"),
    _key("tracking_args", "wandb_group", None, str, "wandb group (default: run name)", optional=True),
    _key("tracking_args", "show_progress", True, bool, "tqdm progress bar over rounds"),
]
SECTIONS = ("common_args", "data_args", "model_args", "train_args", "validation_args", "device_args",
            "comm_args", "tracking_args")
BY_NAME: Dict[str, Key] = {k.name: k for k in SCHEMA}

# FedML's own keys that may appear in a FedML YAML; passed through unchecked.
FEDML_KEYS = {
    "scenario", "using_mlops", "config_version", "epochs", "learning_rate", "client_optimizer", "weight_decay",
    "client_id_list", "worker_num", "gpu_mapping_file", "gpu_mapping_key", "is_mobile",
    "log_file_dir", "enable_tracking", "using_memory_profiler", "server_optimizer", "server_lr", "partition_alpha",
    "test_on_clients", "device_type", "rank", "role", "run_id", "process_id", "federated_optimizer",
}


@dataclass
class Config:
    """A validated configuration: every schema key has a value; extra FedML keys ride along."""

    values: Dict[str, Any]
    source: Optional[str] = None
    extra: Dict[str, Tuple[str, Any]] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def sections(self) -> Dict[str, Dict[str, Any]]:
        """The config as FedML-style nested sections (what ``summary.json`` records)."""
        out: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
        for key in SCHEMA:
            out[key.section][key.name] = self.values[key.name]
        for name, (section, value) in self.extra.items():
            out.setdefault(section, {})[name] = value
        return out

    def to_fedml_args(self, **overrides: Any) -> argparse.Namespace:
        """A FedML ``args`` object: every section flattened, FedML's command-line keys set."""
        # gpu_mapping_*: FedML's MPI path reads them even on CPU.
        args = argparse.Namespace(yaml_config_file=self.source or "", run_id="0", rank=0, local_rank=0,
                                  node_rank=0, role="client", run_device_id="0", using_mlops=False,
                                  gpu_mapping_file=None, gpu_mapping_key=None)
        for section in self.sections().values():
            for name, value in section.items():
                setattr(args, name, copy.deepcopy(value))
        for name, value in overrides.items():
            setattr(args, name, value)
        return args


def _suggest(name: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_value(key: Key, value: Any) -> Any:
    where = f"{key.section}.{key.name}={value!r}"
    if value is None:
        if key.optional:
            return None
        raise ConfigError(f"{where}: a value is required ({key.help})")
    if key.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key.kind is float and isinstance(value, str):
        # PyYAML follows YAML 1.1, where 1e-3 (no dot) is a string, not a number.
        try:
            value = float(value)
        except ValueError:
            pass
    if key.kind is int and isinstance(value, bool) or not isinstance(value, key.kind):
        raise ConfigError(f"{where}: must be of type {key.kind.__name__} ({key.help})")
    if key.kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(f"{where}: must be one of {list(key.choices)}{_suggest(str(value), map(str, key.choices))}")
    if key.check is not None and not key.check(value):
        raise ConfigError(f"{where}: must be {key.rule}")
    return value


def load_yaml(path: str) -> Dict[str, Dict[str, Any]]:
    """Read a FedML-style YAML; unlike FedML, a missing or unreadable file is an error."""
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
        name = name.split(".")[-1]
        if name not in BY_NAME and name not in FEDML_KEYS:
            raise ConfigError(f"--set {pair!r}: unknown key {name!r}{_suggest(name, BY_NAME)}")
        out[name] = yaml.safe_load(raw)
    return out


def resolve(sections: Dict[str, Dict[str, Any]], overrides: Optional[Dict[str, Any]] = None,
            source: Optional[str] = None) -> Config:
    """Merge YAML sections, defaults and overrides into a validated ``Config``."""
    given: Dict[str, Any] = {}
    extra: Dict[str, Tuple[str, Any]] = {}
    for section, values in sections.items():
        if section not in SECTIONS:
            raise ConfigError(f"section {section!r}: unknown; allowed: {list(SECTIONS)}{_suggest(section, SECTIONS)}")
        for name, value in values.items():
            key = BY_NAME.get(name)
            if key is None:
                suggestion = _suggest(name, BY_NAME)
                if name not in FEDML_KEYS and suggestion:
                    raise ConfigError(f"{section}.{name}={value!r}: unknown key{suggestion}")
                if name not in FEDML_KEYS:
                    logger.warning("%s.%s: not a key of this plugin; passed to FedML unchecked", section, name)
                extra[name] = (section, value)
            elif key.section != section:
                raise ConfigError(f"{section}.{name}={value!r}: belongs in section {key.section!r}")
            else:
                given[name] = value
    given.update(overrides or {})
    values = {}
    for key in SCHEMA:
        values[key.name] = _check_value(key, copy.deepcopy(given.get(key.name, key.default)))
    for name in set(given) - set(BY_NAME):
        extra[name] = (extra.get(name, ("train_args", None))[0], given[name])
    config = Config(values, source, extra)
    _check_relations(config)
    return config


def _check_relations(config: Config) -> None:
    from .registry import algorithm_names

    names = algorithm_names()
    if config.federated_optimizer not in names:
        raise ConfigError(f"train_args.federated_optimizer={config.federated_optimizer!r}: must be one of "
                          f"{names}{_suggest(config.federated_optimizer, names)}")
    if config.client_num_per_round > config.client_num_in_total:
        raise ConfigError(f"train_args.client_num_per_round={config.client_num_per_round!r}: must be <= "
                          f"train_args.client_num_in_total ({config.client_num_in_total})")
    platforms = {"simulation": ("sp", "MPI"), "cross_silo": ("GRPC",)}
    if config.backend not in platforms[config.training_type]:
        raise ConfigError(f"comm_args.backend={config.backend!r}: with common_args.training_type="
                          f"{config.training_type!r} it must be one of {list(platforms[config.training_type])}")
    if config.compile_local_update and (config.training_type != "simulation" or config.backend != "sp"
                                        or config.simulation_engine != "batched"):
        raise ConfigError("device_args.compile_local_update=True: only the batched engine compiles (comm_args."
                          "backend sp, train_args.simulation_engine batched)")
    minimum = config.min_clients_per_round
    if minimum is not None and minimum > config.client_num_per_round:
        raise ConfigError(f"comm_args.min_clients_per_round={minimum!r}: must be <= "
                          f"train_args.client_num_per_round ({config.client_num_per_round})")
    trained = config.client_num_in_total - int(round(config.new_user_fraction * config.client_num_in_total))
    if config.client_num_per_round > trained:
        raise ConfigError(f"train_args.new_user_fraction={config.new_user_fraction!r}: leaves {trained} training "
                          f"users, fewer than train_args.client_num_per_round ({config.client_num_per_round})")


def load(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Load, override (``--set`` pairs) and validate a config file."""
    sections = load_yaml(path) if path else {}
    return resolve(sections, parse_overrides(overrides), source=path)


def check_against_data(config: Config, smallest_train_size: int) -> None:
    """Batch sizes must fit in every user's training data (batches are drawn without replacement)."""
    for name in ("batch_size", "meta_batch_size", "hessian_batch_size"):
        value = config.values[name]
        if value > smallest_train_size:
            raise ConfigError(f"train_args.{name}={value!r}: must be <= the smallest user's training data "
                              f"({smallest_train_size} samples)")
