"""FedML's single-process simulation running the trainer/aggregator it is given.

fedml/simulation/simulator.py ``SimulatorSingleProcess`` ignores ``client_trainer`` and
``server_aggregator``: it builds simulation/sp/fedavg/fedavg_api.py ``FedAvgAPI`` with FedML's
own trainer and sample-weighted ``_aggregate``. :class:`PluginFedAvgAPI` keeps FedML's round
loop (``FedAvgAPI.train``) and redirects what it calls: the trainer, aggregation (through the
aggregator's three hooks), and, for a plugin algorithm, client sampling and evaluation (the
run's :class:`~fedml_perfedavg.core.types.RoundDriver`). FedML also leaves ``args.round_idx`` unset in sp; it is
set here, where the round is known.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from .bootstrap import import_fedml
from ..core.types import RoundDriver
from .safeguards import plugin_dp_hidden
from .trainer_aggregator import aggregate_with_hooks

import_fedml()
from fedml.simulation.sp.fedavg.fedavg_api import FedAvgAPI  # noqa: E402

logger = logging.getLogger(__name__)


class PluginFedAvgAPI(FedAvgAPI):
    """FedML's sp FedAvg loop calling ``trainer`` and ``aggregator``; with a ``driver``, the
    driver samples clients and evaluates (a plugin algorithm), else FedML's own sampling and
    the aggregator's ``test_all`` on FedML's schedule (a user's own pair with ``FedAvg``)."""

    def __init__(
        self,
        args: Any,
        device: Any,
        dataset: list,
        model: Any,
        trainer: Any,
        aggregator: Any,
        driver: Optional[RoundDriver] = None,
    ) -> None:
        with plugin_dp_hidden(args):
            super().__init__(args, device, dataset, model)
        self.aggregator = aggregator
        self.driver = driver
        self.model_trainer = trainer
        for client in self.client_list:
            client.model_trainer = trainer

    def _client_sampling(self, round_idx: int, client_num_in_total: int, client_num_per_round: int) -> List[int]:
        self.args.round_idx = round_idx
        if self.driver is not None:
            return self.driver.sample_clients(round_idx)
        return super()._client_sampling(round_idx, client_num_in_total, client_num_per_round)

    def _aggregate(self, w_locals):
        w_global, _, _ = aggregate_with_hooks(self.aggregator, w_locals)
        self.aggregator.set_model_params(w_global)
        if self.driver is not None:
            self.driver.round_finished(self.args.round_idx, w_global)
        return w_global

    def _local_test_on_all_clients(self, round_idx: int) -> None:
        if self.driver is None:  # a plugin algorithm is evaluated by its driver, on the run's schedule
            self.aggregator.test_all(self.train_data_local_dict, self.test_data_local_dict, self.device, self.args)

    _local_test_on_validation_set = _local_test_on_all_clients


class SPSimulation:
    """``FedMLRunner``'s sp runner for a given trainer/aggregator pair (``run()`` runs it)."""

    def __init__(
        self,
        args: Any,
        device: Any,
        dataset: list,
        model: Any,
        trainer: Any,
        aggregator: Any,
        driver: Optional[RoundDriver] = None,
    ) -> None:
        self.fl_trainer = PluginFedAvgAPI(args, device, dataset, model, trainer, aggregator, driver)

    def run(self) -> None:
        self.fl_trainer.train()
