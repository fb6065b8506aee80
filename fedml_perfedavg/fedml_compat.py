"""Every workaround for a defect of FedML 0.9.6 lives here, each naming the FedML file it
works around and why. Nothing else in the package patches FedML.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .guards import SiloFailure

logger = logging.getLogger(__name__)
_torchvision_schemas = None  # keeps the torch.library definitions alive


def make_torchvision_importable() -> None:
    """PyPI's torchvision wheels are CUDA builds: beside a CPU torch their compiled ops fail to
    load and ``torchvision/_meta_registrations.py`` raises "operator torchvision::nms does not
    exist" at import. ``import fedml`` imports torchvision (core/alg_frame/client_trainer.py ->
    core/security/...), so FedML breaks too. Load the extension if it can be loaded; else
    declare the two operator schemas the meta registrations need. Only ``torchvision.ops``
    is then unavailable, which nothing here uses."""
    global _torchvision_schemas
    if "torchvision" in sys.modules or _torchvision_schemas is not None:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for lib in glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so")):
        try:
            torch.ops.load_library(lib)
            return
        except (OSError, RuntimeError):
            pass
    library = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_schemas = library
    logger.debug("torchvision's compiled ops could not be loaded; declared nms/qnms schemas instead")


def import_fedml():
    """``import fedml`` after making torchvision importable."""
    make_torchvision_importable()
    with warnings.catch_warnings():
        # computing/scheduler/comm_utils/sys_utils.py imports the deprecated pkg_resources.
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
        import fedml

    return fedml


def _offline_fetch_config(fedml_dir: str):
    def fetch_config(args: Any, version: str = "release") -> bool:
        # Same attributes as fedml.core.mlops.fetch_config sets, without its 5 POSTs to
        # FedML's cloud config service (core/mlops/mlops_configs.py).
        os.makedirs(fedml_dir, exist_ok=True)
        args.current_running_dir = fedml_dir
        args.os_name = "MacOS" if platform.system() == "Darwin" else platform.system()
        args.version = version
        args.log_file_dir = os.path.join(fedml_dir, "logs")
        args.device_id = f"local-{getattr(args, 'rank', 0)}"
        args.config_version = version
        args.cloud_region = ""
        return False

    return fetch_config


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# Modules that write under ``expanduser("~")/.fedml`` during a run: fedml/runner.py
# (``log_runner_result``: fedml_trace/<pid>), computing/scheduler/slave/client_constants.py and
# master/server_constants.py (global_services/.env, written by ``fedml.init``'s
# ``set_env_version``), computing/scheduler/comm_utils/sys_utils.py.
_HOME_WRITERS = (
    "fedml.runner",
    "fedml.computing.scheduler.slave.client_constants",
    "fedml.computing.scheduler.master.server_constants",
    "fedml.computing.scheduler.comm_utils.sys_utils",
)


def redirect_fedml_home(home: str) -> None:
    """Make FedML write its ``~/.fedml`` files under ``home`` instead of the user's home.

    Those modules call ``os.path.expanduser`` through a module-level name, so only their
    view of ``~`` changes; wandb and everything else still see the real home.
    """
    import importlib

    home = os.path.abspath(home)

    def expanduser(path: str) -> str:
        return home + path[1:] if path == "~" or path.startswith("~/") else os.path.expanduser(path)

    import_fedml()
    for name in _HOME_WRITERS:
        importlib.import_module(name).expanduser = expanduser


def init_fedml_offline(args: Any, fedml_dir: str) -> Any:
    """``fedml.init`` with no traffic leaving the machine and FedML's files under ``fedml_dir``.

    fedml/__init__.py -> core/mlops/__init__.py ``init`` always calls ``fetch_config``, which
    POSTs to FedML's cloud 5 times whatever the YAML says; it is replaced for the call.
    ``check_env=False`` stops cross-silo's probe of FedML's hosts (collect_env.py).
    ``should_init_logs=False`` keeps FedML from replacing the root logger and rewriting
    ``sys.stdout.write`` (core/mlops/mlops_runtime_log.py ``init_logs``).
    ``sys_perf_profiling=False``: its profiler (mlops_profiler_event.py) is for FedML's cloud.
    """
    fedml = import_fedml()
    from fedml.core import mlops as mlops_module

    args.sys_perf_profiling = False
    with _replaced(mlops_module, "fetch_config", _offline_fetch_config(fedml_dir)):
        return fedml.init(args, check_env=False, should_init_logs=False)


def build_sp_runner(args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any):
    """A ``FedMLRunner`` whose single-process simulator really uses the plugin's classes.

    fedml/simulation/simulator.py ``SimulatorSingleProcess`` ignores ``client_trainer`` and
    ``server_aggregator`` and builds ``simulation/sp/fedavg/fedavg_api.py FedAvgAPI`` with
    FedML's own trainer and sample-weighted ``_aggregate``. FedML's round loop
    (``FedAvgAPI.train``) is kept; only what it calls is redirected: the trainer, client
    sampling (FedML seeds with the round alone, and sets no ``args.round_idx``), aggregation
    (through the aggregator's three hooks) and evaluation (``test_all``: personalized).
    """
    import_fedml()
    import fedml.simulation.sp.fedavg as sp_fedavg
    from fedml import FedMLRunner

    from .sampling import sample_clients

    class PluginFedAvgAPI(sp_fedavg.FedAvgAPI):
        def __init__(self, args, device, dataset, model):
            super().__init__(args, device, dataset, model)
            self.model_trainer = trainer
            for client in self.client_list:
                client.model_trainer = trainer

        def _client_sampling(self, round_idx, client_num_in_total, client_num_per_round):
            self.args.round_idx = round_idx
            return sample_clients(self.args.random_seed, round_idx, client_num_in_total, client_num_per_round,
                                  getattr(self.args, "new_user_fraction", 0.0))

        def _aggregate(self, w_locals):
            w_locals, _ = aggregator.on_before_aggregation(w_locals)
            w_global = aggregator.on_after_aggregation(aggregator.aggregate(w_locals))
            aggregator.set_model_params(w_global)
            return w_global

        def _local_test_on_all_clients(self, round_idx):
            aggregator.test_all(self.train_data_local_dict, self.test_data_local_dict, self.device, self.args)

        _local_test_on_validation_set = _local_test_on_all_clients

    if getattr(args, "federated_optimizer", None) != "FedAvg":
        raise ValueError("FedML must be given federated_optimizer='FedAvg' to build its sp simulator")
    with _replaced(sp_fedavg, "FedAvgAPI", PluginFedAvgAPI):
        runner = FedMLRunner(args, device, dataset, model, trainer, aggregator)
    if not isinstance(runner.runner.fl_trainer, PluginFedAvgAPI):
        raise RuntimeError("FedML's sp simulator did not build the plugin's FedAvgAPI; FedML version changed?")
    return runner


def build_mpi_runner(args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any):
    """Run FedML's MPI simulation (simulation/mpi/fedavg) with the plugin's classes really used.

    FedML builds them from module-level names of simulation/mpi/fedavg/FedAvgAPI.py, and:
    - ``FedAVGAggregator.aggregate`` (FedAVGAggregator.py) does its own sample-weighted
      average and never calls the ``ServerAggregator``'s aggregation hooks; replaced by the
      plugin aggregator's three hooks.
    - ``FedAVGAggregator.client_sampling`` seeds numpy with the round alone; replaced by the
      plugin's keyed sampler, so MPI samples the same clients as sp.
    - ``FedAVGTrainer.update_dataset`` (FedAVGTrainer.py) never tells the ``ClientTrainer``
      which client it now is (``set_id``), so every round a rank would draw its minibatches
      as the same client; it now does.
    FedML's MPI loop runs inside the ``FedMLRunner`` constructor (SimulatorMPI), so this
    returns once the rank's part of the run is over.
    """
    import_fedml()
    import fedml.simulation.mpi.fedavg.FedAvgAPI as mpi_api
    from fedml import FedMLRunner

    from .sampling import sample_clients

    class PluginFedAVGAggregator(mpi_api.FedAVGAggregator):
        def aggregate(self):
            updates = [(self.sample_num_dict[i], self.model_dict[i]) for i in range(self.worker_num)]
            updates, _ = aggregator.on_before_aggregation(updates)
            w_global = aggregator.on_after_aggregation(aggregator.aggregate(updates))
            self.set_global_model_params(w_global)
            return w_global

        def client_sampling(self, round_idx, client_num_in_total, client_num_per_round):
            return sample_clients(self.args.random_seed, round_idx, client_num_in_total, client_num_per_round,
                                  getattr(self.args, "new_user_fraction", 0.0))

    class PluginFedAVGTrainer(mpi_api.FedAVGTrainer):
        def update_dataset(self, client_index):
            super().update_dataset(client_index)
            self.trainer.set_id(client_index)

    if getattr(args, "federated_optimizer", None) != "FedAvg":
        raise ValueError("FedML must be given federated_optimizer='FedAvg' to build its MPI simulator")
    with _replaced(mpi_api, "FedAVGAggregator", PluginFedAVGAggregator), \
            _replaced(mpi_api, "FedAVGTrainer", PluginFedAVGTrainer):
        return FedMLRunner(args, device, dataset, model, trainer, aggregator)


# ---------------------------------------------------------------------------------------------
# Cross-silo over gRPC (fedml/cross_silo, core/distributed/communication/grpc)
# ---------------------------------------------------------------------------------------------

SILO_METRICS = "plugin_silo_metrics"  # message parameter: a silo's own personalized evaluation
IDLE_TICK_SECONDS = 0.2


@dataclass(frozen=True)
class SiloPolicy:
    """How cross-silo processes wait for each other and what they do when a peer is gone."""

    connect_timeout: float  # keep retrying a peer that is not listening this long
    round_timeout: float  # the server waits this long for silos in any phase
    min_clients: int  # after round_timeout, go on if at least this many silos answered
    random_seed: int
    new_user_fraction: float

    @property
    def client_idle_limit(self) -> float:
        """A silo that hears nothing from the server this long gives up."""
        return 2 * self.round_timeout + self.connect_timeout


class PeerUnreachable(SiloFailure):
    """A peer stayed unreachable for the whole retry window."""


def _grpc_comm_manager_class(policy: SiloPolicy):
    import pickle
    import queue

    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager as module

    class PluginGRPCCommManager(module.GRPCCommManager):
        """FedML's gRPC transport with three defects of grpc_comm_manager.py fixed:

        - ``send_message`` dies on the first ``UNAVAILABLE``, so a silo started before the server
          crashes; here it retries with exponential backoff for ``connect_timeout`` seconds.
        - ``message_handling_subroutine`` polls ``message_q.qsize()`` with its sleep outside the
          loop, so every waiting process spins a core; here it blocks on the queue and gives
          observers an ``on_idle`` tick, where deadlines are checked.
        - it learns the address of any unknown sender from the message itself; here messages
          from ranks that are not in the address file are dropped.
        """

        retry_seconds = policy.connect_timeout

        def send_message(self, msg):
            deadline = time.monotonic() + self.retry_seconds
            delay = 0.1
            while True:
                try:
                    return super().send_message(msg)
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    receiver = int(msg.get_receiver_id())
                    mapping = self.grpc_mappings[receiver]
                    where = f"{mapping.grpc_server_ip}:{mapping.grpc_server_port}"
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PeerUnreachable(f"rank {receiver} at {where} did not answer rank {self.client_rank} "
                                              f"for {self.retry_seconds:g} s (comm_args.connect_timeout)") from None
                    logger.info("rank %d at %s is not reachable yet; retrying in %.1f s", receiver, where, delay)
                    time.sleep(min(delay, left))
                    delay = min(2 * delay, 5.0)

        def message_handling_subroutine(self):
            while self.is_running:
                try:
                    msg_pkl = self.grpc_servicer.message_q.get(timeout=IDLE_TICK_SECONDS)
                except queue.Empty:
                    for observer in list(self._observers):
                        on_idle = getattr(observer, "on_idle", None)
                        if on_idle is not None:
                            on_idle()
                    continue
                msg = pickle.loads(msg_pkl)  # only trusted silos may connect (README)
                sender = int(msg.get_sender_id())
                if sender not in self.grpc_mappings:
                    logger.warning("dropped a message from rank %d, which is not in %s", sender,
                                   self.grpc_ipconfig_path)
                    continue
                for observer in list(self._observers):
                    observer.receive_message(msg.get_type(), msg)

    return PluginGRPCCommManager


@contextlib.contextmanager
def _no_retry(manager: Any) -> Iterator[None]:
    comm = manager.com_manager
    saved = comm.retry_seconds
    comm.retry_seconds = 0.0
    try:
        yield
    finally:
        comm.retry_seconds = saved


def _silo_server_classes(policy: SiloPolicy):
    from fedml.core.distributed.communication.message import Message
    from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator
    from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
    from fedml.cross_silo.server.message_define import MyMessage

    from .config import ConfigError
    from .sampling import sample_clients

    class PluginFedMLAggregator(FedMLAggregator):
        """fedml_aggregator.py keeps one upload slot per silo forever and averages all of them
        (stale ones too if a silo is gone), and samples with ``np.random.seed(round)``. Here the
        round's users come from the plugin's keyed sampler (silo k trains the k-th sampled user, as
        the k-th client of an sp round), and only this round's uploads are averaged."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lost: set = set()  # silo ids given up on
            self.updates: Dict[int, Tuple[float, Any]] = {}  # position -> upload of the open round
            self.live_positions: List[int] = []

        def client_selection(self, round_idx, client_id_list_in_total, client_num_per_round):
            ids = list(client_id_list_in_total)
            if len(ids) != client_num_per_round:
                raise ConfigError(f"train_args.client_num_per_round={client_num_per_round!r}: must equal the number "
                                  f"of silos ({len(ids)}): each silo trains one sampled user per round")
            self.live_positions = [p for p, silo in enumerate(ids) if silo not in self.lost]
            return [ids[p] for p in self.live_positions]

        def data_silo_selection(self, round_idx, client_num_in_total, client_num_per_round):
            users = sample_clients(policy.random_seed, round_idx, client_num_in_total, self.args.client_num_per_round,
                                   policy.new_user_fraction)
            return [int(users[p]) for p in self.live_positions]

        def add_local_trained_result(self, index, model_params, sample_num):
            self.updates[index] = (sample_num, model_params)

        def check_whether_all_receive(self):
            return all(p in self.updates for p in self.live_positions)

        def aggregate(self):
            model_list = [self.updates[p] for p in sorted(self.updates)]  # sp's order of sampled users
            self.updates = {}
            model_list, model_list_idxes = self.aggregator.on_before_aggregation(model_list)
            averaged = self.aggregator.on_after_aggregation(self.aggregator.aggregate(model_list))
            self.set_global_model_params(averaged)
            return averaged, model_list, model_list_idxes

    class PluginServerManager(FedMLServerManager):
        """fedml_server_manager.py waits for every silo in every phase with no limit, so one dead
        silo hangs the server forever; selects round r+1's silos with round r's seed; and sleeps 5 s
        before finishing. Here each phase has a deadline (silos coming online: ``connect_timeout``;
        a round's uploads and the final goodbyes: ``round_timeout``): then the server goes on with
        the silos that answered if at least ``min_clients`` did, or stops naming the missing ranks.
        Silos' own personalized evaluations ride on their messages and are logged."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.phase = "online"
            self.deadline: Optional[float] = None
            self.finished: set = set()
            self.silo_metrics: Dict[int, Dict[str, Any]] = {}  # silo -> its last evaluation
            self.recorder = getattr(self.aggregator.aggregator, "recorder", None)

        # -- phases ---------------------------------------------------------------------------
        def _open_phase(self, phase: str) -> None:
            self.phase = phase
            # Coming online includes the silos' start-up (imports, data): connect_timeout.
            wait = policy.connect_timeout if phase == "online" else policy.round_timeout
            self.deadline = time.monotonic() + wait

        def _select(self) -> None:
            self.client_id_list_in_this_round = self.aggregator.client_selection(
                self.args.round_idx, self.client_real_ids, self.args.client_num_per_round)
            self.data_silo_index_list = self.aggregator.data_silo_selection(
                self.args.round_idx, self.args.client_num_in_total, len(self.client_id_list_in_this_round))

        def handle_message_connection_ready(self, msg_params):
            # FedML pings every silo here and swallows the errors; silos announce themselves
            # (retrying until the server listens), so the server only starts its clock.
            if self.client_id_list_in_this_round is None:
                self._select()
                self._open_phase("online")
                logger.info("server listening; waiting for silos %s", self.client_id_list_in_this_round)

        def process_online_status(self, client_status, msg_params):
            self.client_online_mapping[str(msg_params.get_sender_id())] = True
            if self.phase == "online" and all(self.client_online_mapping.get(str(s), False)
                                              for s in self.client_id_list_in_this_round):
                self._start_training()

        def _start_training(self) -> None:
            self.is_initialized = True
            # From now on a silo that cannot be reached was up before: give it round_timeout at most.
            self.com_manager.retry_seconds = min(policy.connect_timeout, policy.round_timeout)
            logger.info("silos %s online; round 0 starts", self.client_id_list_in_this_round)
            self._send_models(MyMessage.MSG_TYPE_S2C_INIT_CONFIG)
            self._open_phase("training")

        def _send_models(self, msg_type: str) -> None:
            params = self.aggregator.get_global_model_params()
            unreachable = []
            for silo, user in zip(list(self.client_id_list_in_this_round), list(self.data_silo_index_list)):
                message = Message(msg_type, self.get_sender_id(), silo)
                message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, params)
                message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(user))
                message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, "PythonClient")
                try:
                    self.send_message(message)
                except PeerUnreachable as err:
                    logger.warning("%s", err)
                    unreachable.append(silo)
            if unreachable:
                self._give_up_on(unreachable, f"unreachable for {self.com_manager.retry_seconds:g} s (comm_args."
                                              f"connect_timeout and round_timeout)")

        def _give_up_on(self, silos: List[int], why: str) -> None:
            live = [s for s in self.client_id_list_in_this_round if s not in silos]
            if len(live) < policy.min_clients:
                self._stop(f"round {self.args.round_idx}: silo rank(s) {sorted(silos)} {why}; {len(live)} left, "
                           f"fewer than comm_args.min_clients_per_round={policy.min_clients}")
            logger.warning("round %d: going on without silo rank(s) %s (%s); %d left, comm_args."
                           "min_clients_per_round=%d", self.args.round_idx, sorted(silos), why, len(live),
                           policy.min_clients)
            self.aggregator.lost.update(silos)
            keep = [i for i, s in enumerate(self.client_id_list_in_this_round) if s not in silos]
            self.client_id_list_in_this_round = [self.client_id_list_in_this_round[i] for i in keep]
            self.data_silo_index_list = [self.data_silo_index_list[i] for i in keep]
            self.aggregator.live_positions = [p for p in self.aggregator.live_positions
                                              if self.client_real_ids[p] not in silos]

        def _stop(self, reason: str) -> None:
            # Tell the silos still there to end, without waiting on any that do not answer.
            with _no_retry(self):
                for silo, user in zip(list(self.client_id_list_in_this_round), list(self.data_silo_index_list)):
                    try:
                        self.send_message_finish(silo, user)
                    except Exception:  # noqa: BLE001 - a silo that is gone cannot be told
                        pass
            self.com_manager.stop_receive_message()
            raise SiloFailure(reason)

        def on_idle(self) -> None:
            if self.deadline is None or time.monotonic() < self.deadline:
                return
            self.deadline = None
            expected = list(self.client_id_list_in_this_round)
            if self.phase == "online":
                answered = [s for s in expected if self.client_online_mapping.get(str(s), False)]
                what = f"did not come online within comm_args.connect_timeout={policy.connect_timeout:g} s"
            elif self.phase == "training":
                answered = [self.client_real_ids[p] for p in self.aggregator.updates]
                what = f"sent no update within comm_args.round_timeout={policy.round_timeout:g} s"
            else:
                answered = [s for s in expected if s in self.finished]
                logger.warning("no goodbye from silo rank(s) %s within comm_args.round_timeout=%g s; the run is "
                               "complete", sorted(set(expected) - set(answered)), policy.round_timeout)
                self._complete()
                return
            missing = [s for s in expected if s not in answered]
            self._give_up_on(missing, what)
            if self.phase == "online":
                self._start_training()
            else:
                self._finish_round()

        # -- rounds ---------------------------------------------------------------------------
        def _note_silo_metrics(self, msg_params) -> None:
            metrics = msg_params.get(SILO_METRICS)
            if metrics is not None:
                self.silo_metrics[int(msg_params.get_sender_id())] = metrics

        def _log_silo_metrics(self, label: str) -> None:
            entries = [self.silo_metrics[s] for s in sorted(self.silo_metrics)]
            if not entries:
                return
            mean = sum(e["accuracy"] for e in entries) / len(entries)
            logger.info("%s: silos' own personalized accuracy %.4f (model they received, mean of %d silos, each on "
                        "its user: %s)", label,
                        mean, len(entries), ", ".join(f"rank {s} user {e['user']} {e['accuracy']:.4f}"
                                                      for s, e in sorted(self.silo_metrics.items())))
            if self.recorder is not None:
                self.recorder.record_silo_evaluation(label, mean, dict(self.silo_metrics))
            self.silo_metrics = {}

        def handle_message_receive_model_from_client(self, msg_params):
            sender = int(msg_params.get(MyMessage.MSG_ARG_KEY_SENDER))
            if self.phase != "training" or sender not in self.client_id_list_in_this_round:
                logger.warning("ignored an update from silo rank %d (not expected now)", sender)
                return
            self._note_silo_metrics(msg_params)
            self.aggregator.add_local_trained_result(self.client_real_ids.index(sender),
                                                     msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                                                     msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES))
            if self.aggregator.check_whether_all_receive():
                self._finish_round()

        def _finish_round(self) -> None:
            round_idx = self.args.round_idx
            self.aggregator.aggregate()
            self.aggregator.test_on_server_for_all_clients(round_idx)
            self._log_silo_metrics(f"round {round_idx}")
            self.args.round_idx = round_idx + 1
            self._select()
            self._send_models(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
            self._open_phase("training" if self.args.round_idx < self.round_num else "finishing")

        def process_finished_status(self, client_status, msg_params):
            self.finished.add(int(msg_params.get_sender_id()))
            self._note_silo_metrics(msg_params)
            if self.phase == "finishing" and all(s in self.finished for s in self.client_id_list_in_this_round):
                self._complete()

        def _complete(self) -> None:
            self._log_silo_metrics("final")
            self.deadline = None
            self.finish()

    return PluginFedMLAggregator, PluginServerManager


def _silo_client_classes(policy: SiloPolicy):
    from fedml.core.distributed.communication.message import Message
    from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
    from fedml.cross_silo.client.fedml_trainer import FedMLTrainer
    from fedml.cross_silo.client.fedml_trainer_dist_adapter import TrainerDistAdapter
    from fedml.cross_silo.client.message_define import MyMessage

    class PluginFedMLTrainer(FedMLTrainer):
        """cross_silo/client/fedml_trainer.py never tells the ``ClientTrainer`` which user it now
        trains (``set_id``), so minibatches would be drawn as the silo's first user. Each model
        received is also evaluated here, personalized, on the silo's user of that round."""

        models_received = 0
        last_metrics: Optional[Dict[str, Any]] = None

        def update_dataset(self, client_index):
            super().update_dataset(client_index)
            self.trainer.set_id(client_index)

        def update_model(self, weights):
            super().update_model(weights)
            round_idx = self.models_received  # the model after this many rounds
            self.models_received += 1
            self.args.round_idx = round_idx
            result = self.trainer.test(self.test_local, self.device, self.args)
            total = result["test_total"]
            self.last_metrics = {"round": round_idx, "user": int(self.client_index),
                                 "accuracy": result["test_correct"] / total,
                                 "accuracy_before_adaptation": result["test_correct_before_adaptation"] / total}

    class PluginTrainerDistAdapter(TrainerDistAdapter):
        def get_trainer(self, client_index, train_data_local_dict, train_data_local_num_dict, test_data_local_dict,
                        train_data_num, device, args, model_trainer):
            return PluginFedMLTrainer(client_index, train_data_local_dict, train_data_local_num_dict,
                                      test_data_local_dict, train_data_num, device, args, model_trainer)

        def update_dataset(self, client_index=None):
            # fedml_trainer_dist_adapter.py: ``client_index or self.client_index`` turns user 0
            # into the silo's own index.
            self.trainer.update_dataset(int(self.client_index if client_index is None else client_index))

    class PluginClientMasterManager(ClientMasterManager):
        """fedml_client_master_manager.py: a silo waits for the server forever, and its
        evaluations never reach the server. Here a silo that hears nothing from the server for
        ``2 * round_timeout + connect_timeout`` stops, and its evaluation of the model it received
        rides on its upload (and on its goodbye, for the final model)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.last_heard = time.monotonic()

        def receive_message(self, msg_type, msg_params) -> None:
            self.last_heard = time.monotonic()
            super().receive_message(msg_type, msg_params)

        def on_idle(self) -> None:
            if time.monotonic() - self.last_heard > policy.client_idle_limit:
                self.com_manager.stop_receive_message()
                raise SiloFailure(f"silo rank {self.rank}: nothing from the server for {policy.client_idle_limit:g} s "
                                  f"(2 x comm_args.round_timeout + comm_args.connect_timeout)")

        def handle_message_finish(self, msg_params):
            logger.warning("silo rank %d: the server ended the run early", self.rank)
            self.finish()

        def _metrics(self) -> Optional[Dict[str, Any]]:
            return self.trainer_dist_adapter.trainer.last_metrics

        def send_model_to_server(self, receive_id, weights, local_sample_num):
            message = Message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self.client_real_id, receive_id)
            message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, weights)
            message.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, local_sample_num)
            message.add_params(SILO_METRICS, self._metrics())
            self.send_message(message)

        def send_client_status(self, receive_id, status=ClientMasterManager.ONLINE_STATUS_FLAG):
            message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, receive_id)
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, status)
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
            if status == ClientMasterManager.RUN_FINISHED_STATUS_FLAG:
                message.add_params(SILO_METRICS, self._metrics())
            self.send_message(message)

    return PluginTrainerDistAdapter, PluginClientMasterManager


def run_silo(args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any,
             policy: SiloPolicy) -> None:
    """Run this process's part (``args.role``) of a cross-silo run over gRPC with the plugin's
    classes really used; returns when the run is over for this process."""
    import_fedml()
    import fedml.core.distributed.communication.grpc.grpc_comm_manager as grpc_module
    import fedml.cross_silo.client.client_initializer as client_init
    import fedml.cross_silo.server.server_initializer as server_init
    from fedml import FedMLRunner

    if getattr(args, "federated_optimizer", None) != "FedAvg":
        raise ValueError("FedML must be given federated_optimizer='FedAvg' to build its cross-silo runner")
    managers: List[Any] = []

    def remembered(cls):
        class Remembered(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                managers.append(self)

        Remembered.__name__ = cls.__name__
        return Remembered

    with contextlib.ExitStack() as patches:
        patches.enter_context(_replaced(grpc_module, "GRPCCommManager", _grpc_comm_manager_class(policy)))
        if args.role == "server":
            aggregator_cls, manager_cls = _silo_server_classes(policy)
            patches.enter_context(_replaced(server_init, "FedMLAggregator", aggregator_cls))
            patches.enter_context(_replaced(server_init, "FedMLServerManager", remembered(manager_cls)))
        else:
            adapter_cls, manager_cls = _silo_client_classes(policy)
            patches.enter_context(_replaced(client_init, "TrainerDistAdapter", adapter_cls))
            patches.enter_context(_replaced(client_init, "ClientMasterManager", remembered(manager_cls)))
        try:
            FedMLRunner(args, device, dataset, model, trainer, aggregator)  # runs until this process is done
        finally:
            for manager in managers:  # no gRPC server threads left behind on an error
                if manager.com_manager is not None and manager.com_manager.is_running:
                    manager.com_manager.stop_receive_message()
