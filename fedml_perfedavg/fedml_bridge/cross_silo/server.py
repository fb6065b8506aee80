"""The cross-silo server as a state machine over FedML's server manager and aggregator
(cross_silo/server/fedml_server_manager.py, fedml_aggregator.py).

FedML's server waits for every silo in every phase with no limit (one dead silo hangs it),
averages every upload slot it ever filled (stale ones too, once a silo is gone), selects round
r+1's silos with round r's seed, samples with ``np.random.seed(round)`` and sleeps 5 s before
finishing. Here a run goes through these phases, each with one deadline::

    ONLINE ----> TRAINING --(round < K)--> TRAINING
                    |
                    +------(round = K)--> FINISHING ----> DONE

- ONLINE: waiting for the silos to announce themselves (deadline: ``connect_timeout``).
- TRAINING: a round's models were sent to its silos, waiting for their updates (deadline: the
  round deadline of :class:`~.policy.SiloPolicy`, which also bounds sending the models).
- FINISHING: the final model was sent, waiting for the silos' goodbyes (their own evaluations).

At a deadline the silos that did not answer are given up on; the run goes on if at least
``min_clients`` are left (:meth:`SiloPolicy.after_deadline`), else it stops naming them. The
k-th silo trains the k-th user of the algorithm's keyed sample, as the k-th client of an sp round.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from ...core.guards import ConfigError, SiloFailure
from ..bootstrap import import_fedml
from ...algorithms.base import RoundDriver
from .policy import SiloPolicy
from . import TRAINING_STARTED
from .transport import ROUND_KEY
from .wire import SILO_METRICS

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator  # noqa: E402
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    ONLINE = "coming online"
    TRAINING = "training"
    FINISHING = "finishing"
    DONE = "done"


# DONE is also where a stopped run goes, from any phase.
TRANSITIONS = {Phase.STARTING: {Phase.ONLINE, Phase.DONE}, Phase.ONLINE: {Phase.TRAINING, Phase.DONE},
               Phase.TRAINING: {Phase.TRAINING, Phase.FINISHING, Phase.DONE}, Phase.FINISHING: {Phase.DONE},
               Phase.DONE: set()}


class PluginFedMLAggregator(FedMLAggregator):
    """Keeps only the open round's uploads, by the silo's position in the round."""

    def __init__(self, *args: Any, driver: RoundDriver, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.driver = driver
        self.updates: Dict[int, Tuple[float, Any]] = {}  # position -> (sample count, model)

    def users_of_round(self, round_idx: int, positions: List[int]) -> List[int]:
        users = self.driver.sample_clients(round_idx)
        return [int(users[p]) for p in positions]

    def aggregate(self):
        model_list = [self.updates[p] for p in sorted(self.updates)]  # sp's order of sampled users
        self.updates = {}
        model_list, model_list_idxes = self.aggregator.on_before_aggregation(model_list)
        averaged = self.aggregator.on_after_aggregation(self.aggregator.aggregate(model_list))
        self.set_global_model_params(averaged)
        return averaged, model_list, model_list_idxes


class PluginServerManager(FedMLServerManager):
    """The phases of the module doc. ``policy`` decides deadlines and when to stop; ``driver``
    samples each round's users and takes each new global model (evaluation, checkpoints)."""

    def __init__(self, args: Any, aggregator: PluginFedMLAggregator, comm: Any = None, client_rank: int = 0,
                 client_num: int = 0, backend: str = "GRPC", *, policy: SiloPolicy, driver: RoundDriver) -> None:
        super().__init__(args, aggregator, comm, client_rank, client_num, backend)
        if len(self.client_real_ids) != args.client_num_per_round:
            raise ConfigError(f"train_args.client_num_per_round={args.client_num_per_round!r}: must equal the number "
                              f"of silos ({len(self.client_real_ids)}): each silo trains one sampled user per round")
        self.policy, self.driver = policy, driver
        self.phase = Phase.STARTING
        self.deadline: Optional[float] = None  # the one deadline of the open phase (time.monotonic())
        self.phase_opened = 0.0
        self.live: List[int] = list(self.client_real_ids)  # silos not given up on, in position order
        self.users: Dict[int, int] = {}  # silo -> its user in the open round
        self.online: set = set()
        self.finished: set = set()
        self.silo_metrics: Dict[int, Dict[str, Any]] = {}  # silo -> its last evaluation
        self.slowest_round: Optional[float] = None  # of the rounds every silo answered in time
        self.rounds_measured = 0
        self.adaptive_logged = False

    @property
    def round_idx(self) -> int:
        return self.args.round_idx  # FedML's own counter, which the transport stamps on messages

    # -- phases and the deadline --------------------------------------------------------------------
    def _enter(self, phase: Phase, seconds: Optional[float] = None) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"cross-silo server: no transition from {self.phase.name} to {phase.name}")
        self.phase = phase
        self.phase_opened = time.monotonic()
        self.deadline = None if seconds is None else self.phase_opened + seconds

    def _round_seconds(self) -> float:
        """The round deadline as of the rounds measured so far; logged the first time it adapts."""
        wait = self.policy.round_deadline(self.slowest_round, self.rounds_measured)
        if wait < self.policy.round_timeout and not self.adaptive_logged:
            self.adaptive_logged = True
            logger.info("round deadline now %.1f s: %g x the slowest round so far (%.2f s; comm_args."
                        "round_timeout_factor), at most comm_args.round_timeout=%g s", wait,
                        self.policy.round_timeout_factor, self.slowest_round, self.policy.round_timeout)
        return wait

    def on_idle(self) -> None:
        """The transport's tick while no message comes: act on a passed deadline."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return
        self.deadline = None
        if self.phase is Phase.ONLINE:
            self._give_up_after_deadline(self.online, f"did not come online within comm_args.connect_timeout="
                                                      f"{self.policy.connect_timeout:g} s")
            self._start_training()
        elif self.phase is Phase.TRAINING:
            answered = {self.client_real_ids[p] for p in self.aggregator.updates}
            self._give_up_after_deadline(answered, f"sent no update within {self._round_seconds():.1f} s (the "
                                                   f"round deadline, see comm_args.round_timeout_factor)")
            self._finish_round()
        elif self.phase is Phase.FINISHING:
            logger.warning("no goodbye from silo rank(s) %s within the round deadline; the run is complete",
                           sorted(set(self.live) - self.finished))
            self._complete()

    def _give_up_after_deadline(self, answered: set, why: str) -> None:
        go_on, missing = self.policy.after_deadline(self.live, sorted(answered))
        if missing:
            self._give_up_on(missing, why, go_on)

    def _give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        self.driver.record_lost_silos(self.round_idx, sorted(silos), why)
        left = len(self.live) - len(silos)
        if not go_on:
            self._stop(f"round {self.round_idx}: silo rank(s) {sorted(silos)} {why}; {left} left, fewer than "
                       f"comm_args.min_clients_per_round={self.policy.min_clients}")
        logger.warning("round %d: going on without silo rank(s) %s (%s); %d left, comm_args.min_clients_per_round=%d",
                       self.round_idx, sorted(silos), why, left, self.policy.min_clients)
        self.live = [s for s in self.live if s not in silos]
        for silo in silos:
            self.users.pop(silo, None)

    def run(self) -> None:
        try:
            super().run()
        except KeyboardInterrupt:  # SIGINT or SIGTERM (the run layer writes what was measured)
            self._tell_silos_to_stop()
            raise

    def _stop(self, reason: str) -> None:
        """End the run early, naming why."""
        self._tell_silos_to_stop()
        raise SiloFailure(reason)

    def _tell_silos_to_stop(self) -> None:
        """Tell the silos still there that the run is over (without waiting on any that do not answer)."""
        if self.phase is not Phase.DONE:
            self._enter(Phase.DONE)
        finish = [self._message(MyMessage.MSG_TYPE_S2C_FINISH, silo) for silo in self.live]
        try:
            self.com_manager.send_all(finish, time.monotonic() + 1.0)
        except Exception as err:  # noqa: BLE001 - best effort: the run is ending either way, for its own reason
            logger.warning("could not tell every silo to stop: %s", err)
        self.com_manager.stop_receive_message()

    # -- messages -----------------------------------------------------------------------------------
    def register_message_receive_handlers(self) -> None:
        self.register_message_receive_handler(MyMessage.MSG_TYPE_CONNECTION_IS_READY, self._on_listening)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self._on_status)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self._on_update)

    def _message(self, msg_type: int, silo: int, model: Any = None) -> Message:
        message = Message(msg_type, self.get_sender_id(), silo)
        if model is not None:
            message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, model)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(self.users.get(silo, 0)))
        return message

    def _on_listening(self, msg_params: Message) -> None:
        # FedML pings every silo here; silos announce themselves (retrying until the server
        # listens), so the server only starts its clock.
        self._enter(Phase.ONLINE, self.policy.connect_timeout)
        logger.info("server listening; waiting for silos %s", self.live)

    def _on_status(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        status = msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS)
        if status == self.ONLINE_STATUS_FLAG:
            self.online.add(silo)
            if self.phase is Phase.ONLINE and all(s in self.online for s in self.live):
                self._start_training()
        elif status == self.RUN_FINISHED_STATUS_FLAG:
            self.finished.add(silo)
            self._note_silo_metrics(msg_params)
            if self.phase is Phase.FINISHING and all(s in self.finished for s in self.live):
                self._complete()

    def _on_update(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        stamped = msg_params.get(ROUND_KEY)
        position = self.client_real_ids.index(silo) if silo in self.client_real_ids else None
        if self.phase is not Phase.TRAINING or silo not in self.live or stamped != self.round_idx or \
                position in self.aggregator.updates:
            logger.warning("ignored an update from silo rank %d for round %s (the server is %s round %d%s)", silo,
                           stamped, self.phase.value, self.round_idx,
                           "; it already sent one" if position in self.aggregator.updates else "")
            return
        self._note_silo_metrics(msg_params)
        self.aggregator.updates[position] = (
            msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES), msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
        if all(self.client_real_ids.index(s) in self.aggregator.updates for s in self.live):
            # Only rounds every silo answered in time measure what a round takes.
            self.slowest_round = max(time.monotonic() - self.phase_opened, self.slowest_round or 0.0)
            self.rounds_measured += 1
            self._finish_round()

    # -- rounds ---------------------------------------------------------------------------------------
    def _start_training(self) -> None:
        self.is_initialized = True
        logger.info("silos %s %s", self.live, TRAINING_STARTED)
        self._send_round(MyMessage.MSG_TYPE_S2C_INIT_CONFIG, Phase.TRAINING)

    def _send_round(self, msg_type: int, phase: Phase) -> None:
        """Open ``phase`` and send the round's model to its silos, all within the round's deadline."""
        positions = [self.client_real_ids.index(s) for s in self.live]
        self.users = dict(zip(self.live, self.aggregator.users_of_round(self.round_idx, positions)))
        self._enter(phase, self._round_seconds())
        params = self.aggregator.get_global_model_params()
        unreachable = self.com_manager.send_all([self._message(msg_type, s, params) for s in self.live], self.deadline)
        for silo, err in sorted(unreachable.items()):
            logger.warning("%s", err)
        if unreachable:
            go_on, _ = self.policy.after_deadline(self.live, [s for s in self.live if s not in unreachable])
            self._give_up_on(sorted(unreachable), f"unreachable for {self.deadline - self.phase_opened:.1f} s (the "
                                                  f"round deadline, see comm_args.round_timeout_factor)", go_on)

    def _finish_round(self) -> None:
        round_idx = self.round_idx
        self.aggregator.aggregate()
        self.driver.round_finished(round_idx, self.aggregator.get_global_model_params())
        self._log_silo_metrics(f"round {round_idx}")
        self.args.round_idx = round_idx + 1
        self._send_round(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT,
                         Phase.TRAINING if self.args.round_idx < self.round_num else Phase.FINISHING)

    def _complete(self) -> None:
        self._log_silo_metrics("final")
        self._enter(Phase.DONE)
        self.finish()

    def _note_silo_metrics(self, msg_params: Message) -> None:
        metrics = msg_params.get(SILO_METRICS)
        if metrics is not None:
            self.silo_metrics[int(msg_params.get_sender_id())] = metrics

    def _log_silo_metrics(self, label: str) -> None:
        entries = [self.silo_metrics[s] for s in sorted(self.silo_metrics)]
        if not entries:
            return
        mean = sum(e["accuracy"] for e in entries) / len(entries)
        logger.info("%s: silos' own personalized accuracy %.4f (model they received, mean of %d silos, each on "
                    "its user: %s)", label, mean, len(entries),
                    ", ".join(f"rank {s} user {e['user']} {e['accuracy']:.4f}" for s, e in sorted(self.silo_metrics.items())))
        self.driver.record_silo_evaluation(label, mean, dict(self.silo_metrics))
        self.silo_metrics = {}
