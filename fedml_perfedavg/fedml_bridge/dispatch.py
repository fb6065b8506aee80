"""``FedMLRunner`` (fedml/runner.py) choosing the plugin where FedML cannot.

FedML dispatches on ``federated_optimizer`` with a hard-coded if/elif per backend
(simulation/simulator.py; cross_silo/fedml_server.py, fedml_client.py), raising a bare
``Exception`` for other names, and its sp simulator ignores a trainer/aggregator handed to
``FedMLRunner`` (its MPI simulator skips the aggregation hooks). With the plugin installed:
- a plugin algorithm's name goes to the plugin's runner (every backend);
- where the run asks for the plugin's fixes (``common_args.plugin_fixes: true``) or hands the
  plugin's own pair (``create_fedml_pair``): a trainer/aggregator pair with FedML's ``FedAvg`` is
  really used, on sp by FedML's loop calling them (:mod:`.sp`), on MPI with the aggregation hooks
  called (:mod:`.mpi`) (FedML's cross-silo already calls every hook); a pair with another FedML
  algorithm, which FedML's simulators would drop, is an error;
- everything else is FedML's own path, unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from ..core.errors import ConfigError

logger = logging.getLogger(__name__)


def dispatching_init(
    original_init: Callable,
    is_plugin_algorithm: Callable[[Optional[str]], bool],
    build_plugin_runner: Callable[..., Any],
    asks_for_fixes: Callable[[Any], bool],
) -> Callable:
    """A replacement for ``FedMLRunner.__init__`` (see the module doc)."""

    @functools.wraps(original_init)
    def __init__(self, args, device, dataset, model, client_trainer=None, server_aggregator=None, algorithm_flow=None):
        optimizer = getattr(args, "federated_optimizer", None)
        own_pair = _is_plugin_pair(client_trainer) or _is_plugin_pair(server_aggregator)
        if algorithm_flow is not None or not (is_plugin_algorithm(optimizer) or asks_for_fixes(args) or own_pair):
            return original_init(self, args, device, dataset, model, client_trainer, server_aggregator, algorithm_flow)
        if getattr(args, "training_type", None) == "cross_silo" and hasattr(model, "state_dict"):
            from .cross_silo.transport import MODEL_SIZE_CAP
            from ..net.wire import default_size_cap

            setattr(args, MODEL_SIZE_CAP, default_size_cap(model.state_dict()))
        if is_plugin_algorithm(optimizer):
            self.runner = build_plugin_runner(args, device, dataset, model, client_trainer, server_aggregator)
            return None
        if client_trainer is None and server_aggregator is None:
            return original_init(self, args, device, dataset, model)
        training_type, backend = getattr(args, "training_type", None), getattr(args, "backend", None)
        if training_type == "simulation" and backend in ("sp", "MPI"):
            if optimizer != "FedAvg":
                raise ConfigError(
                    f"train_args.federated_optimizer={optimizer!r}: FedML's {backend} simulation of "
                    f"this algorithm ignores a trainer/aggregator handed to FedMLRunner; hand them "
                    f"with federated_optimizer 'FedAvg', or register your algorithm with "
                    f"fedml_perfedavg.algorithms.register"
                )
            from .mpi import MPISimulation
            from .sp import SPSimulation

            simulation = SPSimulation if backend == "sp" else MPISimulation
            logger.info(
                "FedML %s simulation runs the given %s / %s",
                backend,
                type(client_trainer).__name__,
                type(server_aggregator).__name__,
            )
            self.runner = simulation(args, device, dataset, model, client_trainer, server_aggregator)
            return None
        if training_type == "cross_silo" and optimizer != "FedAvg":
            raise ConfigError(
                f"train_args.federated_optimizer={optimizer!r}: FedML's cross-silo {optimizer} builds "
                f"its own trainer and aggregator and would ignore the ones handed to FedMLRunner"
            )
        return original_init(self, args, device, dataset, model, client_trainer, server_aggregator)

    __init__.__wrapped__ = original_init
    return __init__


def _is_plugin_pair(part: Any) -> bool:
    """Whether ``part`` is the plugin's trainer or aggregator (``create_fedml_pair``'s)."""
    from .trainer_aggregator import AlgorithmClientTrainer, AlgorithmServerAggregator

    return isinstance(part, (AlgorithmClientTrainer, AlgorithmServerAggregator))
