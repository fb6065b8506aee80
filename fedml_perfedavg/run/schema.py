"""The run's configuration schema: FedML's sectioned YAML as one typed, frozen dataclass.

:class:`Config` is the one source of every key's section, type, default, allowed values and help
text, declared section by section as FedML's YAML is (:class:`CommonArgs` to :class:`TrackingArgs`,
and each algorithm's own ``Settings``; docs/configuration.md's table is generated from them by
:mod:`.reference`), with the index of every setting by key (:data:`BY_NAME`). The rules that relate
keys are :mod:`.rules`; reading a YAML and ``--set`` pairs into a config is :mod:`.config`; FedML's
own keys and what they mean here, :mod:`.fedml_keys`. This module imports no FedML.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from ..algorithms.base import AGGREGATIONS, DIVERGENCE_POLICIES
from ..algorithms.registry import (
    BUILTIN_ALGORITHMS,
    algorithm_names,
    algorithm_settings,
    settings_clash,
)
from ..core.privacy import DPSGD
from ..core.settings import AT_LEAST_ONE as _at_least_one
from ..core.settings import EVEN as _even
from ..core.settings import NON_NEGATIVE as _non_negative
from ..core.settings import POSITIVE as _positive
from ..core.settings import in_section
from ..core.settings import setting as _setting
from ..fedml_bridge import safeguard_keys as fedml_safeguards

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
    plugin_fixes: bool = _setting(
        bool,
        False,
        "FedML's own algorithms in this process (FedAvg and the rest) get the plugin's fixes: its secure gRPC "
        "transport (FedML's pickling transports refused for cross-silo), MPI's one-round fix and waiting "
        "receive loop, fedml.init and FedML's loaders offline, a trainer/aggregator pair handed to FedMLRunner "
        "really used on sp and MPI. Without it they run as FedML has them; a plugin run has these always",
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
        str,
        "paper",
        "user split: paper, paper_diff_hetero (the paper's), paper_resampled (the paper's class counts, each "
        "user's images drawn on its own: any number of users), or one of FedML's (e.g. hetero)",
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
        "batched engine: torch.compile the local update (a Linear chain's hand-batched step, "
        "compiled once for every step: HF rounds ~0.84 of the eager path's on a 2-core CPU, after "
        "6 s of compiling, 35 s with an empty compiler cache; any other model's vmapped update whole, "
        "about a minute; CUDA graphs on GPU). "
        "Fused kernels round differently: results within float rounding of the eager path's, not its bits",
    )
    capture_rounds: bool = _setting(
        bool,
        False,
        "batched engine on a Linear chain: each round's local training (the minibatches' gathers "
        "and every client's update) replayed as one CUDA graph, the eager path's kernels and bits; "
        "the sampling, divergence guard, update screen and average run after it as eagerly. "
        "Off CUDA the same steps run uncaptured",
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
        "this many times the median of the last 5 measured rounds (at least 5 s, at most "
        "round_timeout), so a dead silo costs seconds; 0: always round_timeout",
        rule=(lambda v: v == 0 or v >= 1, "0 or >= 1"),
    )
    min_clients_per_round: Optional[int] = _setting(
        int,
        None,
        "cross-silo: after round_timeout, go "
        "on without the silos that did not answer if at least this "
        "many did; else stop naming them (default: all). In a secure run: go on while at least this many "
        "silos are left in the run (a short round fails, the model kept; default: what a round needs, "
        "its threshold and min_summed_silos)",
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
    roster_path: Optional[str] = _setting(
        str,
        None,
        "cross-silo: the run's key roster (every rank's public key; fedml-perfedavg certs roster), which this "
        "rank pins: a peer whose certificate the CA signed for another key is refused; null: tls_dir's "
        "roster.json where there is one. Secure aggregation needs one",
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
    account_dir: Optional[str] = _setting(
        str,
        None,
        "cross-silo, a data owner's silo with DP-SGD: its organization's accounts, one folder per data set "
        "(every run's uses of the data and its noise key: the budget spans runs); null: "
        "$FEDML_PERFEDAVG_ACCOUNTS, else ~/.fedml_perfedavg/accounts",
        optional=True,
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
    reserve_silos: int = _setting(
        int,
        1,
        "secure aggregation: how many organizations after a round's keyed sample, in the round's keyed "
        "order, may take the places of organizations the server has lost; a silo trains in a round only "
        "if it is among the sample and these. 0: a lost organization's rounds run short (and fail when "
        "too short to be summed)",
        rule=(lambda v: v >= 0, ">= 0"),
    )
    accept_rounds_without_spare: bool = _setting(
        bool,
        False,
        "secure aggregation: accept a configuration in which one lost organization fails every later "
        "round that samples it (no organization can take its place, and a round short of one cannot be "
        "summed); refused at start otherwise, naming the numbers",
    )


@dataclass(frozen=True)
@in_section("tracking_args")
class TrackingArgs:
    """``tracking_args``: wandb and the progress bar."""

    enable_wandb: bool = _setting(bool, False, "log to wandb (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = _setting(str, "fedml-perfedavg", "wandb project")
    wandb_group: Optional[str] = _setting(str, None, "wandb group (default: run name)", optional=True)
    wandb_name: Optional[str] = _setting(
        str, None, "wandb run name, FedML's key (default: the run directory's name)", optional=True
    )
    show_progress: bool = _setting(bool, True, "tqdm progress bar over rounds (on a terminal)")


#: Each YAML section's class and the attribute a :class:`Config` holds it under, in the YAML's order
#: (and docs/configuration.md's table's).
SECTION_CLASSES: Dict[str, Tuple[str, type]] = {
    "common_args": ("common", CommonArgs),
    "data_args": ("data", DataArgs),
    "model_args": ("model", ModelArgs),
    "train_args": ("train", TrainArgs),
    "validation_args": ("validation", ValidationArgs),
    "device_args": ("device", DeviceArgs),
    "comm_args": ("comm", CommArgs),
    "secagg_args": ("secagg", SecAggArgs),
    "tracking_args": ("tracking", TrackingArgs),
}
SECTIONS = tuple(SECTION_CLASSES)  # FedML's YAML sections, in order
#: Each section key's :class:`Config` attribute: ``alpha`` -> ``train`` (``config.train.alpha``).
SECTION_OF_KEY: Dict[str, str] = {
    f.name: attribute for attribute, cls in SECTION_CLASSES.values() for f in dataclasses.fields(cls)
}


@dataclass(frozen=True)
class Config:
    """A validated run configuration, section by section as FedML's YAML is
    (``config.train.alpha``, ``config.comm.backend``); the chosen algorithm's own keys by
    :meth:`setting`; FedML's DP, attack and defense sections as given (:attr:`safeguards`, and
    DP-SGD typed: :attr:`privacy`). FedML's flat ``args`` are made from it and read back by
    :mod:`.fedml_args`."""

    common: CommonArgs = field(default_factory=CommonArgs)
    data: DataArgs = field(default_factory=DataArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    validation: ValidationArgs = field(default_factory=ValidationArgs)
    device: DeviceArgs = field(default_factory=DeviceArgs)
    comm: CommArgs = field(default_factory=CommArgs)
    secagg: SecAggArgs = field(default_factory=SecAggArgs)
    tracking: TrackingArgs = field(default_factory=TrackingArgs)
    # Not settings: where the config came from, and FedML keys that ride along unchecked.
    source: Optional[str] = field(default=None, compare=False)
    extra: Dict[str, Tuple[str, Any]] = field(default_factory=dict, compare=False)
    # dp_args, attack_args, defense_args as given: FedML's keys for its own DP/attack/defense classes.
    safeguards: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # The chosen algorithm's own settings (its ``Settings``), by key: read with :meth:`setting`.
    algorithm_values: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_values(cls, values: Mapping[str, Any], **rest: Any) -> "Config":
        """A config of every section key's value in ``values`` (by key), and ``rest``'s fields."""
        sections = {
            attribute: section(**{f.name: values[f.name] for f in dataclasses.fields(section)})
            for attribute, section in SECTION_CLASSES.values()
        }
        return cls(**sections, **rest)

    def setting(self, name: str) -> Any:
        """The value of the setting ``name``: a section's key, or one of the chosen algorithm's own
        (``setting("perfedavg_variant")``); KeyError for a name that is neither."""
        if name in self.algorithm_values:
            return self.algorithm_values[name]
        if name in SECTION_OF_KEY:
            return getattr(getattr(self, SECTION_OF_KEY[name]), name)
        raise KeyError(
            f"{name!r}: not a setting of this config "
            f"(train_args.federated_optimizer={self.train.federated_optimizer!r})"
        )

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
        return self.common.training_type == "cross_silo" and self.comm.silo_data == "own"

    @property
    def silo_count(self) -> int:
        """Cross-silo: the number of silo processes (ranks 1..this): one per user in data-owner
        mode, one per client of a round in shared mode."""
        return self.train.client_num_in_total if self.own_data else self.train.client_num_per_round

    @property
    def batch_sizes(self) -> Tuple[int, int, int]:
        """(|D|, |D'|, |D''|), the two last defaulting to |D|."""
        train = self.train
        return (
            train.batch_size,
            train.meta_batch_size or train.batch_size,
            train.hessian_batch_size or train.batch_size,
        )

    @property
    def values(self) -> Dict[str, Any]:
        return {f.name: self.setting(f.name) for f in self.own_settings()}

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
            value = self.setting(f.name)  # a Step is recorded as its name, as YAML and FedML spell it
            out[f.metadata["section"]][f.name] = value.value if isinstance(value, Enum) else copy.deepcopy(value)
        for name, (section, value) in self.extra.items():
            out.setdefault(section, {})[name] = value
        return out


def settings(builtin_only: bool = False) -> List[dataclasses.Field]:
    """Every setting, in table order: :class:`Config`'s fields, and after ``train_args``' own the
    algorithms' (each algorithm's ``Settings``: the built-ins', and unless ``builtin_only`` those
    registered so far)."""
    own = [f for _, section in SECTION_CLASSES.values() for f in dataclasses.fields(section)]
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
