"""FedML's MPI simulation (simulation/mpi/fedavg) with the trainer/aggregator really used.

FedML builds its MPI server and clients from module-level names of
simulation/mpi/fedavg/FedAvgAPI.py; a plugin run builds the plugin's subclasses of them itself, as
that module's ``FedML_FedAvg_distributed`` would (:meth:`MPISimulation._fedavg_distributed`), and:
- ``FedAVGAggregator.aggregate`` (FedAVGAggregator.py) does its own sample-weighted average
  and never calls the ``ServerAggregator``'s aggregation hooks: replaced by the three hooks.
- ``FedAVGAggregator.client_sampling`` seeds numpy with the round alone, and
  ``test_on_server_for_all_clients`` evaluates every round when ``test_all`` returns True: for a
  plugin algorithm, the run's driver samples (keyed, as sp) and evaluates on the run's schedule.
- ``FedAVGTrainer.update_dataset`` (FedAVGTrainer.py) never tells the ``ClientTrainer`` which
  client it now is (``set_id``), so every round a rank would draw minibatches as the same
  client; it now does.
- FedML's MPI server has no timeout: a client rank that fails alone would leave the server
  waiting forever, so it logs why, marks the run's summary.json ``aborted`` (the server keeps
  it current after every evaluation) and aborts the whole job.
- FedML gives each worker rank one client per round, so ``client_num_per_round`` must be the
  number of ranks - 1. With more clients than workers, each worker gets a balanced, contiguous
  share of the round's sampled clients (:func:`balanced_shares`), sent where FedML sends a client
  index, and trains them as one computation (the run's ``share_trainer``: the batched engine);
  it sends back every client's model, not their sum: the server's aggregation checks each
  update, and FedML's attacks and defenses act on each (``PluginFedAVGClientManager``,
  ``PluginFedAVGTrainer``, ``PluginFedAVGAggregator``).
- ``FedAVGClientManager.handle_message_init`` (FedAvgClientManager.py) trains round 0 and waits for
  the next model, but a run of one round never sends one (FedAvgServerManager.py finishes when the
  round count is reached): the job hangs. A worker finishes after its last round here, FedML's own
  FedAvg included where its user asks (``common_args.plugin_fixes``: ``install.py``, the one place
  FedML's own classes are changed).
- Per-client state (an algorithm that ``keeps_client_state``, or DP-SGD's adaptive clip bounds:
  ``holds_client_states``): a client is trained by whichever
  worker its round assigns it to, so the server keeps every client's state, sends a client's with
  its assignment and takes it back with its update (:data:`CLIENT_STATES`, beside FedML's own
  message arguments); FedML's messages carry none.
- The clients' training figures (their local steps' loss and accuracy) travel with their updates
  (:data:`TRAINING`), for the server's record of each round.
- ``MpiCommunicationManager.handle_receive_message`` (communication/mpi/com_manager.py) polls
  its queue every 0.1 ms, 16% of a core per idle rank: it waits on the queue here
  (:func:`waiting_receive_loop`), FedML's own FedAvg included.
- A rank that fails before FedML's loop (its data, its device) would leave the others waiting
  for it there forever: every rank agrees to start or stops with its error (:func:`agree_to_start`).
FedML runs the MPI loop inside ``FedMLRunner``'s constructor; here it runs in ``run()``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .bootstrap import import_fedml
import torch

from ..core.types import RoundDriver
from ..algorithms.client_states import ClientStates
from ..core.training_record import TrainingRecord
from ..core.errors import ConfigError
from ..core.types import StateDict
from .safeguards import plugin_dp_hidden
from .trainer_aggregator import aggregate_with_hooks

import_fedml()
import fedml.simulation.mpi.fedavg.FedAvgAPI as mpi_api  # noqa: E402
from fedml.core.dp.fedml_differential_privacy import FedMLDifferentialPrivacy  # noqa: E402
from fedml.core.security.fedml_attacker import FedMLAttacker  # noqa: E402
from fedml.core.security.fedml_defender import FedMLDefender  # noqa: E402
from fedml.ml.aggregator.aggregator_creator import create_server_aggregator  # noqa: E402
from fedml.ml.trainer.trainer_creator import create_model_trainer  # noqa: E402
from fedml.simulation.mpi.fedavg.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


ShareTrainer = Callable[[int, List[int], StateDict], List[Tuple[int, StateDict]]]


def balanced_shares(clients: Sequence[int], workers: int) -> List[List[int]]:
    """The round's sampled clients in ``workers`` contiguous shares, in order, sizes differing by
    at most one (the first shares the larger): the same on every run of a config."""
    base, extra = divmod(len(clients), workers)
    shares, start = [], 0
    for worker in range(workers):
        size = base + (1 if worker < extra else 0)
        shares.append([int(c) for c in clients[start : start + size]])
        start += size
    return shares


def parse_assignment(text: str) -> "int | List[int]":
    """What the server's message says a worker trains: FedML's one client index, or a share."""
    value = json.loads(str(text))
    if isinstance(value, int) or (isinstance(value, list) and value and all(isinstance(c, int) for c in value)):
        return value
    raise ValueError(f"an MPI worker was sent {text!r}: neither a client index nor a list of them")


LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK")  # MPICH, Open MPI, PMI


def rank_device(args: Any, device: Any) -> Any:
    """One GPU per rank with ``device_args.using_gpu``: the rank's local rank on its host (as
    MPICH or Open MPI set it) modulo the host's GPUs. FedML's own mapping needs a
    ``gpu_mapping_file`` and silently trains on the CPU without one (device/gpu_mapping_mpi.py);
    given one, FedML's ``device`` is kept."""
    if not getattr(args, "using_gpu", False) or getattr(args, "gpu_mapping_file", None):
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device_args.using_gpu=True: MPI rank {args.process_id} sees no CUDA device; set using_gpu: "
            f"false, or run the ranks on GPU hosts"
        )
    local = next((os.environ[name] for name in LOCAL_RANK_VARIABLES if name in os.environ), args.process_id)
    return torch.device("cuda", int(local) % torch.cuda.device_count())


def agree_to_start(comm: Any, rank: int, error: Optional[BaseException]) -> None:
    """Every rank says whether it is ready (a collective: every rank calls it once, at the same
    point); if another rank failed, this one raises that rank's error, so that no rank waits in
    FedML's loop for one that never comes. A rank that failed itself returns, to raise its own.
    Without an MPI communicator (an MPI config started without mpirun) there is no one to tell."""
    if comm is None:
        return
    said = None if error is None else (type(error).__name__, str(error))
    failures = [(r, e) for r, e in enumerate(comm.allgather(said)) if e is not None and r != rank]
    if error is not None or not failures:
        return
    other, (kind, why) = failures[0]
    message = f"MPI rank {other} could not start ({kind}: {why}); every rank stops"
    raise ConfigError(message) if kind == "ConfigError" else RuntimeError(message)


class PluginFedAVGAggregator(mpi_api.FedAVGAggregator):
    """The MPI server's aggregation through the ``ServerAggregator``'s hooks; with a ``driver``
    (a plugin algorithm), its keyed sampling, in shares when the round has more clients than
    there are workers."""

    def __init__(self, *args: Any, driver: Optional[RoundDriver] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver = driver

    @property
    def in_shares(self) -> bool:
        return self.driver is not None and int(self.args.client_num_per_round) > self.worker_num

    def aggregate(self):
        if self.in_shares:  # each worker sent its share's (samples, model) pairs, in the round's order
            updates = [tuple(u) for i in range(self.worker_num) for u in self.model_dict[i]]
        else:
            updates = [(self.sample_num_dict[i], self.model_dict[i]) for i in range(self.worker_num)]
        w_global, _, _ = aggregate_with_hooks(self.aggregator, updates)
        self.set_global_model_params(w_global)
        return w_global

    def client_sampling(self, round_idx, client_num_in_total, client_num_per_round):
        if self.driver is None:
            return super().client_sampling(round_idx, client_num_in_total, client_num_per_round)
        clients = self.driver.sample_clients(round_idx)
        return balanced_shares(clients, self.worker_num) if self.in_shares else clients

    def test_on_server_for_all_clients(self, round_idx):
        if self.driver is not None:
            self.driver.round_finished(round_idx, self.get_global_model_params())
        else:
            super().test_on_server_for_all_clients(round_idx)


def finishing_after_one_round(handle_message_init: Callable) -> Callable:
    """FedML's worker's first handler, ending the worker when round 0 is the run's only round."""

    @functools.wraps(handle_message_init)
    def handler(self, msg_params):
        handle_message_init(self, msg_params)
        if int(self.num_rounds) == 1:
            self.finish()

    handler.__wrapped__ = handle_message_init
    return handler


WAKE_SECONDS = 0.05  # how soon a waiting rank sees a stop set from another thread


def waiting_receive_loop(comm_manager: Any) -> None:
    """core/distributed/communication/mpi/com_manager.py's ``handle_receive_message``, waiting on
    its queue instead of polling it every 0.1 ms (that loop kept an idle rank at 16% of a core:
    three ranks waiting on one another burned two thirds of a core): the same messages, handed to
    the same observers in the same order, with FedML's profiler events."""
    from fedml.core.mlops.mlops_profiler_event import MLOpsProfilerEvent

    comm_manager._notify_connection_ready()
    start = time.time()
    MLOpsProfilerEvent.log_to_wandb({"ListenStart": start})
    while not comm_manager._stop_running:
        try:
            message = comm_manager.q_receiver.get(timeout=WAKE_SECONDS)
        except queue.Empty:
            continue  # a stop set from another thread is seen within WAKE_SECONDS
        handling = time.time()
        comm_manager.notify(message)
        MLOpsProfilerEvent.log_to_wandb({"BusyTime": time.time() - handling})
    MLOpsProfilerEvent.log_to_wandb({"TotalTime": time.time() - start})
    logging.info("Handle receive message stopped!")


def waiting(manager: Any) -> None:
    """``manager``'s MPI receive loop is :func:`waiting_receive_loop` (this object's alone: FedML's
    class keeps its own)."""
    com = manager.com_manager
    if com is not None and hasattr(com, "q_receiver"):
        com.handle_receive_message = functools.partial(waiting_receive_loop, com)


CLIENT_STATES = "plugin_client_states"  # a message argument: {client: its own state}
TRAINING = "plugin_training"  # a message argument: [[client, loss, accuracy], ...] (training_record.py)


def _assigned(message: Any) -> List[int]:
    """The clients a server-to-worker message assigns (FedML's one index, or a share)."""
    assignment = parse_assignment(message.get(MyMessage.MSG_ARG_KEY_CLIENT_INDEX))
    return assignment if isinstance(assignment, list) else [assignment]


class PluginFedAVGServerManager(mpi_api.FedAVGServerManager):
    """FedML's MPI server, which also keeps the clients' own states (``client_states``, where the
    algorithm keeps any): each goes out with its client's assignment and comes back with its update;
    the clients' training figures come with it too, for the run's ``driver``."""

    def __init__(
        self,
        *args: Any,
        client_states: Optional[ClientStates] = None,
        driver: Optional[RoundDriver] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        waiting(self)
        self.client_states = client_states
        self.driver = driver

    def send_message(self, message: Any) -> None:
        assigns = (MyMessage.MSG_TYPE_S2C_INIT_CONFIG, MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
        if self.client_states is not None and message.get_type() in assigns:
            message.add_params(CLIENT_STATES, self.client_states.of(_assigned(message)))
        super().send_message(message)

    def handle_message_receive_model_from_client(self, msg_params):
        if self.client_states is not None:  # before the next round's assignments go out
            self.client_states.update(msg_params.get(CLIENT_STATES) or {})
        if self.driver is not None:  # before the round closes in FedML's handler
            for row in msg_params.get(TRAINING) or []:
                if isinstance(row, list) and len(row) == 3 and isinstance(row[0], int):
                    self.driver.record_training(int(self.args.round_idx), row[0], row[1:])
        super().handle_message_receive_model_from_client(msg_params)


class PluginFedAVGClientManager(mpi_api.FedAVGClientManager):
    """A worker that reads a share where FedML's message holds a client index (FedML's own
    handlers cast it with ``int``), and takes and returns its clients' own states (``client_states``)."""

    def __init__(
        self,
        *args: Any,
        client_states: Optional[ClientStates] = None,
        training: Optional[TrainingRecord] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        waiting(self)
        self.client_states = client_states
        self.training = training  # this rank's algorithm's record of its clients' training figures
        self.assigned: List[int] = []

    def _assignment(self, msg_params: Any) -> None:
        self.trainer.update_model(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
        self.assigned = _assigned(msg_params)
        if self.client_states is not None:
            self.client_states.update(msg_params.get(CLIENT_STATES) or {})
        self.trainer.update_dataset(parse_assignment(msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_INDEX)))

    def send_message(self, message: Any) -> None:
        if message.get_type() == MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER:
            if self.client_states is not None:
                message.add_params(CLIENT_STATES, self.client_states.of(self.assigned))
            if self.training is not None:
                message.add_params(TRAINING, self.training.of(int(self.args.round_idx), self.assigned))
        super().send_message(message)

    @finishing_after_one_round
    def handle_message_init(self, msg_params):
        self._assignment(msg_params)
        self.args.round_idx = 0
        self._FedAVGClientManager__train()

    def handle_message_receive_model_from_server(self, msg_params):
        self._assignment(msg_params)
        self.args.round_idx += 1
        self._FedAVGClientManager__train()
        if self.args.round_idx == self.num_rounds - 1:
            self.finish()


class PluginFedAVGTrainer(mpi_api.FedAVGTrainer):
    """An MPI worker that tells its ``ClientTrainer`` which client it trains, or trains its
    share of the round with ``share_trainer``; ``progress`` says which clients it is on."""

    def __init__(
        self,
        *args: Any,
        share_trainer: Optional[ShareTrainer] = None,
        progress: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.share_trainer = share_trainer
        self.share: Optional[List[int]] = None
        self.progress = progress if progress is not None else {}

    def update_dataset(self, client_index):
        if isinstance(client_index, list):
            if self.share_trainer is None:
                raise RuntimeError("this MPI worker was sent a share of clients but has no share trainer")
            self.share = client_index
            self.progress["clients"] = list(client_index)
            return
        self.share = None
        self.progress["clients"] = [int(client_index)]
        super().update_dataset(client_index)
        self.trainer.set_id(client_index)

    def train(self, round_idx=None):
        self.progress["round"] = round_idx
        if self.share is None:
            return super().train(round_idx)
        assert self.share_trainer is not None  # update_dataset takes a share only with one
        self.args.round_idx = round_idx
        start = {k: v.to(self.device) for k, v in self.trainer.get_model_params().items()}
        updates = self.share_trainer(round_idx, self.share, start)
        # Each client's tensors are views into its computation's stacked results; pickled as they
        # are, every view would carry the whole stack (all its clients' models): copied out, each
        # message holds the share's models once.
        return (
            [(int(n), {k: v.detach().to("cpu", copy=True) for k, v in state.items()}) for n, state in updates],
            sum(int(n) for n, _ in updates),
        )


class MPISimulation:
    """``FedMLRunner``'s MPI runner for a given trainer/aggregator pair (``run()`` runs this
    rank's part; with a ``driver``, the plugin algorithm's sampling and evaluation)."""

    def __init__(
        self,
        args: Any,
        device: Any,
        dataset: list,
        model: Any,
        trainer: Any,
        aggregator: Any,
        driver: Optional[RoundDriver] = None,
        share_trainer: Optional[ShareTrainer] = None,
        client_states: Optional[ClientStates] = None,
        training: Optional[TrainingRecord] = None,
    ) -> None:
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.trainer, self.aggregator, self.driver = trainer, aggregator, driver
        self.share_trainer = share_trainer
        self.client_states = client_states  # this rank's algorithm's, where its clients keep states
        self.training = training  # this rank's algorithm's training figures, where it records them
        self.progress: Dict[str, Any] = {}  # this worker's round and clients, for the record of a failure

    INTERRUPT_GRACE_SECONDS = 10.0

    def end_job(self, code: int) -> None:
        """End every rank of the job (FedML's MPI receive threads would keep the processes alive)."""
        logging.shutdown()
        self.args.comm.Abort(code)

    def run(self) -> None:
        """This rank's part of the job; a failing worker aborts it, saying why in the run's record."""
        args = self.args
        try:
            with plugin_dp_hidden(args):  # FedML's DP singleton knows no dpsgd: the algorithm applies it
                self._fedavg_distributed()
        except KeyboardInterrupt:  # the job is being stopped (SIGINT/SIGTERM to every rank): not a failure
            if args.process_id != 0:
                # Rank 0 records the interrupted run, then ends the job (:meth:`end_job`); this rank
                # ends it only if rank 0 has not within the grace period.
                time.sleep(self.INTERRUPT_GRACE_SECONDS)
                self.end_job(130)
            raise
        except BaseException as err:
            if args.process_id != 0:
                where = (
                    f" in round {self.progress['round']} training clients {self.progress['clients']}"
                    if "clients" in self.progress
                    else ""
                )
                logger.error("rank %d failed%s, aborting the MPI job: %s", args.process_id, where, err)
                if self.driver is not None:  # MPI_Abort kills the server: the run's record says why
                    self.driver.record_failure(f"MPI rank {args.process_id} failed{where}, the job was aborted: {err}")
                logging.shutdown()
                args.comm.Abort(1)
            raise

    def _fedavg_distributed(self) -> None:
        """simulation/mpi/fedavg/FedAvgAPI.py ``FedML_FedAvg_distributed``, with the plugin's classes
        constructed here (FedML's function looks its own up by module name): FedML's attack, defense
        and DP singletons set up from ``args`` as there, then this rank's server or worker."""
        args, model, device = self.args, self.model, self.device
        train_num, _, train_global, test_global, local_num, local_train, local_test, _ = self.dataset
        FedMLAttacker.get_instance().init(args)
        FedMLDefender.get_instance().init(args)
        FedMLDifferentialPrivacy.get_instance().init(args)
        rank, size, comm, backend = args.process_id, args.worker_num, args.comm, args.backend
        if rank == 0:
            aggregator = self.aggregator if self.aggregator is not None else create_server_aggregator(model, args)
            aggregator.set_id(-1)
            around = PluginFedAVGAggregator(
                train_global,
                test_global,
                train_num,
                local_train,
                local_test,
                local_num,
                size - 1,
                device,
                args,
                aggregator,
                driver=self.driver,
            )
            server = PluginFedAVGServerManager(
                args, around, comm, rank, size, backend, client_states=self.client_states, driver=self.driver
            )
            server.send_init_msg()
            server.run()
            return
        model_trainer = self.trainer if self.trainer is not None else create_model_trainer(model, args)
        model_trainer.set_id(rank - 1)
        trainer = PluginFedAVGTrainer(
            rank - 1,
            local_train,
            local_num,
            local_test,
            train_num,
            device,
            args,
            model_trainer,
            share_trainer=self.share_trainer,
            progress=self.progress,
        )
        worker = PluginFedAVGClientManager(
            args, trainer, comm, rank, size, backend, client_states=self.client_states, training=self.training
        )
        worker.run()
