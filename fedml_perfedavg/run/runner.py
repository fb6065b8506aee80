"""A plugin run, in stages: assemble -> restore -> execute -> finish.

Every run goes through FedML's own main-script steps (``fedml.init``, ``fedml.device``,
``fedml.data.load``, ``fedml.model.create``, ``FedMLRunner(...).run()``): the command line and
:func:`run` build FedML's ``args`` from the typed config and take those steps, and a FedML
user's own script takes them itself. The installed bridge hands a plugin algorithm to
:class:`PluginRun` (through :class:`Entry`), which owns the rest: its parts (:mod:`.assembly`:
the algorithm object, the backend adapter), the round driver (:mod:`.driver`: evaluation on the
run's schedule, checkpoints), and the run directory (config.yaml, run.log, summary.json, model.pt).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..algorithms.base import FederatedAlgorithm
from ..algorithms.registry import canonical_name
from ..core.errors import ConfigError, DivergenceError, OutputError, RunStopped
from ..core.types import StateDict
from ..data.loading import DATASETS, FederatedData, load_federated
from ..data.partition import PARTITIONS
from .. import logs
from ..stopping import (
    STOP_SIGNALLED,
    RoundEndInterrupt,
    exit_as_signalled,
    note_recorded_stop,
    sigterm_as_interrupt,
    stop_exit_code,
    stop_in_place_of,
    stopped_exit_code,
)
from . import checkpoint
from .files import hold_run_dir, make_dir, record_of, refuse_if_held, release_run_dir, write_torch
from ..core.settings import field_default
from .config import load_yaml
from .rules import check_scenario
from .schema import BY_NAME, Config
from .fedml_args import check_algorithm_name, from_fedml_args, to_fedml_args, transport_values
from .assembly import assemble, backend_for, check_layout, driver_for, resume_problem

CROSS_SILO_STATE = "cross_silo"  # the cross-silo server's part of a checkpoint (its session, the run id)

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run produced; ``summary`` is also in ``run_dir/summary.json``."""

    summary: Dict[str, Any]
    run_dir: str
    algorithm: FederatedAlgorithm
    final_state: Optional[StateDict]
    trainer: Any = None
    aggregator: Any = None


# -- what a run is, beside FedML's args ------------------------------------------------------------
CONTEXT = "perfedavg"  # the one attribute the run layer keeps on FedML's args


@dataclass(repr=False)
class RunContext:
    """What the run layer knows of a run beyond FedML's flattened ``args``, kept on them as
    ``args.perfedavg``: the typed config, resolved once, and how the run was asked for."""

    config: Config
    requested_run_dir: Optional[str] = None  # --run-dir (None: output_dir/run_name)
    resume: bool = False  # --resume: continue the run in the run directory
    grid: bool = False  # one of several runs in this process: wandb records written at the end
    run_dir: Optional[str] = None  # chosen once (MPI: by rank 0) and kept

    def __repr__(self) -> str:  # FedML logs its whole args: keep this line short
        return f"RunContext(run_dir={self.run_dir!r}, resume={self.resume}, grid={self.grid})"


def context_of(args: Any) -> RunContext:
    """The run's context on FedML's ``args``, made (the config resolved) the first time. A
    user's script may change ``args`` between ``fedml.init`` and ``FedMLRunner``: then the config
    is resolved again from them, and the log says which keys changed."""
    context = getattr(args, CONTEXT, None)
    if context is None:
        context = RunContext(from_fedml_args(args))
        setattr(args, CONTEXT, context)
        return context
    config = context.config
    changed = sorted(
        f.name  # its algorithm's keys alone: another's, in FedML's args from the YAML, it never held
        for f in config.own_settings()
        if f.name != "enable_wandb" and hasattr(args, f.name) and getattr(args, f.name) != config.setting(f.name)
    )
    if changed:
        context.config = from_fedml_args(args, enable_wandb=config.tracking.enable_wandb, sections=config.sections())
        changed = [n for n in changed if context.config.setting(n) != config.setting(n)]
        if changed:
            logger.info("FedML's args changed after fedml.init (%s): the run uses the new values", ", ".join(changed))
    return context


# -- values computed once per run ---------------------------------------------------------------
RUN_FILES = ("summary.json", "config.yaml", "model.pt", checkpoint.CHECKPOINT, checkpoint.PREVIOUS)


def default_run_name(config: Config, run_id: Optional[str] = None) -> str:
    """``common_args.run_name``, else the config file's name and, for a cross-silo run, its
    ``--run_id`` (every process of the run, started apart, names the same folder), for any other
    run the start time."""
    if config.common.run_name:
        return config.common.run_name
    stem = os.path.splitext(os.path.basename(config.source))[0] if config.source else "run"
    if config.common.training_type == "cross_silo" and run_id is not None:
        return f"{stem}-run-{run_id}"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run_dir(
    config: Config,
    run_dir: Optional[str] = None,
    create: bool = True,
    resume: bool = False,
    owner: bool = True,
    run_id: Optional[str] = None,
) -> str:
    """The run's output directory: ``run_dir`` or ``output_dir/`` :func:`default_run_name`. The
    process that owns the run's record (``owner``: sp, MPI rank 0, the cross-silo server) never
    starts a new run in a directory that holds one: that is an error unless ``resume`` (continue
    it) or ``common_args.overwrite`` (its run files are removed first)."""
    if run_dir is None:
        run_dir = os.path.join(config.common.output_dir, default_run_name(config, run_id))
    run_dir = os.path.abspath(run_dir)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"run directory {run_dir!r} is a file; give another --run-dir (or common_args.run_name)")
    if owner:
        refuse_if_held(run_dir)  # a live run's folder, whatever is asked of it (a new run, --overwrite, --resume)
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))] if owner and not resume else []
    failed_start = never_started(run_dir) if held else None
    if held and not config.common.overwrite and failed_start is None:
        raise ConfigError(
            f"run directory {run_dir!r} holds a run ({', '.join(held)}); give another --run-dir (or "
            f"common_args.run_name), --resume {run_dir} to continue it, or --overwrite "
            f"(common_args.overwrite: true) to replace it"
        )
    if create:
        make_dir(run_dir)
        if owner:  # before anything of a run there is replaced: a live one keeps its folder
            hold_run_dir(run_dir)
        if held and failed_start is not None:
            logger.warning("run directory %s: replacing the record of a start that failed (%s)", run_dir, failed_start)
        for name in held:  # overwrite: the old run's files go, so nothing of it is mistaken for the new one's
            os.remove(os.path.join(run_dir, name))
    return run_dir


def never_started(run_dir: str) -> Optional[str]:
    """The error of the run recorded in ``run_dir`` if it ended before its first round (nothing
    measured, no checkpoint: a retry replaces it rather than trip on it), else None."""
    if any(os.path.exists(os.path.join(run_dir, name)) for name in (checkpoint.CHECKPOINT, checkpoint.PREVIOUS)):
        return None
    try:
        with open(os.path.join(run_dir, "summary.json")) as stream:
            summary = json.load(stream)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") == "finished" or summary.get("rounds") not in (0, None):
        return None
    if summary.get("history") or summary.get("personalized_accuracy") is not None:
        return None
    return f"{summary.get('status')}: {summary.get('error')}"


def mpi_world_rank() -> int:
    """This process's rank in ``mpirun``'s job (0 when started alone)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def shared_run_dir(config: Config, run_dir: Optional[str], resume: bool = False) -> str:
    """Under MPI, rank 0 picks (and creates) the run directory and tells the other ranks."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    chosen, error = None, None
    if comm.Get_rank() == 0:
        try:
            chosen = resolve_run_dir(config, run_dir, resume=resume)
        except (ConfigError, OutputError) as err:
            error = err
    chosen, error = comm.bcast((chosen, error), root=0)  # every rank ends with rank 0's error
    if error is not None:
        raise error
    return chosen


def run_dir_of(context: RunContext, args: Any) -> str:
    """The run directory, chosen once per run and kept in its context (FedML carries ``args``
    from ``fedml.init`` to ``FedMLRunner``)."""
    if context.run_dir is None:
        config, requested = context.config, context.requested_run_dir
        owner = rank_of(config, args) == 0
        run_id = str(getattr(args, "run_id", "0"))
        # the name is chosen once (a default one holds the time): rank 0's, under MPI
        planned = (
            resolve_run_dir(config, requested, create=False, resume=context.resume, owner=owner, run_id=run_id)
            if owner
            else requested
        )
        new = planned is not None and not os.path.exists(planned)
        if config.comm.backend == "MPI":
            context.run_dir = shared_run_dir(config, planned, context.resume)
        else:
            context.run_dir = resolve_run_dir(config, planned, resume=context.resume, owner=owner, run_id=run_id)
        if new and owner:
            atexit.register(remove_if_never_started, context.run_dir)
    return context.run_dir


def remove_if_never_started(run_dir: str) -> None:
    """At the end of the process that made ``run_dir``: a run that failed before it measured
    anything (a FedML main script refused at start: missing data, an empty test split) leaves no
    directory behind, as the command line's own failed starts do."""
    if os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, "summary.json")):
        logs.close_files_under(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)


def rank_of(config: Config, args: Any) -> int:
    """This process's rank: 0 on sp; FedML's MPI rank; the cross-silo ``--rank``."""
    if config.common.training_type == "cross_silo":
        return int(args.rank)
    if config.comm.backend == "MPI":  # before fedml.init has set process_id (choosing FedML's home), mpirun's rank
        process_id = getattr(args, "process_id", None)
        return mpi_world_rank() if process_id is None else int(process_id)
    return 0


def default_of(name: str) -> Any:
    """The default of a config key (the one source: :class:`~.config.Config`)."""
    return field_default(BY_NAME[name])


@functools.lru_cache(maxsize=4)
def _cached_split(
    dataset: str,
    root: str,
    users: int,
    partition: str,
    seed: int,
    download: bool,
    a: Optional[int],
    a_test: Optional[int],
) -> FederatedData:
    return load_federated(
        dataset, root, users, partition, seed, download=download, images_per_class=a, test_images_per_class=a_test
    )


def _split_of(value: Callable[[str], Any]) -> FederatedData:
    """The paper's split for the keys ``value`` reads (a config's, or FedML's args')."""
    return _cached_split(
        value("dataset"),
        os.path.abspath(value("data_cache_dir")),
        int(value("client_num_in_total")),
        value("partition_method"),
        int(value("random_seed")),
        bool(value("download")),
        value("images_per_class"),
        value("test_images_per_class"),
    )


def load_split(config: Config) -> FederatedData:
    """The paper's split the config describes (cached: a grid or a test suite loads it once)."""
    return _split_of(config.setting)


# -- what the bridge calls ------------------------------------------------------------------------
class Entry:
    """The run layer's side of :class:`fedml_perfedavg.fedml_bridge.install.PluginEntry`."""

    def is_plugin_algorithm(self, name: Optional[str]) -> bool:
        return canonical_name(name) is not None

    def before_fedml_arguments(self, yaml_path: Optional[str]) -> Optional[Dict[str, Dict[str, Any]]]:
        """Reads FedML's ``--cf`` file, the one time it is read in the process (FedML is handed
        these sections). FedML's reader of a hierarchical cross-silo YAML fails with an
        AttributeError (it wants a ``server_config_path``): a plugin algorithm's is refused first,
        saying why."""
        if not yaml_path or not os.path.isfile(yaml_path):
            return None  # FedML's own handling (the run's config check names a missing file)
        try:
            sections = load_yaml(yaml_path)
        except ConfigError:
            return None  # FedML's reader, then the run's config check, say what is wrong with it
        flat = {k: v for values in sections.values() for k, v in values.items()}
        if self.is_plugin_algorithm(flat.get("federated_optimizer")):
            check_scenario(flat.get("training_type"), flat.get("scenario"))
        return sections

    def check_algorithm_name(self, args: Any) -> None:
        check_algorithm_name(args)

    def before_fedml_init(self, args: Any) -> Optional[str]:
        """Validates a plugin run's config before FedML starts (a plugin name in any case is made
        the registry's; a name neither the plugin nor FedML runs is an error here, before data
        loads), chooses its run directory, keeps FedML's own ``wandb.init`` (fedml/__init__.py
        ``_manage_profiling_args``: no group, files in the working directory) off for it, since
        the run's recorder owns wandb; returns where FedML's ``~/.fedml`` files go."""
        check_algorithm_name(args)
        if self.is_plugin_algorithm(getattr(args, "federated_optimizer", None)):
            context_of(args)  # resolved once; a bad value stops the run here, before FedML starts anything
            args.enable_wandb = False  # the typed config keeps the user's value
        home = getattr(args, "fedml_home", default_of("fedml_home"))
        if home == "user":
            return None
        if home != "run_dir":
            return os.path.abspath(os.path.expanduser(home))
        if not self.is_plugin_algorithm(getattr(args, "federated_optimizer", None)):
            return None  # FedML's own algorithms have no plugin run directory: FedML's default
        return os.path.join(run_dir_of(context_of(args), args), "fedml")

    def load_split(self, args: Any) -> Optional[FederatedData]:
        if self.is_plugin_algorithm(getattr(args, "federated_optimizer", None)):
            config = context_of(args).config
            if config.own_data:  # each process loads only what it owns: a silo its user, the server nothing
                from .silo_data import own_split

                return own_split(config, int(args.rank), load_split)
        partition = getattr(args, "partition_method", None)
        if partition not in PARTITIONS or getattr(args, "dataset", None) not in DATASETS:
            return None
        if self.is_plugin_algorithm(getattr(args, "federated_optimizer", None)):
            return load_split(context_of(args).config)
        return _split_of(lambda name: getattr(args, name, default_of(name)))  # FedML's own algorithm on this split

    def transport_values(self, args: Any) -> Dict[str, Any]:
        """The transport's values from the run's typed config (for FedML's own algorithms, from
        FedML's ``args`` by the config's rules)."""
        plugin = self.is_plugin_algorithm(getattr(args, "federated_optimizer", None))
        return transport_values(args, context_of(args).config if plugin else None)

    def build_runner(
        self, args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any
    ) -> "PluginRun":
        return PluginRun(args, device, dataset, model, trainer, aggregator)


def cap_messages_by_global_state(args: Any, global_state: StateDict) -> None:
    """Cross-silo: the default message cap from the whole global state (an algorithm's own tensors
    beside the model included), not from the model FedMLRunner was handed (fedml_bridge/dispatch.py)."""
    from ..fedml_bridge.cross_silo.transport import MODEL_SIZE_CAP
    from ..net.wire import default_size_cap

    setattr(args, MODEL_SIZE_CAP, default_size_cap(global_state))


# -- the run --------------------------------------------------------------------------------------
class PluginRun:
    """``FedMLRunner``'s runner for a plugin algorithm: built by FedML's entry points (what the
    run is made of: :mod:`.assembly`; what happens each round: :mod:`.driver`), ``run()``
    restores, executes and finishes (where results go: :mod:`.reporting`)."""

    def __init__(
        self, args: Any, device: Any, dataset: list, model: torch.nn.Module, trainer: Any = None, aggregator: Any = None
    ) -> None:
        self.args = args
        self.context = context_of(args)
        self.config = config = self.context.config
        if config.common.training_type == "cross_silo":
            # FedML's init counts silos as client_num_per_round; in data-owner mode there is one per user.
            args.worker_num = config.silo_count
            if int(args.rank) == 0:
                args.client_id_list = str(list(range(1, config.silo_count + 1)))
        if config.comm.backend != "MPI":
            check_layout(config, args)  # before this process opens a file in a run directory a failed start removes
            self.run_dir = run_dir_of(self.context, args)
            self.rank = rank_of(config, args)
            self._assemble(device, dataset, model, trainer, aggregator)
            return
        # Under MPI a rank that fails to start alone would leave the others waiting for it forever
        # in FedML's loop: every rank starts, or every rank stops with the failing rank's error.
        # Rank 0 removes a failed start's run directory once every rank has said so here, past
        # fedml.init: a slower rank no longer writes FedML's files into it after it is gone.
        from ..fedml_bridge.mpi import agree_to_start

        self.run_dir = run_dir_of(self.context, args)
        self.rank = rank_of(config, args)
        try:
            check_layout(config, args)  # before any rank opens a file of its own in the run directory
            self._assemble(device, dataset, model, trainer, aggregator)
        except Exception as err:
            agree_to_start(getattr(args, "comm", None), self.rank, err)
            raise
        agree_to_start(getattr(args, "comm", None), self.rank, None)

    def _assemble(self, device: Any, dataset: list, model: torch.nn.Module, trainer: Any, aggregator: Any) -> None:
        config = self.config
        self.parts = parts = assemble(
            self.args, config, self.run_dir, self.rank, device, dataset, model, trainer, aggregator, self.context.grid
        )
        self.is_server, self.model, self.algorithm = parts.is_server, model, parts.algorithm
        if config.common.training_type == "cross_silo":
            cap_messages_by_global_state(self.args, parts.global_state)
        self.recorder = parts.recorder
        self.driver = driver_for(parts)
        self.backend, self.where = backend_for(parts, self.driver)
        self.start_round = 0
        if config.common.training_type == "cross_silo" and self.is_server:
            self.driver.backend_states[CROSS_SILO_STATE] = self.backend.checkpoint_state
        logger.info(
            "run %s: %s on %s, %d rounds, %d of %d users per round, %s",
            self.run_dir,
            self.algorithm.label,
            config.data.dataset,
            config.train.comm_round,
            config.train.client_num_per_round,
            config.train.client_num_in_total,
            self.where,
        )

    @property
    def global_state(self) -> StateDict:
        """The newest global model."""
        return self.driver.global_state

    def restore(self) -> None:
        if not self.context.resume:
            return
        problem = resume_problem(self.config, self.is_server)
        if problem is not None:
            raise ConfigError(problem)
        self.start_round = self.driver.restore(self.parts.device)
        if self.config.common.training_type == "cross_silo":
            with torch.no_grad():  # FedML's aggregator starts from the model (and state beside it) it holds
                self.parts.aggregator.set_model_params(self.driver.global_state)
            self.backend.resume(self.start_round, self.driver.restored.get(CROSS_SILO_STATE))
        elif self.start_round:
            self.backend.state = dict(self.driver.global_state)

    def execute(self) -> None:
        from ..engine.batched import BatchedSimulation

        if isinstance(self.backend, BatchedSimulation):
            stop = RoundEndInterrupt()
            with stop:  # Ctrl-C keeps the round it lands in (a checkpoint)
                self.driver.stop_at_round_end = stop
                try:
                    self.driver.global_state = self.backend.run(self.start_round, self.config.train.comm_round)
                finally:
                    self.driver.stop_at_round_end = None
        else:
            self.backend.run()

    def finish(self, status: str = "finished", error: Optional[str] = None) -> Dict[str, Any]:
        """The server writes model.pt (the last global model, also of a stopped run) and summary.json.
        If model.pt cannot be written, summary.json says ``failed`` and why, and the error is raised."""
        if not self.is_server:
            outcome = getattr(self.backend, "outcome", None)
            if status == "finished" and outcome is not None and outcome.ended_early:
                status, error = "stopped", outcome.ended_early  # the server's reason: the run did not finish
            if self.config.common.training_type == "cross_silo" and self.config.own_data and outcome is not None:
                from ..core.ledger import silo_report
                from .silo_record import write_silo_record

                algorithm, ledger = self.parts.algorithm, self.parts.silo_privacy
                own_state = algorithm.client_states.get(outcome.user) if outcome.user is not None else None
                privacy = (
                    None if ledger is None or outcome.user is None else silo_report(ledger, outcome.user, final=True)
                )
                record = write_silo_record(
                    self.run_dir, self.rank, outcome, self.parts.trainer.personalized, status, error, own_state, privacy
                )
                status, error = record["status"], record["error"]
            return {"role": "client", "rank": self.rank, "status": status, "error": error}
        # The module the user handed FedMLRunner holds the final global model on every backend, as
        # after FedML's own FedAvg (the batched engine keeps its own state; FedML's loops train copies).
        with torch.no_grad():  # the model's part of the global state (an algorithm's own tensors stay beside it)
            self.model.load_state_dict({k: self.global_state[k].detach() for k in self.model.state_dict()})
        lost: Optional[OutputError] = None
        try:
            write_torch(
                os.path.join(self.run_dir, "model.pt"), {k: v.detach().cpu() for k, v in self.global_state.items()}
            )
        except OutputError as err:
            lost, status, error = err, "failed", f"{error}; {err}" if error else str(err)
        assert self.recorder is not None  # every server has one
        summary = self.recorder.finish(
            status=status,
            error=error,
            aggregation={
                "aggregate_calls": self.algorithm.aggregate_calls,
                **self.algorithm.screen.record(),
                **self.algorithm.clip_bounds_record(),
            },
        )
        if lost is not None:
            raise lost
        if summary["personalized_accuracy"] is not None:
            logger.info(
                "personalized accuracy %.4f (before adaptation %.4f), evaluated after round %s; %s of %d rounds "
                "run (%s); %.1f s; results in %s",
                summary["personalized_accuracy"],
                summary["accuracy_before_adaptation"],
                summary["headline_round"],
                summary["rounds"],
                self.config.train.comm_round,
                status,
                summary["wall_seconds"],
                self.run_dir,
            )
        return summary

    def run(self) -> RunResult:
        exit_as_signalled()
        with sigterm_as_interrupt(), self.ending():
            self.restore()
            self.execute()
        return self.conclude()

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """How a run that raises ends: no result is lost (summary.json and model.pt say what was
        measured and why it stopped), and the run's log file is closed."""
        try:
            yield
        except (DivergenceError, RunStopped) as err:
            self.finish(status="stopped", error=str(err))
            self._end_every_rank(f"run stopped: {err}", stop_exit_code(err))
            raise
        except KeyboardInterrupt:
            self._interrupted()
            raise
        except BaseException as err:  # any other end is recorded too: `running` only while a process lives
            if STOP_SIGNALLED.is_set():
                self._interrupted()
                stop_in_place_of(err)
            try:
                self.finish(status="failed", error=f"{type(err).__name__}: {err}")
            except OutputError as again:
                logger.error("%s", again)
            self._end_every_rank(f"run failed: {type(err).__name__}: {err}", 1)
            raise

    def _interrupted(self) -> None:
        """A run stopped by SIGINT or SIGTERM: recorded as interrupted, one line said, every rank ended."""
        self.finish(status="interrupted", error="interrupted (SIGINT or SIGTERM)")
        where = record_of(self.run_dir, "what was measured so far") if self.is_server else ""
        note_recorded_stop(f"fedml-perfedavg: interrupted{where}")
        self._end_every_rank("interrupted", stopped_exit_code())

    def _end_every_rank(self, why: str, code: int) -> None:
        """Close the log; under MPI, rank 0's record is now written, so the whole job ends here
        with ``code``: the workers wait for a model that will never come, and FedML's receive
        threads would keep every process alive (FedML's own finish aborts the job the same way)."""
        mpi_server = self.config.comm.backend == "MPI" and self.is_server
        if mpi_server:
            logger.error("%s; ending every MPI rank (the record is in %s)", why, self.run_dir)
        self._close()
        if mpi_server:
            self.backend.end_job(code)

    def conclude(self) -> RunResult:
        """A run that went through: summary.json and model.pt, the log closed, the result."""
        summary = self.finish()
        self._close()
        parts = self.parts
        self.result = RunResult(
            summary, self.run_dir, self.algorithm, self.global_state, parts.trainer, parts.aggregator
        )
        return self.result

    def _close(self) -> None:
        logs.remove_handler(self.parts.log_handler)
        self.parts.log_handler = None
        release_run_dir(self.run_dir)  # the run is over: the folder is free for the next (a resume, say)


def install() -> None:
    """Install the plugin into FedML with this run layer behind it (what ``import
    fedml_perfedavg`` does)."""
    from ..fedml_bridge import install as install_bridge

    install_bridge(Entry())  # sys.excepthook stays as it is: a plugin run wraps it when it starts (run)


# -- FedML's main-script steps, for the command line and library calls --------------------------------
def fedml_args(
    config: Config,
    run_dir: Optional[str] = None,
    resume: bool = False,
    rank: Optional[int] = None,
    role: Optional[str] = None,
    run_id: str = "0",
) -> argparse.Namespace:
    """FedML's ``args`` for ``config`` (what ``fedml.init()`` would read from the YAML)."""
    args = to_fedml_args(config)
    setattr(args, CONTEXT, RunContext(config, requested_run_dir=run_dir, resume=resume))
    if config.common.training_type == "cross_silo":
        args.rank, args.role, args.run_id = rank, role, run_id
        args.worker_num, args.scenario = config.silo_count, "horizontal"
    return args


def prepare_fedml_run(
    args: argparse.Namespace, data: Optional[FederatedData] = None, model: Optional[torch.nn.Module] = None
):
    """FedML's example main script up to ``FedMLRunner(...)`` (``fedml.init``, device, data,
    model): the runner, not yet run. ``data`` (and ``model``) replace ``fedml.data.load`` (and
    ``fedml.model.create``) for a split the caller already holds."""
    install()
    import fedml
    from fedml import FedMLRunner

    from ..data.fedml_format import to_fedml_dataset
    from ..models import create_model

    args = fedml.init(args, should_init_logs=False)
    device = fedml.device.get_device(args)
    if data is None:
        dataset, output_dim = fedml.data.load(args)
    else:
        dataset, output_dim = to_fedml_dataset(data.users, data.num_classes, int(args.batch_size)), data.num_classes
        if model is None:
            torch.manual_seed(int(args.random_seed))
            model = create_model(args.model, data.input_shape, data.num_classes, args.hidden_sizes)
    if model is None:
        model = fedml.model.create(args, output_dim)
    return FedMLRunner(args, device, dataset, model)


def run_fedml_main(
    args: argparse.Namespace, data: Optional[FederatedData] = None, model: Optional[torch.nn.Module] = None
) -> RunResult:
    """What FedML's example main script does, returning the plugin run's result."""
    try:
        runner = prepare_fedml_run(args, data, model)
        runner.run()
    finally:  # however it ended (a failed start too), its folder is free for the next run of this process
        context = getattr(args, CONTEXT, None)
        if context is not None and context.run_dir is not None:
            release_run_dir(context.run_dir)
    return runner.runner.result


def run(
    config: Config,
    run_dir: Optional[str] = None,
    resume: bool = False,
    data: Optional[FederatedData] = None,
    model: Optional[torch.nn.Module] = None,
) -> RunResult:
    """Run ``config`` through FedML's entry points (sp: the batched engine or FedML's loop; MPI
    under ``mpirun``); returns when this process's part is over. ``data``/``model``: see
    :func:`run_fedml_main`."""
    logs.console_if_unconfigured()
    return run_fedml_main(fedml_args(config, run_dir, resume), data, model)


def run_grid(configs: List[Config], run_dirs: List[str], data: Optional[List[FederatedData]] = None) -> List[RunResult]:
    """Several runs of one cell (its seeds) in this process, their clients' local training one
    computation per round (:class:`~fedml_perfedavg.engine.grid.GridSimulation`); each run gets
    its own run directory and outputs, as if run alone. Runs that cannot share a computation
    (other client maths, the vmap path) run one after the other, with a log line saying why."""
    from ..engine.grid import GridSimulation, why_not_together

    logs.console_if_unconfigured()
    splits: List[Optional[FederatedData]] = list(data) if data else [None] * len(configs)
    runs = []
    for config, run_dir, split in zip(configs, run_dirs, splits):
        if (
            config.comm.backend != "sp"
            or config.train.simulation_engine != "batched"
            or config.common.training_type != "simulation"
        ):
            raise ConfigError(
                f"train_args.simulation_engine={config.train.simulation_engine!r}: grid mode runs the "
                f"batched engine on sp only"
            )
        args = fedml_args(config, run_dir)
        getattr(args, CONTEXT).grid = True  # wandb written at the end (one live wandb run per process)
        runs.append(prepare_fedml_run(args, split).runner)
    why = why_not_together([r.backend for r in runs])
    if why is not None or len({c.train.comm_round for c in configs}) != 1:
        logger.warning("grid: runs one after the other (%s)", why or "different comm_round")
        return [r.run() for r in runs]
    # Each run ends as it would alone (round_finished keeps every run's global state current).
    with contextlib.ExitStack() as stack:
        for r in runs:
            stack.enter_context(r.ending())
        GridSimulation([r.backend for r in runs]).run(0, configs[0].train.comm_round)
    return [r.conclude() for r in runs]
