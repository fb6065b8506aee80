"""FedML's MPI simulation (simulation/mpi/fedavg) with the trainer/aggregator really used.

FedML builds its MPI server and clients from module-level names of
simulation/mpi/fedavg/FedAvgAPI.py, and:
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
FedML runs the MPI loop inside ``FedMLRunner``'s constructor; here it runs in ``run()``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from .bootstrap import import_fedml, replaced
from ..algorithms.base import RoundDriver

import_fedml()
import fedml.simulation.mpi.fedavg.FedAvgAPI as mpi_api  # noqa: E402

logger = logging.getLogger(__name__)


class PluginFedAVGAggregator(mpi_api.FedAVGAggregator):
    """The MPI server's aggregation through the ``ServerAggregator``'s hooks."""

    driver: Optional[RoundDriver] = None

    def aggregate(self):
        updates = [(self.sample_num_dict[i], self.model_dict[i]) for i in range(self.worker_num)]
        updates, _ = self.aggregator.on_before_aggregation(updates)
        w_global = self.aggregator.on_after_aggregation(self.aggregator.aggregate(updates))
        self.set_global_model_params(w_global)
        return w_global

    def client_sampling(self, round_idx, client_num_in_total, client_num_per_round):
        if self.driver is not None:
            return self.driver.sample_clients(round_idx)
        return super().client_sampling(round_idx, client_num_in_total, client_num_per_round)

    def test_on_server_for_all_clients(self, round_idx):
        if self.driver is not None:
            self.driver.round_finished(round_idx, self.get_global_model_params())
        else:
            super().test_on_server_for_all_clients(round_idx)


class PluginFedAVGTrainer(mpi_api.FedAVGTrainer):
    """An MPI client that tells its ``ClientTrainer`` which client it trains."""

    def update_dataset(self, client_index):
        super().update_dataset(client_index)
        self.trainer.set_id(client_index)


class MPISimulation:
    """``FedMLRunner``'s MPI runner for a given trainer/aggregator pair (``run()`` runs this
    rank's part; with a ``driver``, the plugin algorithm's sampling and evaluation)."""

    def __init__(self, args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any,
                 driver: Optional[RoundDriver] = None) -> None:
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.trainer, self.aggregator, self.driver = trainer, aggregator, driver

    INTERRUPT_GRACE_SECONDS = 10.0

    def end_job(self, code: int) -> None:
        """End every rank of the job (FedML's MPI receive threads would keep the processes alive)."""
        logging.shutdown()
        self.args.comm.Abort(code)

    def run(self) -> None:
        aggregator_cls = type("PluginFedAVGAggregator", (PluginFedAVGAggregator,), {"driver": self.driver})
        args = self.args
        with replaced(mpi_api, "FedAVGAggregator", aggregator_cls), \
                replaced(mpi_api, "FedAVGTrainer", PluginFedAVGTrainer):
            try:
                mpi_api.FedML_FedAvg_distributed(args, args.process_id, args.worker_num, args.comm, self.device,
                                                 self.dataset, self.model, client_trainer=self.trainer,
                                                 server_aggregator=self.aggregator)
            except KeyboardInterrupt:  # the job is being stopped (SIGINT/SIGTERM to every rank): not a failure
                if args.process_id != 0:
                    # Rank 0 records the interrupted run, then ends the job (:meth:`end_job`); this rank
                    # ends it only if rank 0 has not within the grace period.
                    time.sleep(self.INTERRUPT_GRACE_SECONDS)
                    self.end_job(130)
                raise
            except BaseException as err:
                if args.process_id != 0:
                    logger.error("rank %d failed, aborting the MPI job: %s", args.process_id, err)
                    if self.driver is not None:  # MPI_Abort kills the server: the run's record says why
                        self.driver.record_failure(f"MPI rank {args.process_id} failed, the job was aborted: {err}")
                    logging.shutdown()
                    args.comm.Abort(1)
                raise
