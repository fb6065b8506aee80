"""The run's configuration: FedML's sectioned YAML read into one typed, frozen dataclass.

:class:`Config` is the one source of every key's section, type, default, allowed values and
help text, declared section by section as FedML's YAML is (:class:`CommonArgs` to
:class:`TrackingArgs`, and each algorithm's own ``Settings``; docs/configuration.md's table is
generated from them by :mod:`.reference`), and of the rules that relate keys (:data:`RULES`).
Choices come from the modules that own them, and so do the checks that need their domain (the
paper split's plan: :func:`~fedml_perfedavg.data.loading.check_paper_split`), or they add them
(:func:`add_rule`: FedML's rehearsal of its safeguard sections, :mod:`.safeguard_rules`); this
module imports no FedML. Errors name ``section.key=value`` and what is allowed. FedML's own keys
are read as FedML means them (:data:`FEDML_KEYS`): ``learning_rate`` is beta, ``batch_size`` is
|D|; keys the chosen algorithm does not use are named in a warning. FedML's flat ``args`` to and
from a config, and the transport's values: :mod:`.fedml_args`; the command line's options:
:mod:`.options`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import yaml

from ..algorithms.base import AGGREGATIONS, DIVERGENCE_POLICIES, FederatedAlgorithm, dp_refusal
from ..algorithms.registry import (
    BUILTIN_ALGORITHMS,
    FEDML_OWN,
    algorithm_class,
    algorithm_names,
    algorithm_settings,
    settings_clash,
    canonical_name,
)
from ..core.errors import ConfigError
from ..core.settings import AT_LEAST_ONE as _at_least_one
from ..core.settings import EVEN as _even
from ..core.settings import NON_NEGATIVE as _non_negative
from ..core.settings import POSITIVE as _positive
from ..core.settings import check_value, field_default, suggest
from ..core.settings import in_section
from ..core.settings import setting as _setting
from ..core.privacy import DPSGD
from ..data.loading import check_paper_split
from ..data.partition import PARTITIONS
from ..fedml_bridge import safeguard_keys as fedml_safeguards
from ..fedml_bridge.cross_silo.credentials import check_security

logger = logging.getLogger(__name__)

__all__ = [
    "Config",
    "ConfigError",
    "load",
    "load_yaml",
    "parse_overrides",
    "resolve",
    "SECTIONS",
]

SECTIONS = (
    "common_args",
    "data_args",
    "model_args",
    "train_args",
    "validation_args",
    "device_args",
    "comm_args",
    "secagg_args",
    "tracking_args",
)
# FedML's DP, attack and defense sections: their keys go to FedML's own classes, section by
# section (fedml_bridge/safeguards.py), so dp_args.delta is not train_args.delta.
SAFEGUARD_SECTIONS = fedml_safeguards.SECTIONS
TRAINING_TYPES = ("simulation", "cross_silo")
BACKENDS = {"simulation": ("sp", "MPI"), "cross_silo": ("GRPC",)}
ENGINES = ("batched", "fedml")
SILO_DATA = ("shared", "own")
FEDML_HOME = "run_dir, user, or a folder"


@dataclass(frozen=True)
@in_section("common_args")
class CommonArgs:
    """``common_args``: the platform, the seed, and where a run and its checkpoints go."""

    training_type: str = _setting(str, "simulation", "FedML platform", TRAINING_TYPES)
    random_seed: int = _setting(int, 0, "seed of the partition, sampling, init and batches", rule=_non_negative)
    output_dir: str = _setting(str, "runs", "folder under which each run gets its own directory")
    fedml_home: str = _setting(
        str,
        "run_dir",
        "where FedML writes its .fedml files: the run directory, the user's home (FedML's default), or a folder",
    )
    checkpoint_every: int = _setting(
        int,
        100,
        "checkpoint every this many rounds (0: never; batched engine); a cross-silo server: after every "
        "round unless 0 (`--resume RUN_DIR --rank 0 --role server` continues a crashed one)",
        rule=_non_negative,
    )
    overwrite: bool = _setting(
        bool,
        False,
        "start a new run in a run directory that holds one, "
        "replacing its results (without it that is an error; --resume continues it instead)",
    )
    run_name: Optional[str] = _setting(
        str,
        None,
        "run directory name (default: config name + time; cross-silo: config name + `-run-` + --run_id, "
        "the same folder for every process of the run)",
        optional=True,
    )


@dataclass(frozen=True)
@in_section("data_args")
class DataArgs:
    """``data_args``: the dataset and its split into users."""

    dataset: str = _setting(
        str,
        "mnist",
        "dataset: mnist or cifar10 for the paper's split, or any dataset fedml.data.load knows",
    )
    data_cache_dir: str = _setting(str, "./data", "torchvision root holding MNIST/ or cifar-10-batches-py/")
    download: bool = _setting(bool, False, "download the dataset through torchvision if missing")
    partition_method: str = _setting(
        str, "paper", "user split: paper, paper_diff_hetero (the paper's), or one of FedML's (e.g. hetero)"
    )
    images_per_class: Optional[int] = _setting(
        int, None, "the paper's a (default 196 MNIST, 68 CIFAR-10)", rule=_even, optional=True
    )
    test_images_per_class: Optional[int] = _setting(
        int, None, "test a (default: a scaled by test/train size)", rule=_even, optional=True
    )


@dataclass(frozen=True)
@in_section("model_args")
class ModelArgs:
    """``model_args``: the model every user trains."""

    model: str = _setting(
        str,
        "mlp",
        "model: the plugin's mlp (the paper's) or small_cnn, or any "
        "name fedml.model.create knows (lr, cnn, resnet56, ...)",
    )
    hidden_sizes: List[int] = _setting(
        list,
        [80, 60],
        "MLP hidden layer widths",
        rule=(
            lambda v: len(v) > 0 and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in v),
            "a non-empty list of positive integers",
        ),
    )


@dataclass(frozen=True)
@in_section("train_args")
class TrainArgs:
    """``train_args``: the algorithm, its step sizes, the users, the rounds, the checks on updates."""

    federated_optimizer: str = _setting(
        str,
        "PerFedAvg",
        "algorithm: a name in the plugin's registry (PerFedAvg, FedAvgUpdate, FedAvgARUBA, ...)",
    )
    client_num_in_total: int = _setting(int, 50, "n, number of users", rule=_at_least_one)
    client_num_per_round: int = _setting(int, 10, "r*n, users sampled per round", rule=_at_least_one)
    new_user_fraction: float = _setting(
        float,
        0.0,
        "fraction of users never trained on, reported apart as new users",
        rule=(lambda v: 0 <= v < 1, "in [0, 1)"),
    )
    comm_round: int = _setting(int, 1000, "K, number of rounds", rule=_at_least_one)
    local_steps: int = _setting(int, 10, "tau, local steps per round", rule=_at_least_one)
    alpha: float = _setting(float, 0.01, "personalization (inner) step size", rule=_positive)
    beta: float = _setting(
        float,
        0.001,
        "meta step size; FedAvgUpdate's local SGD step size (FedML's learning_rate means the same)",
        rule=_positive,
    )
    batch_size: int = _setting(int, 40, "|D|: batch of the inner step (and of FedAvgUpdate)", rule=_at_least_one)
    meta_batch_size: Optional[int] = _setting(
        int,
        None,
        "|D'|: batch of the outer gradient (default: batch_size)",
        rule=_at_least_one,
        optional=True,
    )
    hessian_batch_size: Optional[int] = _setting(
        int,
        None,
        "|D''|: batch of the Hessian term (default: batch_size)",
        rule=_at_least_one,
        optional=True,
    )
    aggregation: str = _setting(str, "uniform", "server average of returned models", AGGREGATIONS)
    on_divergence: str = _setting(
        str,
        "stop",
        "non-finite values in local training: stop the run, or drop that client's update",
        DIVERGENCE_POLICIES,
    )
    max_update_norm: Optional[float] = _setting(
        float,
        None,
        "reject client updates whose L2 distance to the global model exceeds this",
        rule=_positive,
        optional=True,
    )
    max_update_ratio: Optional[float] = _setting(
        float,
        1.0,
        "reject client updates that move the "
        "model by more than this times its own norm (times 1 if its norm "
        "is below 1): a bound on by default, so one client cannot move the "
        "model by orders of magnitude (honest MNIST updates: under 0.13); "
        "null: off",
        rule=_positive,
        optional=True,
    )
    update_norm_factor: Optional[float] = _setting(
        float,
        8.0,
        "reject client updates that move the model by more than this times the median of the last 20 "
        "accepted ones and the round's (honest MNIST runs stayed within 5x over 1000 rounds; a liar "
        "cannot move it by many honest updates' worth); null: off",
        rule=_positive,
        optional=True,
    )
    max_weight_ratio: Optional[float] = _setting(
        float,
        3.0,
        "aggregation sample_weighted: a client's declared sample count weighs at most this times the "
        "median of the last 20 accepted counts (one claiming 2^31 samples is not the average); null: off",
        rule=_positive,
        optional=True,
    )
    max_skipped_rounds: int = _setting(
        int, 3, "stop after this many rounds without an acceptable update", rule=_at_least_one
    )
    simulation_engine: str = _setting(
        str,
        "batched",
        "sp round loop: batched (all sampled clients as one vmapped computation) or fedml (FedML's per-client loop)",
        ENGINES,
    )


@dataclass(frozen=True)
@in_section("validation_args")
class ValidationArgs:
    """``validation_args``: which rounds are evaluated, and how."""

    frequency_of_the_test: int = _setting(
        int, 10, "evaluate every this many rounds (and the first and last round)", rule=_at_least_one
    )
    adapt_steps: int = _setting(int, 1, "alpha-steps of personalization at evaluation", rule=_non_negative)
    stationarity_every: int = _setting(
        int,
        0,
        "log ||grad F(w)||^2, the paper's stationarity "
        "measure (exact Hessian-vector products, every training user's full data), "
        "with the evaluations of every this many rounds and the last; a multiple of "
        "frequency_of_the_test (0: never; it costs several evaluations)",
        rule=_non_negative,
    )
    random_iterate: bool = _setting(
        bool,
        False,
        "also evaluate the average of the round's "
        "clients' iterates at a step t_k drawn uniformly from 0..tau-1 (the paper's "
        "remark after Theorem 4.5); simulation",
    )


@dataclass(frozen=True)
@in_section("device_args")
class DeviceArgs:
    """``device_args``: where the maths runs."""

    using_gpu: bool = _setting(bool, False, "run on CUDA")
    gpu_id: int = _setting(int, 0, "CUDA device index", rule=_non_negative)
    compile_local_update: bool = _setting(
        bool,
        False,
        "batched engine: torch.compile the vmapped "
        "local update (CUDA graphs on GPU, ~8x faster rounds after about a "
        "minute of compiling; rarely pays on CPU)",
    )


@dataclass(frozen=True)
@in_section("comm_args")
class CommArgs:
    """``comm_args``: MPI and cross-silo: the transport, its security, the deadlines and the silos' data."""

    backend: str = _setting(str, "sp", "FedML backend (sp, MPI: simulation; GRPC: cross_silo)", ("sp", "MPI", "GRPC"))
    grpc_ipconfig_path: Optional[str] = _setting(
        str,
        None,
        "cross-silo address file, CSV eid,rank,"
        "grpc_server_ip,grpc_server_port with a row per rank (launch-silo "
        "writes one on 127.0.0.1)",
        optional=True,
    )
    connect_timeout: float = _setting(
        float,
        60.0,
        "cross-silo: seconds processes wait for each other "
        "to come up (a silo retries an unreachable server with backoff; the server "
        "waits for silos to come online)",
        rule=_positive,
    )
    round_timeout: float = _setting(
        float,
        600.0,
        "cross-silo: seconds the server waits for a round's "
        "silo updates (and the final goodbyes) before applying min_clients_per_round; "
        "the ceiling of the adaptive deadline",
        rule=_positive,
    )
    round_timeout_factor: float = _setting(
        float,
        10.0,
        "cross-silo: after two rounds the deadline is "
        "this many times the slowest round so far (at least 5 s, at most "
        "round_timeout), so a dead silo costs seconds; 0: always round_timeout",
        rule=(lambda v: v == 0 or v >= 1, "0 or >= 1"),
    )
    min_clients_per_round: Optional[int] = _setting(
        int,
        None,
        "cross-silo: after round_timeout, go "
        "on without the silos that did not answer if at least this "
        "many did; else stop naming them (default: all)",
        rule=_at_least_one,
        optional=True,
    )
    tls_dir: Optional[str] = _setting(
        str,
        None,
        "cross-silo: folder with the run CA (ca.pem) and this "
        "rank's rank-R.pem and rank-R.key (fedml-perfedavg certs makes them); mutual "
        "TLS, each rank bound to its certificate",
        optional=True,
    )
    insecure: bool = _setting(
        bool,
        False,
        "cross-silo without tls_dir: plaintext and unauthenticated "
        "(messages are still never unpickled); only on a network you trust",
    )
    max_message_bytes: Optional[int] = _setting(
        int,
        None,
        "cross-silo: refuse a message larger than this before decoding it (default: 2 x the model's bytes + 1 MiB)",
        rule=(lambda v: v >= 1024, ">= 1024"),
        optional=True,
    )
    silo_data: str = _setting(
        str,
        "shared",
        "cross-silo: own (a deployment: silo rank R holds only "
        "user R-1's data, client_num_in_total is the number of silos, the server reads no "
        "data and the silos evaluate) or shared (every process holds the whole split: sp "
        "reproduced over a network)",
        SILO_DATA,
    )
    max_connections: Optional[int] = _setting(
        int,
        None,
        "cross-silo: concurrent connections a rank's "
        "port holds in all (default 1024, and below what the open-file limit "
        "holds); at the cap a waiting one (no request yet) is closed for a newcomer, "
        "and a newcomer is refused only when none waits",
        rule=_at_least_one,
        optional=True,
    )
    max_connections_per_peer: Optional[int] = _setting(
        int,
        None,
        "cross-silo: concurrent connections "
        "from one address still waiting for their first request (no certificate shown yet; "
        "at the cap the one idle longest is closed for a newcomer; default 2 x the run's ranks + 8: the "
        "ranks of a run on one machine share one address)",
        rule=_at_least_one,
        optional=True,
    )
    handshake_timeout: float = _setting(
        float,
        5.0,
        "cross-silo: seconds a connection has to finish its TLS handshake and make its first "
        "request (and what this process gives its own connection attempts)",
        rule=_positive,
    )
    idle_timeout: float = _setting(
        float,
        300.0,
        "cross-silo: seconds a connection may stay idle "
        "before it is closed (gRPC reconnects when it has something to send)",
        rule=_positive,
    )


@dataclass(frozen=True)
@in_section("secagg_args")
class SecAggArgs:
    """``secagg_args``: secure aggregation across data-owner silos (the server learns only the sum)."""

    enable_secagg: bool = _setting(
        bool,
        False,
        "cross-silo with comm_args.silo_data own and TLS: each round the sampled silos mask their "
        "clipped updates so that the server learns only their sum; a silo lost after sharing its "
        "keys is recovered",
    )
    reconstruction_threshold: Optional[int] = _setting(
        int,
        None,
        "secure aggregation: the silos a round needs to the end (and the fewest whose shares rebuild "
        "a secret; fewer colluding with the server learn nothing beyond the sum); must be above "
        "(client_num_per_round + max_colluding_silos) / 2, which is the default's smallest value",
        rule=(lambda v: v >= 2, ">= 2"),
        optional=True,
    )
    max_colluding_silos: int = _setting(
        int,
        0,
        "secure aggregation: the silos that may collude with the server, which each silo allows for "
        "by refusing a threshold not above (the round's sampled silos + this) / 2",
        rule=(lambda v: v >= 0, ">= 0"),
    )
    min_summed_silos: int = _setting(
        int,
        3,
        "secure aggregation: the fewest silos a silo lets its input be summed with, itself included "
        "(with 2, each would learn the other's update from the new model)",
        rule=(lambda v: v >= 3, ">= 3 (two silos summed learn each other's update)"),
    )


@dataclass(frozen=True)
@in_section("tracking_args")
class TrackingArgs:
    """``tracking_args``: wandb and the progress bar."""

    enable_wandb: bool = _setting(bool, False, "log to wandb (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = _setting(str, "fedml-perfedavg", "wandb project")
    wandb_group: Optional[str] = _setting(str, None, "wandb group (default: run name)", optional=True)
    show_progress: bool = _setting(bool, True, "tqdm progress bar over rounds (on a terminal)")


# Config inherits every section; dataclasses collect inherited fields from the last base to the
# first, so the bases are listed in reverse to keep the YAML's (and docs/configuration.md's table's) order.
@dataclass(frozen=True)
class Config(
    TrackingArgs, SecAggArgs, CommArgs, DeviceArgs, ValidationArgs, TrainArgs, ModelArgs, DataArgs, CommonArgs
):
    """A validated run configuration (FedML flattens its YAML sections; so does this)."""

    # Not settings: where the config came from, and FedML keys that ride along unchecked.
    source: Optional[str] = field(default=None, compare=False, metadata={"internal": True})
    extra: Dict[str, Tuple[str, Any]] = field(default_factory=dict, compare=False, metadata={"internal": True})
    # dp_args, attack_args, defense_args as given: FedML's keys for its own DP/attack/defense classes.
    safeguards: Dict[str, Dict[str, Any]] = field(default_factory=dict, metadata={"internal": True})
    # The algorithms' own settings (each algorithm's ``Settings``), by key: read as attributes.
    algorithm_values: Dict[str, Any] = field(default_factory=dict, metadata={"internal": True})

    def __getattr__(self, name: str) -> Any:
        # Only for names that are no field: an algorithm's own key (config.perfedavg_variant).
        values = self.__dict__.get("algorithm_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def algorithm_settings(self, algorithm: str) -> Dict[str, Any]:
        """``algorithm``'s own keys and their values in this config."""
        return {name: self.algorithm_values[name] for name in algorithm_settings(algorithm)}

    @property
    def privacy(self) -> Optional[DPSGD]:
        """DP-SGD in the local steps (``dp_args.dp_solution_type: dpsgd``), or None."""
        return DPSGD.from_section(self.safeguards.get("dp_args", {}))

    @property
    def own_data(self) -> bool:
        """Cross-silo in data-owner mode: each silo holds its own user's data alone."""
        return self.training_type == "cross_silo" and self.silo_data == "own"

    @property
    def silo_count(self) -> int:
        """Cross-silo: the number of silo processes (ranks 1..this): one per user in data-owner
        mode, one per client of a round in shared mode."""
        return self.client_num_in_total if self.own_data else self.client_num_per_round

    @property
    def batch_sizes(self) -> Tuple[int, int, int]:
        """(|D|, |D'|, |D''|), the two last defaulting to |D|."""
        return (self.batch_size, self.meta_batch_size or self.batch_size, self.hessian_batch_size or self.batch_size)

    @property
    def values(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in self.own_settings()}

    def own_settings(self) -> List[dataclasses.Field]:
        """The settings this config holds: every section's, and its algorithm's own alone."""
        others = set(algorithm_fields()) - set(self.algorithm_values)
        return [f for f in settings() if f.name not in others]

    def sections(self) -> Dict[str, Dict[str, Any]]:
        """The config as FedML-style nested sections (what ``summary.json`` and config.yaml record)."""
        out: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
        for section, values in self.safeguards.items():
            out[section] = copy.deepcopy(values)
        for f in self.own_settings():
            value = getattr(self, f.name)  # a Step is recorded as its name, as YAML and FedML spell it
            out[f.metadata["section"]][f.name] = value.value if isinstance(value, Enum) else copy.deepcopy(value)
        for name, (section, value) in self.extra.items():
            out.setdefault(section, {})[name] = value
        return out


def settings(builtin_only: bool = False) -> List[dataclasses.Field]:
    """Every setting, in table order: :class:`Config`'s fields, and after ``train_args``' own the
    algorithms' (each algorithm's ``Settings``: the built-ins', and unless ``builtin_only`` those
    registered so far)."""
    own = [f for f in dataclasses.fields(Config) if not f.metadata.get("internal")]
    last_train = max(i for i, f in enumerate(own) if f.metadata["section"] == "train_args")
    taken = {f.name for f in own}
    algorithms = []
    for f in algorithm_fields(builtin_only).values():
        if f.name in taken:
            raise TypeError(f"an algorithm's setting {f.name!r} is already a config key: name it after the algorithm")
        algorithms.append(f)
    return own[: last_train + 1] + algorithms + own[last_train + 1 :]


def algorithm_fields(builtin_only: bool = False) -> Dict[str, dataclasses.Field]:
    """The algorithms' own settings by key (the built-ins, and unless ``builtin_only`` those
    registered so far)."""
    fields: Dict[str, dataclasses.Field] = {}
    owners: Dict[str, str] = {}
    for name in BUILTIN_ALGORITHMS if builtin_only else algorithm_names():
        mine = algorithm_settings(name)
        for key, f in mine.items():
            if key in fields:  # an installed algorithm (an entry point) is not checked by register()
                clash = settings_clash(name, {key: f}, owners[key], {key: fields[key]})
                if clash is not None:
                    raise TypeError(clash)
                continue
            fields[key], owners[key] = f, name
    return fields


class _SettingsByName(Mapping):
    """Every setting by key, as :func:`settings` lists them when read (an algorithm registered
    later is in it)."""

    def __init__(self) -> None:
        self._cached: Tuple[Tuple[str, ...], Dict[str, dataclasses.Field]] = ((), {})

    def _index(self) -> Dict[str, dataclasses.Field]:
        algorithms = tuple(algorithm_names())
        if self._cached[0] != algorithms or not self._cached[1]:
            self._cached = (algorithms, {f.name: f for f in settings()})
        return self._cached[1]

    def __getitem__(self, name: str) -> dataclasses.Field:
        return self._index()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index())

    def __len__(self) -> int:
        return len(self._index())


BY_NAME: Mapping[str, dataclasses.Field] = _SettingsByName()

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
    "partition_alpha",  # FedML's Dirichlet split: used by its loaders except MNIST's (see _fedml_key_meanings)
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


def _yaml_number(value: Any) -> Any:
    """``1e-5`` as a float: PyYAML follows YAML 1.1, where an exponent without a dot is a string."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) and any(c.isdigit() for c in value) else value
    return value


# -- rules that relate keys -------------------------------------------------------------------
def _rule_algorithm(c: Config) -> None:
    names = algorithm_names()
    if c.federated_optimizer in names:
        return
    if c.federated_optimizer in FEDML_OWN:
        raise ConfigError(
            f"train_args.federated_optimizer={c.federated_optimizer!r}: that is FedML's own algorithm "
            f"(run it with FedML's own main script); the plugin runs {names} (the paper's FedAvg "
            f"baseline is FedAvgUpdate)"
        )
    raise ConfigError(
        f"train_args.federated_optimizer={c.federated_optimizer!r}: must be one of "
        f"{names}{suggest(c.federated_optimizer, names)}"
    )


# The keys only FedML's secure aggregation reads (cross_silo/lightsecagg).
FEDML_SECURE_AGGREGATION_KEYS = (
    "prime_number",
    "precision_parameter",
    "privacy_guarantee",
    "targeted_number_active_clients",
)


def _rule_clients(c: Config) -> None:
    if c.client_num_per_round > c.client_num_in_total:
        raise ConfigError(
            f"train_args.client_num_per_round={c.client_num_per_round!r}: must be <= "
            f"train_args.client_num_in_total ({c.client_num_in_total})"
        )
    trained = c.client_num_in_total - int(round(c.new_user_fraction * c.client_num_in_total))
    if c.client_num_per_round > trained:
        raise ConfigError(
            f"train_args.new_user_fraction={c.new_user_fraction!r}: leaves {trained} training users, "
            f"fewer than train_args.client_num_per_round ({c.client_num_per_round})"
        )


def _rule_platform(c: Config) -> None:
    if c.backend not in BACKENDS[c.training_type]:
        raise ConfigError(
            f"comm_args.backend={c.backend!r}: with common_args.training_type={c.training_type!r} "
            f"it must be one of {list(BACKENDS[c.training_type])}"
        )
    if c.compile_local_update and (
        c.training_type != "simulation" or c.backend != "sp" or c.simulation_engine != "batched"
    ):
        raise ConfigError(
            "device_args.compile_local_update=True: only the batched engine compiles (comm_args."
            "backend sp, train_args.simulation_engine batched)"
        )
    if c.stationarity_every % c.frequency_of_the_test:
        raise ConfigError(
            f"validation_args.stationarity_every={c.stationarity_every!r}: must be a multiple of "
            f"validation_args.frequency_of_the_test ({c.frequency_of_the_test}), so it falls on "
            f"evaluations (or 0: never)"
        )
    if c.random_iterate and c.training_type != "simulation":
        raise ConfigError(
            "validation_args.random_iterate=True: only in simulation (common_args.training_type "
            "simulation), where the server holds every user's data to recompute the iterates"
        )
    if c.training_type == "cross_silo":
        check_security(c.tls_dir, c.insecure)
    check_scenario(c.training_type, c.extra.get("scenario", (None, None))[1])
    if c.silo_data == "own" and c.training_type != "cross_silo":
        raise ConfigError(
            "comm_args.silo_data='own': only across silos (common_args.training_type cross_silo); "
            "a simulation holds every user's data"
        )
    if c.own_data and c.stationarity_every:
        raise ConfigError(
            f"validation_args.stationarity_every={c.stationarity_every!r}: needs every user's data in "
            f"one process; with comm_args.silo_data='own' the server holds none (set it to 0)"
        )
    if c.min_clients_per_round is not None and c.min_clients_per_round > c.client_num_per_round:
        raise ConfigError(
            f"comm_args.min_clients_per_round={c.min_clients_per_round!r}: must be <= "
            f"train_args.client_num_per_round ({c.client_num_per_round})"
        )


def check_scenario(training_type: Any, scenario: Any) -> None:
    """The plugin's algorithms run FedML's horizontal cross-silo scenario only."""
    if training_type == "cross_silo" and scenario not in (None, "horizontal"):
        raise ConfigError(
            f"common_args.scenario={scenario!r}: the plugin's algorithms run FedML's horizontal "
            f"cross-silo only (one process per silo; FedML's hierarchical scenario, several processes "
            f"per silo under torch DDP, would train nothing). Use scenario: horizontal: a silo's one "
            f"process uses its host's cores as torch threads"
        )


def _rule_split(c: Config) -> None:
    """The paper's split, planned (:func:`~fedml_perfedavg.data.loading.check_paper_split`);
    batches are drawn without replacement, so they must fit in the smallest user's training data."""
    if c.partition_method not in PARTITIONS:
        return  # FedML's own loaders: checked against the data once it is loaded
    smallest, a = check_paper_split(
        c.dataset, c.client_num_in_total, c.images_per_class, c.test_images_per_class, c.partition_method, c.random_seed
    )
    check_batch_sizes(
        c,
        smallest,
        f"the smallest user's training data under data_args.images_per_class={a} "
        f"(data_args.partition_method={c.partition_method!r})",
    )


def check_batch_sizes(c: Config, smallest: int, whose: str) -> None:
    """Each minibatch (D, D', D'') is drawn without replacement from one client's training data:
    no batch may be larger than ``smallest`` (``whose`` says whose data that is)."""
    for name, value in zip(("batch_size", "meta_batch_size", "hessian_batch_size"), c.batch_sizes):
        if value > smallest:
            raise ConfigError(f"train_args.{name}={value!r}: must be <= {whose} ({smallest} samples)")


def _rule_secagg(c: Config) -> None:
    """Secure aggregation needs what makes it hold (own data, TLS, an update bound to clip to) and
    refuses what needs to see one silo's update (FedML's defenses, model attacks, central DP's
    per-update clipping)."""
    if not c.enable_secagg:
        if c.reconstruction_threshold is not None:
            raise ConfigError(
                f"secagg_args.reconstruction_threshold={c.reconstruction_threshold!r}: only with "
                f"secagg_args.enable_secagg true"
            )
        return
    need = "secagg_args.enable_secagg=True"
    if not c.own_data:
        raise ConfigError(
            f"{need}: only across data-owner silos (common_args.training_type cross_silo, comm_args.silo_data "
            f"own); here training_type={c.training_type!r}, silo_data={c.silo_data!r}"
        )
    if not c.tls_dir:
        raise ConfigError(
            f"{need}: needs comm_args.tls_dir (each silo's keys are bound to its certificate); "
            f"comm_args.insecure cannot carry it"
        )
    if c.max_update_ratio is None and c.max_update_norm is None:
        raise ConfigError(
            f"{need}: needs train_args.max_update_ratio or train_args.max_update_norm (each silo clips its "
            f"update to that bound, which makes the sum fit 32-bit fixed point); both are null"
        )
    if algorithm_class(c.federated_optimizer).returns_whole_state:
        raise ConfigError(
            f"{need}: train_args.federated_optimizer={c.federated_optimizer!r} sends back more than its "
            f"parameters (per-client statistics the server reads one by one); use PerFedAvg or FedAvgUpdate"
        )
    algorithm = algorithm_class(c.federated_optimizer)
    if algorithm.combine is not FederatedAlgorithm.combine:
        raise ConfigError(
            f"{need}: train_args.federated_optimizer={c.federated_optimizer!r} overrides combine "
            f"({algorithm.__module__}.{algorithm.__qualname__}.combine), its own aggregation of the clients' "
            f"updates; under secure aggregation the server holds only their weighted sum, so it could apply "
            f"the plain weighted mean alone. Use an algorithm that aggregates by the mean, or secure "
            f"aggregation off"
        )
    _rule_secagg_counts(c)


def _rule_secagg_counts(c: Config) -> None:
    """The numbers each silo enforces of a secure round (secagg/rounds.py ``SiloRules``), refused
    at start rather than by every silo in every round."""
    k, colluding, fewest = c.client_num_per_round, c.max_colluding_silos, c.min_summed_silos
    if k < fewest:
        raise ConfigError(
            f"train_args.client_num_per_round={k!r}: with secagg_args.enable_secagg each round sums at least "
            f"secagg_args.min_summed_silos={fewest} silos (with 2, each would learn the other's update from the "
            f"new model; with 1, the sum is that silo's update). Allowed: client_num_per_round >= {fewest}"
        )
    threshold = c.reconstruction_threshold
    if threshold is not None and threshold > k:
        raise ConfigError(
            f"secagg_args.reconstruction_threshold={threshold!r}: must be <= train_args.client_num_per_round "
            f"({k}), the silos a round has"
        )
    if threshold is not None and 2 * threshold <= k + colluding:
        raise ConfigError(
            f"secagg_args.reconstruction_threshold={threshold!r}: must be above (client_num_per_round {k} + "
            f"secagg_args.max_colluding_silos {colluding}) / 2, or a server (with that many silos) could rebuild "
            f"both secrets of a silo and unmask its update. Allowed: {(k + colluding) // 2 + 1} to {k}"
        )
    if threshold is None and (k + colluding) // 2 + 1 > k:
        raise ConfigError(
            f"secagg_args.max_colluding_silos={colluding!r}: a threshold above (client_num_per_round {k} + "
            f"{colluding}) / 2 would need more silos than a round has. Allowed: max_colluding_silos <= {k - 1}"
        )


def _rule_client_state(c: Config) -> None:
    """A client's own state stays with whoever holds the client: across silos, only a data
    owner's silo always holds the same client (algorithms/client_states.py)."""
    privacy = c.privacy
    if privacy is not None and privacy.adaptive and c.training_type == "cross_silo" and not c.own_data:
        raise ConfigError(
            f"dp_args.clip='adaptive' with comm_args.silo_data={c.silo_data!r}: each user's clip bound is a "
            f"state of its own, which stays with the silo that holds the user; across silos that is data-owner "
            f"mode (comm_args.silo_data: own), where each silo holds one user for the whole run"
        )
    if algorithm_class(c.federated_optimizer).keeps_client_state and c.training_type == "cross_silo" and not c.own_data:
        raise ConfigError(
            f"comm_args.silo_data={c.silo_data!r}: train_args.federated_optimizer={c.federated_optimizer!r} keeps "
            f"a state of each client's own, which stays with the silo that holds the client; across silos that "
            f"is data-owner mode (comm_args.silo_data: own), where each silo holds one user for the whole run"
        )


def _rule_privacy(c: Config) -> None:
    """DP-SGD's keys (core/privacy.py), and what would read a user's data outside the mechanism."""
    if c.privacy is None:
        return
    need = "dp_args.dp_solution_type='dpsgd'"
    if c.stationarity_every:
        raise ConfigError(
            f"validation_args.stationarity_every={c.stationarity_every!r} with {need}: the measure reads every "
            f"user's gradients without clipping or noise; set it to 0"
        )
    if c.random_iterate:
        raise ConfigError(
            f"validation_args.random_iterate=True with {need}: evaluating a second model each round is a "
            f"second personalization on every user's data, which the accountant does not count; set it false"
        )
    why = dp_refusal(algorithm_class(c.federated_optimizer))  # the algorithm's own answer (algorithms/base.py)
    if why is not None:
        raise ConfigError(f"train_args.federated_optimizer={c.federated_optimizer!r} with {need}: {why}")


RULES: List[Callable[[Config], None]] = [
    _rule_algorithm,
    _rule_clients,
    _rule_platform,
    _rule_split,
    _rule_privacy,
    _rule_client_state,
    _rule_secagg,  # before FedML's own checks of its sections: what cannot work at all is said first
]


def add_rule(rule: Callable[[Config], None]) -> None:
    """Check every config with ``rule`` too, after the config's own: a module whose domain a check
    is in adds it (run/safeguard_rules.py: FedML's rehearsal of its DP, attack and defense
    sections), so that this module imports none of them."""
    if rule not in RULES:
        RULES.append(rule)


# -- reading ----------------------------------------------------------------------------------
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


def _fedml_key_meanings(given: Dict[str, Any], where: Dict[str, str]) -> None:
    """FedML's keys as FedML means them: ``learning_rate`` is beta; the unused ones warned."""
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
        _warn_once(
            f"data_args.partition_method={partition!r} is not used: FedML's MNIST loader reads LEAF's fixed "
            f"per-writer split (fedml/data/MNIST/data_loader.py); partition_method paper gives the paper's"
        )
    if "partition_alpha" in given:
        if partition in PARTITIONS:
            _warn_once(
                f"data_args.partition_alpha={given['partition_alpha']!r} is not used: the paper's split "
                f"(partition_method {partition!r}) has no Dirichlet parameter"
            )
        elif dataset == "mnist":
            _warn_once(
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
        _warn_once(f"{where.get(name, 'train_args')}.{name}={value!r} is {meaning}")


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
    _fedml_key_meanings(given, where)
    index = dict(BY_NAME)
    values = {name: check_value(f, copy.deepcopy(given.get(name, field_default(f)))) for name, f in index.items()}
    for name in set(given) - set(index):
        extra[name] = (extra.get(name, (where.get(name, "train_args"), None))[0], given[name])
    own_keys = algorithm_fields()
    chosen = values["federated_optimizer"]
    chosen_keys = set(algorithm_settings(chosen)) if chosen in algorithm_names() else set()
    _name_other_algorithms_keys(given, own_keys, chosen_keys, chosen)
    config = Config(
        **{k: v for k, v in values.items() if k not in own_keys},
        source=source,
        extra=extra,
        safeguards=safeguards,
        # The chosen algorithm's own keys alone (another's, given, were checked and named above).
        algorithm_values={k: v for k, v in values.items() if k in chosen_keys},
    )
    for rule in RULES:
        rule(config)
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
