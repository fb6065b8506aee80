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
from typing import Any, Iterator

import torch

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
