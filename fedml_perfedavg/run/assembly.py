"""What a run is made of, in one process: its log file, device, users, algorithm and FedML
pair, FedML's safeguards on the algorithm's round hooks, the server's record, and the backend
adapter that runs the rounds (the batched engine, FedML's sp loop, its MPI simulation, a
cross-silo process). :func:`assemble` builds them once, checking on the way that they fit
(the data against the config, the model against the data)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import logs
from ..algorithms.base import FederatedAlgorithm
from ..algorithms.model_probe import ModelMismatch
from ..algorithms.registry import create_algorithm
from ..core.errors import ConfigError
from ..core.guards import update_bound
from ..core.ledger import PrivacyLedger
from ..core.types import StateDict, UserSplit
from ..fedml_bridge import safeguards as fedml_safeguards
from . import checkpoint
from .schema import Config
from .driver import RunDriver
from .measures import Measurements
from .reporting import RunRecorder, recorder_for
from .data_modes import SiloRun, data_mode
from .silo_account import RunAccount
from .schedule import RoundSchedule
from .silo_roles import check_silo_role

logger = logging.getLogger(__name__)


@dataclass
class RunParts:
    """One process's part of a run, as :func:`assemble` built it."""

    args: Any  # FedML's
    config: Config
    run_dir: str
    rank: int  # 0: the server (sp, MPI rank 0, the cross-silo server)
    device: Any
    dataset: list  # FedML's (a data owner's silo: keyed by its own user alone)
    model: torch.nn.Module
    users: List[UserSplit]  # the users this process holds
    algorithm: FederatedAlgorithm
    trainer: Any  # FedML's ClientTrainer / ServerAggregator pair
    aggregator: Any
    global_state: StateDict
    log_handler: Optional[logging.Handler]
    recorder: Optional[RunRecorder] = None  # the server's
    data_problem: Optional[str] = None  # a data owner's silo whose model cannot train on its data
    silo_privacy: Optional[PrivacyLedger] = None  # a data owner's silo: DP-SGD's accountant of its user
    silo_account: Optional[RunAccount] = None  # ... and this run's entry in its organization's account
    silo_run_secret: Optional[bytes] = None  # ... and the secret of its draws in this run (with DP-SGD or secagg)
    silo_progress: Optional[Any] = None  # a data owner's silo: its progress.pt (run/silo_record.py)

    @property
    def is_server(self) -> bool:
        return self.rank == 0


def check_layout(config: Config, args: Any) -> None:
    """The processes FedML started fit the config (before any rank opens a file in a run
    directory a failed start removes)."""
    if config.comm.backend == "MPI" and args.worker_num < 2:
        raise ConfigError(
            f"comm_args.backend='MPI' with {args.worker_num} process: an MPI run needs a server rank "
            f"and at least one worker; start it under mpirun -n 2 to "
            f"{config.train.client_num_per_round + 1} (or set comm_args.backend: sp to run in one "
            f"process)"
        )
    if config.comm.backend == "MPI" and args.worker_num - 1 > config.train.client_num_per_round:
        raise ConfigError(
            f"train_args.client_num_per_round={config.train.client_num_per_round!r}: under MPI each of the "
            f"ranks but the server trains a share of a round's clients, so it must be at least the "
            f"number of ranks - 1 (this is mpirun -n {args.worker_num}: at least "
            f"{max(1, args.worker_num - 1)}; or run mpirun -n 2 to "
            f"{config.train.client_num_per_round + 1})"
        )
    check_one_process(config)
    check_extras(config)
    check_device(config)
    if config.common.training_type == "cross_silo":
        check_silo_role(config, int(args.rank), str(args.role))


#: The modules each of the plugin's extras (setup.py) brings, by what a config asks for.
EXTRA_MODULES = {
    "silo": ("grpc", "cryptography", "safetensors", "Crypto"),
    "mpi": ("mpi4py",),
    "dp": ("opacus",),
}


def check_extras(config: Config) -> None:
    """:class:`ConfigError` naming the extra to install where the config needs one whose modules
    are missing (a plain ``pip install .`` brings none), before the run fails deep inside with a
    ModuleNotFoundError."""
    import importlib.util

    needs = []
    if config.common.training_type == "cross_silo":
        needs.append(("silo", f"common_args.training_type={config.common.training_type!r}"))
    if config.comm.backend == "MPI":
        needs.append(("mpi", f"comm_args.backend={config.comm.backend!r}"))
    if config.privacy is not None:
        needs.append(("dp", "dp_args.dp_solution_type='dpsgd'"))
    for extra, because in needs:
        missing = [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"{because} needs the plugin's {extra!r} extra, and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed here: pip install -c constraints.txt "
                f"'fedml-perfedavg[{extra}]' (from a checkout: pip install -c constraints.txt '.[{extra}]'; "
                f"make setup installs every extra)"
            )


def check_device(config: Config) -> None:
    """:class:`ConfigError` for ``device_args.using_gpu`` where torch has no CUDA device: FedML
    would train on the CPU and say only "ML engine install was not built with GPU enabled"."""
    if not config.device.using_gpu or torch.cuda.is_available():
        return
    why = (
        f"this torch ({torch.__version__}) is a CPU build"
        if torch.version.cuda is None
        else f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) sees no CUDA device"
    )
    raise ConfigError(
        f"device_args.using_gpu=True: {why}, so the run would train on the CPU. Set using_gpu: false, or "
        f"install a CUDA build of torch 2.13.0 (docs/fedml.md, 'On a CUDA machine')"
    )


# What MPICH's Hydra (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE) and PMIx launchers (PMIX_SIZE) tell
# each process they start: read without importing mpi4py, which a single-process run never needs.
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def check_bound_holds_local_noise(config: Config, safeguards: Any, model: nn.Module) -> None:
    """:class:`ConfigError` naming both keys when FedML's local DP adds more noise to an update
    than the fixed update bound lets through: every update would be rejected, and the run stop
    for rounds with no acceptable update (issue 45)."""
    parameters = dict(model.named_parameters())
    noise = fedml_safeguards.local_noise_norm(safeguards, sum(p.numel() for p in parameters.values()))
    if noise is None:
        return
    bounds = []
    if config.train.max_update_ratio is not None:
        state = {k: v.detach() for k, v in parameters.items()}
        limit = update_bound(state, config.train.max_update_ratio, list(parameters))
        bounds.append(
            (f"train_args.max_update_ratio={config.train.max_update_ratio:g} x max(||w||, 1) = {limit:.3g}", limit)
        )
    if config.train.max_update_norm is not None:
        bounds.append((f"train_args.max_update_norm={config.train.max_update_norm:g}", config.train.max_update_norm))
    over = [words for words, limit in bounds if noise > limit]
    if over:
        dp = config.safeguards["dp_args"]
        raise ConfigError(
            f"dp_args (local DP, {dp.get('mechanism_type')}, epsilon {dp.get('epsilon')}, sensitivity "
            f"{dp.get('sensitivity')}) adds noise of norm about {noise:.3g} to every client update, over "
            f"{' and '.join(over)}: every update would be rejected. Set train_args.max_update_ratio: null (and "
            f"max_update_norm: null) to leave noisy updates unbounded, or raise dp_args.epsilon / lower "
            f"dp_args.sensitivity"
        )


def check_one_process(config: Config) -> None:
    """:class:`ConfigError` for a single-process simulation started as one of several processes by
    mpirun: each would run the whole job into one run directory (issue 45)."""
    ranks = mpi_job_size()
    if config.common.training_type == "simulation" and config.comm.backend != "MPI" and ranks > 1:
        raise ConfigError(
            f"comm_args.backend={config.comm.backend!r}, but this process is one of {ranks} that mpirun started: "
            f"each would run the whole single-process job into one run directory; set comm_args.backend: MPI "
            f"(as the *_mpi.yaml configs do), or start it without mpirun"
        )


def mpi_job_size() -> int:
    """How many processes the MPI launcher that started this one started (1 without one)."""
    for name in MPI_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def assemble(
    args: Any,
    config: Config,
    run_dir: str,
    rank: int,
    device: Any,
    dataset: list,
    model: torch.nn.Module,
    trainer: Any = None,
    aggregator: Any = None,
    grid: bool = False,
) -> RunParts:
    """This process's part of the run; ``trainer``/``aggregator``: the pair a user handed
    ``FedMLRunner`` (else the algorithm's own); ``grid``: one of several runs in the process."""
    from ..fedml_bridge.trainer_aggregator import AlgorithmClientTrainer, AlgorithmServerAggregator, create_fedml_pair

    is_server = rank == 0
    log_handler = logs.add_run_file(os.path.join(run_dir, "run.log" if is_server else f"run-rank{rank}.log"))
    if config.comm.backend == "MPI":
        from ..fedml_bridge.mpi import rank_device

        device = rank_device(args, device)
    mode = data_mode(config)
    users, dataset = mode.users_of(config, dataset, rank, device)
    mode.check_data(config, users, rank)
    if (trainer, aggregator) != (None, None):
        if not (
            isinstance(trainer, AlgorithmClientTrainer)
            and isinstance(aggregator, AlgorithmServerAggregator)
            and trainer.algorithm is aggregator.algorithm
        ):
            raise ConfigError(
                f"train_args.federated_optimizer={config.train.federated_optimizer!r} builds its own "
                f"trainer and aggregator; FedMLRunner was handed {type(trainer).__name__} / "
                f"{type(aggregator).__name__}. Hand your own pair with federated_optimizer FedAvg, "
                f"or the pair from fedml_perfedavg.create_fedml_pair"
            )
        algorithm = trainer.algorithm
    else:
        algorithm = create_algorithm(config.train.federated_optimizer, model, config)
        trainer, aggregator = create_fedml_pair(algorithm, model, args)
    safeguards = fedml_safeguards.for_config(config)
    if safeguards is not None:
        algorithm.use_hooks(safeguards)
        logger.info("FedML's %s: applied by %s's round hooks", safeguards.describe(), algorithm.label)
        check_bound_holds_local_noise(config, safeguards, model)
    # The global state lives where the users' data does (FedML's aggregator hands a CPU copy): the
    # probe, the batched engine and the evaluation compute on the run's device.
    global_state = {k: v.to(device) for k, v in aggregator.get_model_params().items()}
    parts = RunParts(
        args, config, run_dir, rank, device, dataset, model, users, algorithm, trainer, aggregator,
        global_state, log_handler,
    )  # fmt: skip
    if users:  # the server of a data-owner run trains nothing and holds no sample to probe with
        parts.data_problem = probe(parts)
    own = mode.silo_privacy(config, algorithm, rank, users, SiloRun(run_dir, lambda: _silo_identity(parts)))
    parts.silo_privacy, over_budget, parts.silo_account = own.ledger, own.problem, own.account
    parts.silo_run_secret = own.run_secret
    if over_budget is not None and parts.data_problem is None:
        logger.error("silo rank %d: %s; announcing it to the server", rank, over_budget)
        parts.data_problem = over_budget
    if is_server:
        checkpoint.save_config(run_dir, config.sections())
        # the ledger first: its accountants' import (2 s of Opacus and SciPy) is not training time,
        # which the recorder's clock starts counting
        privacy = None if config.privacy is None else mode.server_privacy(config, algorithm, users)
        parts.recorder = recorder_for(config, run_dir, deferred_wandb=grid)
        parts.recorder.process["device"] = str(device)  # the one used, whatever the config asked
        parts.recorder.privacy = privacy
    return parts


def probe(parts: RunParts) -> Optional[str]:
    """What the model allows, probed on a batch like the run's (see ``probe_model``). A model
    that cannot train on the data at all stops the run here, with its own reason; a data owner's
    silo returns the reason instead, to announce it."""
    config, sample, size = parts.config, parts.users[0], parts.config.train.batch_size
    try:
        notes = parts.algorithm.probe_model(parts.global_state, sample.train_x[:size], sample.train_y[:size])
    except ModelMismatch as err:
        built = type(parts.model).__module__.split(".")[0] in ("fedml", "fedml_perfedavg")
        origin = f"model_args.model={config.model.model!r}" if built else "your own module, not model_args.model"
        name = type(parts.model).__name__
        problem = f"the model ({name}; {origin}) does not fit data_args.dataset={config.data.dataset!r}: {err}"
        if not data_mode(config).announces_problems(parts.is_server):
            raise ConfigError(problem) from None
        # A data owner's silo announces it: the server refuses it at once, naming it, and the run
        # goes on without it (or stops) by the same rule as for any silo it refuses.
        logger.error("silo rank %d: %s; announcing it to the server", parts.rank, problem)
        return problem
    for note in notes:
        logger.warning("%s: %s", type(parts.model).__name__, note)
    return None


def resumable(config: Config) -> bool:
    """Whether runs of ``config`` checkpoint and resume: the batched engine and the cross-silo
    server (FedML's sp and MPI loops always start at round 0)."""
    if config.common.training_type == "cross_silo":
        return True
    return (
        config.common.training_type == "simulation"
        and config.comm.backend == "sp"
        and config.train.simulation_engine == "batched"
    )


def resume_problem(config: Config, is_server: bool) -> Optional[str]:
    """Why a process of ``config`` cannot ``--resume`` (checked before anything is written), or None."""
    if not resumable(config):
        return (
            f"train_args.simulation_engine={config.train.simulation_engine!r}, "
            f"comm_args.backend={config.comm.backend!r}: "
            f"resuming needs the batched engine on sp or a cross-silo server (FedML's sp and MPI loops always "
            f"start at round 0)"
        )
    if config.common.training_type == "cross_silo" and not is_server:
        return (
            "--resume is the cross-silo server's (--role server): a silo that stopped is started again as it was, "
            "without --resume, and announces itself to the server"
        )
    return None


def driver_for(parts: RunParts) -> RunDriver:
    """The run's round driver, with the server's measurements and checkpoints."""
    config = parts.config
    measurements = (
        None
        if parts.recorder is None or not data_mode(config).server_measures
        else Measurements(
            parts.algorithm, parts.users, config, parts.recorder.new_users, parts.recorder.headline, parts.device
        )
    )
    checkpoints = checkpoint.Checkpoints(parts.run_dir) if parts.is_server and resumable(config) else None
    return RunDriver(
        parts.algorithm,
        parts.run_dir,
        RoundSchedule.from_config(config),
        parts.global_state,
        parts.recorder,
        measurements,
        checkpoints,
    )


def backend_for(parts: RunParts, driver: RunDriver) -> Tuple[Any, str]:
    """The adapter that runs the rounds, and how logs name it."""
    config, args = parts.config, parts.args
    if config.common.training_type == "cross_silo":
        from ..silo.server.policy import SiloPolicy
        from ..fedml_bridge.cross_silo.process import CrossSiloProcess

        where = f"cross-silo rank {parts.rank} ({args.role}{data_mode(config).label})"
        policy = SiloPolicy(
            config.comm.connect_timeout,
            config.comm.round_timeout,
            config.comm.min_clients_per_round or _fewest_silos(config),
            config.comm.round_timeout_factor,
        )
        process = CrossSiloProcess(
            args,
            parts.device,
            parts.dataset,
            parts.model,
            parts.trainer,
            parts.aggregator,
            policy,
            driver,
            silo_setup(parts),
        )
        return process, where
    if config.comm.backend == "MPI":
        from ..engine.batched import BatchedSimulation
        from ..fedml_bridge.mpi import MPISimulation

        workers = args.worker_num - 1
        where = f"FedML's MPI simulation, {workers} worker ranks" + (
            f", each training a share of the round's {config.train.client_num_per_round} clients as one computation"
            if config.train.client_num_per_round > workers
            else ", one client each"
        )
        share_trainer = None
        if not parts.is_server and config.train.client_num_per_round > workers:  # a worker's share: the batched engine
            on_device = {k: v.to(parts.device) for k, v in parts.global_state.items()}
            share_trainer = BatchedSimulation(
                parts.algorithm, parts.users, on_device, driver, config.device.compile_local_update
            ).train_clients
        own_states = parts.algorithm.client_states if parts.algorithm.holds_client_states else None
        simulation = MPISimulation(
            args,
            parts.device,
            parts.dataset,
            parts.model,
            parts.trainer,
            parts.aggregator,
            driver,
            share_trainer,
            own_states,
            parts.algorithm.training if parts.algorithm.reports_training else None,
        )
        return simulation, where
    if config.train.simulation_engine == "fedml":
        from ..fedml_bridge.sp import SPSimulation

        loop = SPSimulation(args, parts.device, parts.dataset, parts.model, parts.trainer, parts.aggregator, driver)
        return loop, "FedML's sp loop"
    from ..engine.batched import BatchedSimulation

    engine = BatchedSimulation(
        parts.algorithm,
        parts.users,
        parts.global_state,
        driver,
        config.device.compile_local_update,
        capture_rounds=config.device.capture_rounds,
    )
    return engine, "the batched engine" + ("" if engine.captured is None else " (device_args.capture_rounds)")


def silo_setup(parts: RunParts) -> Any:
    """What this cross-silo process knows beyond FedML's args: the server's
    :class:`~fedml_perfedavg.silo.server.agreement.ServerSetup`, or a silo's
    :class:`~fedml_perfedavg.silo.server.agreement.SiloSetup`."""
    from ..net.addresses import read_ipconfig
    from ..silo.server.agreement import ADDRESSES, ROSTER_DIGEST, ServerSetup, SiloSetup
    from ..silo.server.agreement import address_table, addresses_seen
    from ..silo.server.agreement import fingerprint, hello

    config, rank, users = parts.config, parts.rank, parts.users
    values = fingerprint(config, parts.global_state)
    # compared at each announcement, not part of the run's identity (a silo whose file was
    # corrected carries on with its record and DP account)
    table = read_ipconfig(config.comm.grpc_ipconfig_path) if config.comm.grpc_ipconfig_path else {}
    mode, threshold, weighted = (
        data_mode(config),
        secure_threshold(config),
        config.train.aggregation == "sample_weighted",
    )
    roster = _run_roster(config, threshold is not None)
    values_agreed = {ROSTER_DIGEST: "none" if roster is None else roster.digest}
    if parts.is_server:
        return ServerSetup(
            mode=mode,
            secure_threshold=threshold,
            sample_weighted=weighted,
            silos=list(range(1, config.silo_count + 1)),
            fingerprint={**values, ADDRESSES: address_table(table), **values_agreed},
            user_counts=mode.vouched_counts(users, rank),
            model=parts.model,
            metric_names=parts.algorithm.metric_names,
            run_id=str(getattr(parts.args, "run_id", "0")),
            privacy=_privacy_words(config.privacy),
            ca=_run_ca(config) if threshold else None,
            roster=roster if threshold else None,
            min_summed=config.secagg.min_summed_silos if threshold else 0,
            max_colluding=config.secagg.max_colluding_silos if threshold else 0,
            reserve_silos=config.secagg.reserve_silos if threshold else 0,
            keyed_order=parts.algorithm.keyed_order if threshold else None,
        )
    agreed = {**values, ADDRESSES: addresses_seen(table, rank), **values_agreed}
    if not mode.own_data:
        dp_evaluates = RoundSchedule.from_config(config).evaluates if config.privacy is not None else None
        return SiloSetup(
            mode=mode,
            secure_threshold=threshold,
            sample_weighted=weighted,
            hello=hello(agreed, None, None, parts.data_problem),
            figures_after=dp_evaluates,
        )
    user = rank - 1
    return SiloSetup(
        mode=mode,
        secure_threshold=threshold,
        sample_weighted=weighted,
        hello=hello(agreed, user, users[0], parts.data_problem),
        user_counts=mode.vouched_counts(users, rank),
        privacy=parts.silo_privacy,
        outcome=silo_outcome(parts, values),
        secure_rules=silo_rules(config),
        scheduled=silo_schedule(parts),
        evaluates=RoundSchedule.from_config(config).evaluates,
        keyed_order=silo_schedule(parts, keyed_order=True) if threshold else None,
        reserve_silos=config.secagg.reserve_silos if threshold else 0,
    )


def _run_roster(config: Any, secure: bool) -> Any:
    """The run's key roster this process pins (comm_args.roster_path, else tls_dir's roster.json), or
    None; secure aggregation refuses to start without one: its guarantees rest on who the silos are."""
    from ..net.key_roster import ROSTER, read_roster, roster_path_of

    path = roster_path_of(config.comm.roster_path, config.comm.tls_dir)
    if path is None:
        if secure:
            raise ConfigError(
                f"secagg_args.enable_secagg=True: needs the run's key roster (comm_args.roster_path, or {ROSTER} in "
                f"comm_args.tls_dir={config.comm.tls_dir!r}): without it a certificate the run's CA signs for any key "
                f"joins a round. Make it with: fedml-perfedavg certs roster --tls-dir DIR --clients N "
                f"(docs/deployment.md)"
            )
        return None
    return read_roster(path, config.silo_count + 1)


def _run_ca(config: Any) -> Optional[bytes]:
    """The run CA's certificate (comm_args.tls_dir), which the server checks secure aggregation's
    advertisements against before relaying them (None: an insecure run, whose silos check none)."""
    from ..net.credentials import CA_CERT

    if not config.comm.tls_dir:
        return None
    with open(os.path.join(config.comm.tls_dir, CA_CERT), "rb") as stream:
        return stream.read()


def _privacy_words(dp: Any) -> Optional[str]:
    """DP-SGD's settings as the server's log says them (None: the run has no DP-SGD)."""
    if dp is None:
        return None
    return (
        f"DP-SGD: noise multiplier {dp.noise_multiplier:g}, clip {dp.max_grad_norm:g} ({dp.clip}), "
        f"epsilon by {dp.accountant} at delta {dp.delta:g}"
    )


def silo_outcome(parts: RunParts, values: Dict[str, Any]) -> Any:
    """A data owner's silo's record of the run as it goes, carried on from an earlier process of
    this silo in the same run directory (its progress.pt), and kept after every change."""
    from ..silo.outcome import SiloOutcome
    from .silo_record import SiloProgress, run_identity

    user = parts.rank - 1
    identity = run_identity(getattr(parts.args, "run_id", "0"), values, user)
    progress = SiloProgress(
        parts.run_dir, parts.rank, identity, parts.algorithm, parts.silo_privacy, parts.silo_account,
        parts.silo_run_secret,
    )  # fmt: skip
    progress.refuse_a_finished_record(parts.config.common.overwrite)
    outcome = SiloOutcome(user)
    progress.restore(outcome)
    outcome.keep = progress.save
    parts.silo_progress = progress
    return outcome


def _silo_identity(parts: RunParts) -> Dict[str, Any]:
    """A silo's run identity (what its progress.pt is kept under; :func:`silo_outcome`'s)."""
    from ..silo.server.agreement import fingerprint
    from .silo_record import run_identity

    values = fingerprint(parts.config, parts.global_state)
    return run_identity(getattr(parts.args, "run_id", "0"), values, parts.rank - 1)


def _fewest_silos(config: Any) -> int:
    """comm_args.min_clients_per_round's default: every silo of a round in the clear; what a secure
    round needs (its threshold, min_summed_silos), whose shorter rounds fail without stopping the run."""
    threshold = secure_threshold(config)
    if threshold is None:
        return int(config.train.client_num_per_round)
    return max(threshold, int(config.secagg.min_summed_silos))


def secure_threshold(config: Any) -> Optional[int]:
    """Secure aggregation's threshold (None: updates travel in the clear): the config's, or a
    majority of a round's silos."""
    if not config.secagg.enable_secagg:
        return None
    from ..secagg.rounds import default_threshold

    return int(
        config.secagg.reconstruction_threshold
        or default_threshold(config.train.client_num_per_round, config.secagg.max_colluding_silos)
    )


def silo_rules(config: Any) -> Optional[Any]:
    """What a data owner's silo enforces of each secure round itself (None: no secure aggregation)."""
    threshold = secure_threshold(config)
    if threshold is None:
        return None
    from ..secagg.rounds import SiloRules

    return SiloRules(threshold, config.secagg.max_colluding_silos, config.secagg.min_summed_silos)


def silo_schedule(parts: RunParts, keyed_order: bool = False) -> Callable[[int], List[int]]:
    """A data owner's silo's copy of the keyed schedule (the algorithm's own sampling, keyed by
    (seed, round) as the server's): round -> the silo ranks it samples (user u is silo u + 1); with
    ``keyed_order``, every silo rank in the round's keyed order (the sample first)."""
    users = parts.algorithm.keyed_order if keyed_order else parts.algorithm.sample_clients

    def scheduled(round_idx: int) -> List[int]:
        return [user + 1 for user in users(round_idx)]

    return scheduled
