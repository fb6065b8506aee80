"""The cross-silo server: FedML's aggregator and server manager (cross_silo/server/) with
deadlines, a minimum of clients, keyed client sampling, and the silos' own evaluations.

fedml_aggregator.py keeps one upload slot per silo forever, averages all of them (stale ones
too, once a silo is gone) and samples with ``np.random.seed(round)``; fedml_server_manager.py
waits for every silo in every phase with no limit (one dead silo hangs the server), selects
round r+1's silos with round r's seed, and sleeps 5 s before finishing. The subclasses below
fix each of these; ``server_classes`` binds them to one run's policy and driver.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from ...core.guards import ConfigError, SiloFailure
from ..bootstrap import import_fedml
from ...algorithms.base import RoundDriver
from .transport import SILO_METRICS, TRAINING_STARTED, PeerUnreachable, SiloPolicy, no_retry

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator  # noqa: E402
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


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
        users = self.driver.sample_clients(round_idx)
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
        self.round_started: Optional[float] = None
        self.slowest_round: Optional[float] = None  # of the rounds every silo answered in time
        self.rounds_measured = 0
        self.adaptive_logged = False

    # -- phases ---------------------------------------------------------------------------
    def _open_phase(self, phase: str) -> None:
        self.phase = phase
        # Coming online includes the silos' start-up (imports, data): connect_timeout.
        if phase == "online":
            wait = self.policy.connect_timeout
        else:  # the retry window was set to this deadline before the round's models were sent
            wait = self._round_deadline()
        self.round_started = time.monotonic()
        self.deadline = self.round_started + wait

    def _round_deadline(self) -> float:
        """The round deadline as of the rounds measured so far; logged the first time it adapts
        (whichever use comes first: sending a round's models or waiting for its updates)."""
        wait = self.policy.round_deadline(self.slowest_round, self.rounds_measured)
        if wait < self.policy.round_timeout and not self.adaptive_logged:
            self.adaptive_logged = True
            logger.info("round deadline now %.1f s: %g x the slowest round so far (%.2f s; comm_args."
                        "round_timeout_factor), at most comm_args.round_timeout=%g s", wait,
                        self.policy.round_timeout_factor, self.slowest_round, self.policy.round_timeout)
        return wait

    def _limit_retries(self) -> None:
        """A silo that was up and stops answering is given the round deadline, no more: the
        deadline as of the rounds measured so far (sending a round's models comes before its
        phase opens, and must not wait by an older, longer deadline while the live silos give up
        on a silent server)."""
        self.com_manager.retry_seconds = min(self.policy.connect_timeout, self._round_deadline())

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
        # From now on a silo that cannot be reached was up before: give it the round deadline at most.
        self._limit_retries()
        logger.info("silos %s %s", self.client_id_list_in_this_round, TRAINING_STARTED)
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
            self._give_up_on(unreachable, f"unreachable for {self.com_manager.retry_seconds:.1f} s (the round "
                                          f"deadline, see comm_args.round_timeout_factor)")

    def _give_up_on(self, silos: List[int], why: str) -> None:
        live = [s for s in self.client_id_list_in_this_round if s not in silos]
        record = getattr(self.driver, "record_lost_silos", None)
        if record is not None:
            record(self.args.round_idx, sorted(silos), why)
        if len(live) < self.policy.min_clients:
            self._stop(f"round {self.args.round_idx}: silo rank(s) {sorted(silos)} {why}; {len(live)} left, "
                       f"fewer than comm_args.min_clients_per_round={self.policy.min_clients}")
        logger.warning("round %d: going on without silo rank(s) %s (%s); %d left, comm_args."
                       "min_clients_per_round=%d", self.args.round_idx, sorted(silos), why, len(live),
                       self.policy.min_clients)
        self.aggregator.lost.update(silos)
        keep = [i for i, s in enumerate(self.client_id_list_in_this_round) if s not in silos]
        self.client_id_list_in_this_round = [self.client_id_list_in_this_round[i] for i in keep]
        self.data_silo_index_list = [self.data_silo_index_list[i] for i in keep]
        self.aggregator.live_positions = [p for p in self.aggregator.live_positions
                                          if self.client_real_ids[p] not in silos]

    def _stop(self, reason: str) -> None:
        # Tell the silos still there to end, without waiting on any that do not answer.
        with no_retry(self):
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
            what = f"did not come online within comm_args.connect_timeout={self.policy.connect_timeout:g} s"
        elif self.phase == "training":
            answered = [self.client_real_ids[p] for p in self.aggregator.updates]
            wait = self._round_deadline()
            what = f"sent no update within {wait:.1f} s (the round deadline, see comm_args.round_timeout_factor)"
        else:
            answered = [s for s in expected if s in self.finished]
            logger.warning("no goodbye from silo rank(s) %s within the round deadline; the run is complete",
                           sorted(set(expected) - set(answered)))
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
        record = getattr(self.driver, "record_silo_evaluation", None)
        if record is not None:
            record(label, mean, dict(self.silo_metrics))
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
            # Only rounds every silo answered in time measure what a round takes.
            elapsed = time.monotonic() - self.round_started
            self.slowest_round = max(elapsed, self.slowest_round or 0.0)
            self.rounds_measured += 1
            self._finish_round()

    def _finish_round(self) -> None:
        round_idx = self.args.round_idx
        self.aggregator.aggregate()
        self.driver.round_finished(round_idx, self.aggregator.get_global_model_params())
        self._log_silo_metrics(f"round {round_idx}")
        self.args.round_idx = round_idx + 1
        self._select()
        self._limit_retries()
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


def server_classes(policy: SiloPolicy, driver: RoundDriver) -> Tuple[type, type]:
    """(aggregator class, server manager class) bound to one run's policy and driver."""
    aggregator = type("PluginFedMLAggregator", (PluginFedMLAggregator,), {"driver": driver})
    manager = type("PluginServerManager", (PluginServerManager,), {"policy": policy, "driver": driver})
    return aggregator, manager
