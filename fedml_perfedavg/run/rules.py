"""The rules that relate a config's keys, each run on every config :func:`~.config.resolve` makes,
in the order of :data:`RULES`. Each names ``section.key=value`` and what is allowed. Checks that
need a domain's knowledge ask the module that owns it (the paper split's plan:
:func:`~fedml_perfedavg.data.loading.check_paper_split`; TLS: ``check_security``; whether DP-SGD
can reach an algorithm: the algorithm's own answer; FedML's DP, attack and defense sections:
FedML's own classes, rehearsed by :mod:`fedml_perfedavg.fedml_bridge.safeguards`, which imports
FedML only when a config has those sections)."""

from __future__ import annotations

from typing import Any, Callable, Tuple

from ..algorithms.base import FederatedAlgorithm, dp_refusal
from ..algorithms.registry import (
    FEDML_OWN,
    algorithm_class,
    algorithm_names,
)
from ..core.errors import ConfigError
from ..core.settings import suggest
from ..data.loading import check_paper_split
from ..data.partition import PARTITIONS
from ..fedml_bridge import safeguards
from ..net.credentials import check_security
from .schema import BACKENDS, Config


def _rule_algorithm(c: Config) -> None:
    names = algorithm_names()
    if c.train.federated_optimizer in names:
        return
    if c.train.federated_optimizer in FEDML_OWN:
        raise ConfigError(
            f"train_args.federated_optimizer={c.train.federated_optimizer!r}: that is FedML's own algorithm "
            f"(run it with FedML's own main script); the plugin runs {names} (the paper's FedAvg "
            f"baseline is FedAvgUpdate)"
        )
    raise ConfigError(
        f"train_args.federated_optimizer={c.train.federated_optimizer!r}: must be one of "
        f"{names}{suggest(c.train.federated_optimizer, names)}"
    )


def _rule_clients(c: Config) -> None:
    if c.train.client_num_per_round > c.train.client_num_in_total:
        raise ConfigError(
            f"train_args.client_num_per_round={c.train.client_num_per_round!r}: must be <= "
            f"train_args.client_num_in_total ({c.train.client_num_in_total})"
        )
    trained = c.train.client_num_in_total - int(round(c.train.new_user_fraction * c.train.client_num_in_total))
    if c.train.client_num_per_round > trained:
        raise ConfigError(
            f"train_args.new_user_fraction={c.train.new_user_fraction!r}: leaves {trained} training users, "
            f"fewer than train_args.client_num_per_round ({c.train.client_num_per_round})"
        )


def _rule_platform(c: Config) -> None:
    if c.comm.backend not in BACKENDS[c.common.training_type]:
        raise ConfigError(
            f"comm_args.backend={c.comm.backend!r}: with common_args.training_type={c.common.training_type!r} "
            f"it must be one of {list(BACKENDS[c.common.training_type])}"
        )
    if c.device.compile_local_update and (
        c.common.training_type != "simulation" or c.comm.backend != "sp" or c.train.simulation_engine != "batched"
    ):
        raise ConfigError(
            "device_args.compile_local_update=True: only the batched engine compiles (comm_args."
            "backend sp, train_args.simulation_engine batched)"
        )
    if c.device.capture_rounds and (
        c.common.training_type != "simulation" or c.comm.backend != "sp" or c.train.simulation_engine != "batched"
    ):
        raise ConfigError(
            "device_args.capture_rounds=True: only the batched engine captures its rounds (comm_args."
            "backend sp, train_args.simulation_engine batched)"
        )
    if c.device.capture_rounds and c.device.compile_local_update:
        raise ConfigError(
            "device_args.capture_rounds=True: not with device_args.compile_local_update=True (a compiled "
            "step replays CUDA graphs of its own); choose one"
        )
    if c.validation.stationarity_every % c.validation.frequency_of_the_test:
        raise ConfigError(
            f"validation_args.stationarity_every={c.validation.stationarity_every!r}: must be a multiple of "
            f"validation_args.frequency_of_the_test ({c.validation.frequency_of_the_test}), so it falls on "
            f"evaluations (or 0: never)"
        )
    if c.validation.random_iterate and c.common.training_type != "simulation":
        raise ConfigError(
            "validation_args.random_iterate=True: only in simulation (common_args.training_type "
            "simulation), where the server holds every user's data to recompute the iterates"
        )
    if c.common.training_type == "cross_silo":
        check_security(c.comm.tls_dir, c.comm.insecure)
    check_scenario(c.common.training_type, c.extra.get("scenario", (None, None))[1])
    if c.comm.silo_data == "own" and c.common.training_type != "cross_silo":
        raise ConfigError(
            "comm_args.silo_data='own': only across silos (common_args.training_type cross_silo); "
            "a simulation holds every user's data"
        )
    if c.own_data and c.validation.stationarity_every:
        raise ConfigError(
            f"validation_args.stationarity_every={c.validation.stationarity_every!r}: needs every user's data in "
            f"one process; with comm_args.silo_data='own' the server holds none (set it to 0)"
        )
    if c.comm.min_clients_per_round is not None and c.comm.min_clients_per_round > c.train.client_num_per_round:
        raise ConfigError(
            f"comm_args.min_clients_per_round={c.comm.min_clients_per_round!r}: must be <= "
            f"train_args.client_num_per_round ({c.train.client_num_per_round})"
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
    if c.data.partition_method not in PARTITIONS:
        return  # FedML's own loaders: checked against the data once it is loaded
    smallest, a = check_paper_split(
        c.data.dataset,
        c.train.client_num_in_total,
        c.data.images_per_class,
        c.data.test_images_per_class,
        c.data.partition_method,
        c.common.random_seed,
    )
    check_batch_sizes(
        c,
        smallest,
        f"the smallest user's training data under data_args.images_per_class={a} "
        f"(data_args.partition_method={c.data.partition_method!r})",
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
    if not c.secagg.enable_secagg:
        if c.secagg.reconstruction_threshold is not None:
            raise ConfigError(
                f"secagg_args.reconstruction_threshold={c.secagg.reconstruction_threshold!r}: only with "
                f"secagg_args.enable_secagg true"
            )
        return
    need = "secagg_args.enable_secagg=True"
    if not c.own_data:
        raise ConfigError(
            f"{need}: only across data-owner silos (common_args.training_type cross_silo, comm_args.silo_data "
            f"own); here training_type={c.common.training_type!r}, silo_data={c.comm.silo_data!r}"
        )
    if not c.comm.tls_dir:
        raise ConfigError(
            f"{need}: needs comm_args.tls_dir (each silo's keys are bound to its certificate); "
            f"comm_args.insecure cannot carry it"
        )
    if c.train.max_update_ratio is None and c.train.max_update_norm is None:
        raise ConfigError(
            f"{need}: needs train_args.max_update_ratio or train_args.max_update_norm (each silo clips its "
            f"update to that bound, which makes the sum fit 32-bit fixed point); both are null"
        )
    if algorithm_class(c.train.federated_optimizer).returns_whole_state:
        raise ConfigError(
            f"{need}: train_args.federated_optimizer={c.train.federated_optimizer!r} sends back more than its "
            f"parameters (per-client statistics the server reads one by one); use PerFedAvg or FedAvgUpdate"
        )
    algorithm = algorithm_class(c.train.federated_optimizer)
    if algorithm.combine is not FederatedAlgorithm.combine:
        raise ConfigError(
            f"{need}: train_args.federated_optimizer={c.train.federated_optimizer!r} overrides combine "
            f"({algorithm.__module__}.{algorithm.__qualname__}.combine), its own aggregation of the clients' "
            f"updates; under secure aggregation the server holds only their weighted sum, so it could apply "
            f"the plain weighted mean alone. Use an algorithm that aggregates by the mean, or secure "
            f"aggregation off"
        )
    _rule_secagg_counts(c)


def _rule_secagg_counts(c: Config) -> None:
    """The numbers each silo enforces of a secure round (secagg/rounds.py ``SiloRules``), refused
    at start rather than by every silo in every round."""
    k, colluding, fewest = c.train.client_num_per_round, c.secagg.max_colluding_silos, c.secagg.min_summed_silos
    if k < fewest:
        raise ConfigError(
            f"train_args.client_num_per_round={k!r}: with secagg_args.enable_secagg each round sums at least "
            f"secagg_args.min_summed_silos={fewest} silos (with 2, each would learn the other's update from the "
            f"new model; with 1, the sum is that silo's update). Allowed: client_num_per_round >= {fewest}"
        )
    threshold = c.secagg.reconstruction_threshold
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
    _rule_secagg_spare(c, threshold if threshold is not None else (k + colluding) // 2 + 1)


def _rule_secagg_spare(c: Config, threshold: int) -> None:
    """A secure round short of what it needs is not summed (the model is kept): refused at start, unless
    accepted, is a configuration where one lost organization fails every later round that samples it,
    because the round cannot spare it and no organization can take its place (issue 76)."""
    k, n, reserves = c.train.client_num_per_round, c.train.client_num_in_total, c.secagg.reserve_silos
    need = max(threshold, c.secagg.min_summed_silos, c.comm.min_clients_per_round or 0)
    if k - 1 >= need or (reserves >= 1 and n - 1 >= k) or c.secagg.accept_rounds_without_spare:
        return
    why = (
        f"no organization can take its place (client_num_in_total={n}, client_num_per_round={k})"
        if reserves >= 1
        else "secagg_args.reserve_silos=0 lets no organization take its place"
    )
    raise ConfigError(
        f"secagg_args: one lost organization would fail every later round that samples it: a round of {k} "
        f"silos short of one has {k - 1}, fewer than the {need} it needs (max of the threshold {threshold}, "
        f"secagg_args.min_summed_silos={c.secagg.min_summed_silos}"
        + (f", comm_args.min_clients_per_round={c.comm.min_clients_per_round}" if c.comm.min_clients_per_round else "")
        + f"), and {why}. Allowed: more organizations than a round samples (client_num_in_total > "
        f"client_num_per_round, with secagg_args.reserve_silos >= 1), a round that can spare one "
        f"(client_num_per_round >= {need + 1}), or secagg_args.accept_rounds_without_spare: true"
    )


def _rule_client_state(c: Config) -> None:
    """A client's own state stays with whoever holds the client: across silos, only a data
    owner's silo always holds the same client (algorithms/client_states.py)."""
    if (
        algorithm_class(c.train.federated_optimizer).keeps_client_state
        and c.common.training_type == "cross_silo"
        and not c.own_data
    ):
        raise ConfigError(
            f"comm_args.silo_data={c.comm.silo_data!r}: "
            f"train_args.federated_optimizer={c.train.federated_optimizer!r} keeps "
            f"a state of each client's own, which stays with the silo that holds the client; across silos that "
            f"is data-owner mode (comm_args.silo_data: own), where each silo holds one user for the whole run"
        )


def _rule_privacy(c: Config) -> None:
    """What DP-SGD allows of the run and of its algorithm: asked of the policy (core/privacy.py's
    :class:`~fedml_perfedavg.core.privacy.DPSGD`), the algorithm's answer its own."""
    privacy = c.privacy
    if privacy is None:
        return
    privacy.check_run(
        stationarity_every=c.validation.stationarity_every,
        random_iterate=c.validation.random_iterate,
        cross_silo=c.common.training_type == "cross_silo",
        own_data=c.own_data,
    )
    privacy.check_algorithm(c.train.federated_optimizer, dp_refusal(algorithm_class(c.train.federated_optimizer)))


def _rule_safeguards(c: Config) -> None:
    """FedML's DP, attack and defense sections as FedML would read them, rehearsed; refused beside
    secure aggregation where they need to see one silo's update."""
    if c.secagg.enable_secagg:
        safeguards.check_secure_aggregation(c.safeguards)
    safeguards.check(c.safeguards, safeguards.run_facts(c))


RULES: Tuple[Callable[[Config], None], ...] = (
    _rule_algorithm,
    _rule_clients,
    _rule_platform,
    _rule_split,
    _rule_privacy,
    _rule_client_state,
    _rule_secagg,  # before FedML's own checks of its sections: what cannot work at all is said first
    _rule_safeguards,
)


def check_rules(config: Config) -> None:
    """Every rule on ``config``, in order: :class:`ConfigError` from the first it breaks."""
    for rule in RULES:
        rule(config)
