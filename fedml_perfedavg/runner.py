"""Run a configured experiment through FedML and write its results."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import torch

from . import checkpoint, fedml_compat
from .config import Config, ConfigError, check_against_data
from .data import FederatedData, load_federated
from .engine import BatchedSimulation
from .guards import DivergenceError, RunStopped
from .models import create_model
from .registry import algorithm_factory
from .reporting import RunRecorder
from .sampling import held_out_users

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run produced; ``summary`` is also in ``run_dir/summary.json``."""

    summary: Dict[str, Any]
    run_dir: str
    model: torch.nn.Module
    trainer: Any
    aggregator: Any


def resolve_run_dir(config: Config, run_dir: Optional[str] = None) -> str:
    """The run's output directory (created): ``run_dir`` or ``output_dir/run_name``."""
    if run_dir is None:
        stem = os.path.splitext(os.path.basename(config.source))[0] if config.source else "run"
        name = config.run_name or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir = os.path.join(config.output_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    return os.path.abspath(run_dir)


def device_of(config: Config) -> torch.device:
    """The torch device the config asks for; an error if CUDA is asked for but absent."""
    if not config.using_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device_args.using_gpu=True: CUDA is not available on this machine (use false)")
    if config.gpu_id >= torch.cuda.device_count():
        raise ConfigError(f"device_args.gpu_id={config.gpu_id!r}: must be < {torch.cuda.device_count()}")
    return torch.device(f"cuda:{config.gpu_id}")


def mpi_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def shared_run_dir(config: Config, run_dir: Optional[str]) -> str:
    """Under MPI: rank 0 picks (and creates) the run directory and tells the other ranks."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    return comm.bcast(resolve_run_dir(config, run_dir) if comm.Get_rank() == 0 else None, root=0)


@contextlib.contextmanager
def mpi_failure_policy(rank: int) -> Iterator[None]:
    """Under MPI a client rank that fails alone would leave the server waiting forever (FedML's
    MPI server has no timeout): it logs why and aborts the whole job instead. The server's
    evaluations up to then are in its run.log; its summary.json is not written."""
    from mpi4py import MPI

    try:
        yield
    except BaseException as err:
        if rank != 0:
            logger.error("rank %d failed, aborting the MPI job: %s", rank, err)
            logging.shutdown()
            MPI.COMM_WORLD.Abort(1)
        raise


def load_data(config: Config) -> FederatedData:
    """The federated split the config describes."""
    return load_federated(config.dataset, config.data_cache_dir, config.client_num_in_total,
                          config.partition_method, config.random_seed, download=config.download,
                          images_per_class=config.images_per_class,
                          test_images_per_class=config.test_images_per_class)


@dataclass(frozen=True)
class SiloRole:
    """Which process of a cross-silo run this is (FedML's ``--rank/--role/--run_id``)."""

    rank: int
    role: str  # "server" (rank 0) or "client"
    run_id: str = "0"


def check_silo_role(config: Config, silo: Optional[SiloRole]) -> SiloRole:
    """The cross-silo identity must be given and agree with the config."""
    if silo is None:
        raise ConfigError("common_args.training_type='cross_silo': start each process with --rank R --role "
                          "server|client, or start them all with: fedml-perfedavg launch-silo --cf CONFIG")
    if silo.role not in ("server", "client"):
        raise ConfigError(f"--role {silo.role!r}: must be 'server' or 'client'")
    if (silo.role == "server") != (silo.rank == 0):
        raise ConfigError(f"--rank {silo.rank} --role {silo.role}: the server is rank 0 and silos are ranks "
                          f"1..{config.client_num_per_round}")
    if not 0 <= silo.rank <= config.client_num_per_round:
        raise ConfigError(f"--rank {silo.rank}: silos are ranks 1..{config.client_num_per_round} "
                          f"(train_args.client_num_per_round)")
    if config.grpc_ipconfig_path is None:
        raise ConfigError("comm_args.grpc_ipconfig_path=None: cross-silo needs the gRPC address file (CSV "
                          "eid,rank,grpc_server_ip,grpc_server_port); launch-silo writes one")
    from .silo import read_ipconfig

    read_ipconfig(config.grpc_ipconfig_path, config.client_num_per_round + 1)
    return silo


def run(config: Config, run_dir: Optional[str] = None, data: Optional[FederatedData] = None,
        resume: bool = False, silo: Optional[SiloRole] = None) -> RunResult:
    """Run the experiment of ``config``: single-process simulation (batched engine, or FedML's
    own round loop with ``simulation_engine: fedml``), FedML's MPI simulation when
    ``backend: MPI`` (start under ``mpirun -n <client_num_per_round + 1>``), or this process's
    part of a cross-silo run (``training_type: cross_silo``; ``silo`` says which)."""
    mpi = config.backend == "MPI"
    cross_silo = config.training_type == "cross_silo"
    if resume and (mpi or cross_silo or config.simulation_engine != "batched"):
        raise ConfigError(f"train_args.simulation_engine={config.simulation_engine!r}, comm_args.backend="
                          f"{config.backend!r}: resuming needs the batched engine on sp (FedML's loops always "
                          f"start at round 0)")
    if cross_silo:
        silo = check_silo_role(config, silo)
    rank = silo.rank if cross_silo else mpi_rank() if mpi else 0
    is_server = rank == 0
    run_dir = shared_run_dir(config, run_dir) if mpi else resolve_run_dir(config, run_dir)
    if is_server:
        checkpoint.save_config(run_dir, config.sections())
    device = device_of(config)
    data = data if data is not None else load_data(config)
    check_against_data(config, min(len(u.train_y) for u in data.users))

    # FedML only knows its own optimizers: it gets "FedAvg" and the plugin keeps its choice.
    # wandb is owned by the plugin's recorder (FedML's own wandb.init has no group or dir).
    args = config.to_fedml_args(federated_optimizer="FedAvg", plugin_algorithm=config.federated_optimizer,
                                enable_wandb=False, using_mlops=False, run_name=os.path.basename(run_dir))
    if config.fedml_home == "run_dir":
        fedml_compat.redirect_fedml_home(os.path.join(run_dir, "fedml"))
    if cross_silo:
        args.rank, args.role, args.run_id = silo.rank, silo.role, silo.run_id
        args.worker_num, args.scenario, args.test_on_clients = config.client_num_per_round, "horizontal", "no"
    if mpi or cross_silo or config.simulation_engine == "fedml":
        args = fedml_compat.init_fedml_offline(args, fedml_dir=os.path.join(run_dir, "fedml"))
    else:
        fedml_compat.import_fedml()
    if mpi and args.worker_num - 1 != config.client_num_per_round:
        raise ConfigError(f"train_args.client_num_per_round={config.client_num_per_round!r}: under MPI it must equal "
                          f"the number of ranks - 1 (this is mpirun -n {args.worker_num}, so "
                          f"{args.worker_num - 1}; or run mpirun -n {config.client_num_per_round + 1})")
    torch.manual_seed(config.random_seed)
    model = create_model(config.model, data.input_shape, data.num_classes, config.hidden_sizes).to(device)
    wandb_settings = None
    if config.enable_wandb:
        wandb_settings = {"project": config.wandb_project, "group": config.wandb_group,
                          "name": os.path.basename(run_dir)}
    new_users = held_out_users(config.random_seed, config.client_num_in_total, config.new_user_fraction)
    recorder = RunRecorder(run_dir, config.comm_round, config.sections(), config.show_progress, wandb_settings,
                           new_users) if is_server else None
    trainer, aggregator = algorithm_factory(config.federated_optimizer)(model, config, args, recorder)

    where = (f"cross-silo rank {rank} ({silo.role})" if cross_silo else "MPI simulation" if mpi
             else f"{config.simulation_engine} engine")
    logger.info("run %s: %s (%s) on %s, %d rounds, %d of %d users per round, %s", run_dir,
                config.federated_optimizer, config.perfedavg_variant, config.dataset, config.comm_round,
                config.client_num_per_round, config.client_num_in_total, where)
    start_round = 0
    if resume:
        state = checkpoint.load(run_dir)
        if state is None:
            logger.warning("no checkpoint in %s: starting from round 0", run_dir)
        else:
            aggregator.set_model_params(state["model"])
            recorder.restore(state["recorder"])
            aggregator.skipped_rounds = state["aggregator"]["skipped_rounds"]
            aggregator.rejected = dict(state["aggregator"]["rejected"])
            start_round = state["next_round"]
            logger.info("resumed %s at round %d", run_dir, start_round)

    def save_checkpoint(next_round: int) -> None:
        checkpoint.save(run_dir, next_round, aggregator.get_model_params(), recorder.state(),
                        {"skipped_rounds": aggregator.skipped_rounds, "rejected": aggregator.rejected})

    def finish(**status) -> Dict[str, Any]:
        return recorder.finish(rejected_updates=aggregator.rejected, aggregate_calls=aggregator.aggregate_calls,
                               **status)

    try:
        if cross_silo:  # returns when this process's part of the run is over
            policy = fedml_compat.SiloPolicy(config.connect_timeout, config.round_timeout,
                                             config.min_clients_per_round or config.client_num_per_round,
                                             config.random_seed, config.new_user_fraction)
            fedml_compat.run_silo(args, device, data.as_fedml_dataset(config.batch_size), model, trainer, aggregator,
                                  policy)
        elif mpi:  # FedML's MPI loop runs (and ends) inside the runner's construction
            with mpi_failure_policy(rank):
                fedml_compat.build_mpi_runner(args, device, data.as_fedml_dataset(config.batch_size), model,
                                              trainer, aggregator)
        elif config.simulation_engine == "fedml":
            fedml_compat.build_sp_runner(args, device, data.as_fedml_dataset(config.batch_size), model,
                                         trainer, aggregator).run()
        else:
            BatchedSimulation(config, data.to(device).users, trainer, aggregator, recorder).run(
                start_round, save_checkpoint)
    except (DivergenceError, RunStopped) as err:
        # No result is lost: what was measured so far goes to summary.json, then the run stops.
        if is_server:
            finish(status="stopped", error=str(err))
        raise
    if not is_server:  # an MPI client rank or a silo: the server records and writes the results
        return RunResult({"role": "client", "rank": rank}, run_dir, model, trainer, aggregator)
    torch.save(aggregator.get_model_params(), os.path.join(run_dir, "model.pt"))
    summary = finish()
    logger.info("personalized accuracy %.4f (before adaptation %.4f) after %d rounds in %.1f s; results in %s",
                summary["personalized_accuracy"], summary["accuracy_before_adaptation"], summary["rounds"],
                summary["wall_seconds"], run_dir)
    return RunResult(summary, run_dir, model, trainer, aggregator)
