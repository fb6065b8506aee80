"""The cross-silo server as a state machine over FedML's server manager and aggregator
(cross_silo/server/fedml_server_manager.py, fedml_aggregator.py).

FedML's server waits for every silo in every phase with no limit (one dead silo hangs it),
averages every upload slot it ever filled (stale ones too, once a silo is gone), believes the
sample counts and figures each message carries, selects round r+1's silos with round r's seed,
samples with ``np.random.seed(round)`` and sleeps 5 s before finishing. Here a run goes through
these phases (:mod:`.phases`), each with one deadline::

    ONLINE --> TRAINING --(round < K)--> [EVALUATING] --> TRAINING
                  |                              |
                  +--(round = K)--> FINISHING    +--(round = K)--> DONE      (data-owner mode)
                                        |
                                        +--> DONE                            (shared mode)

- ONLINE: waiting for the silos to announce themselves (deadline: ``connect_timeout``). Each
  announcement is checked (:mod:`.agreement`): a silo that disagrees on any value that must
  agree, or whose data does not fit the model, is refused at once, naming the key and both values.
- TRAINING: a round's models were sent to its silos, waiting for their updates (deadline: the
  round deadline of :class:`~.policy.SiloPolicy`, which also bounds sending the models). The
  round's users are the algorithm's keyed sample, as in sp: in shared mode the k-th silo trains
  the k-th user; in data-owner mode (``comm_args.silo_data: own``) the sampled users' own silos
  train (silo rank R owns user R-1), and a sampled silo that is offline is missing at once.
- EVALUATING (data-owner mode, on the run's evaluation rounds): every online silo, sampled or
  not, evaluates the new model on its own data and sends its counts; a silo that sends none is
  listed as missing, never counted as zero.
- FINISHING (shared mode): the final model was sent, waiting for the silos' goodbyes.

What a silo sends is checked against what the server knows, never taken from the message: an
upload's sample count must be its user's (the server's data in shared mode, the silo's
announcement in data-owner mode); reported counts must be of the silo's own user in that round,
of its test split's size. A refusal is counted and logged through the transport's rate-limited
refusal log (summary.json's ``refusals``), and a refused upload is a rejected update.

At a deadline the silos that did not answer are given up on; the run goes on if at least
``min_clients`` of the round's silos answered (:meth:`SiloPolicy.after_deadline`), else it stops
naming them. A silo given up on that announces itself again (it lost the server for a while, was
frozen, or restarted) takes part again; one that sends work as if nothing happened is told, once,
that it was given up on, so it announces itself at once. When the run ends, the silos given up on
are told too (they may be waiting), except those refused, which were told why and have ended.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ...core.errors import ConfigError, SiloFailure
from ..bootstrap import import_fedml
from ..shims import aggregate_with_hooks
from ...algorithms.base import RoundDriver
from .agreement import SiloSetup
from .phases import Phase, PhaseClock
from .policy import SiloPolicy
from .roster import SiloRoster, silo_accuracies
from . import TRAINING_STARTED
from .transport import ROUND_KEY, SESSION_KEY
from . import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator  # noqa: E402
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)

DISAGREEMENT, SAMPLE_COUNT, BAD_FIGURES = "disagreement", "sample-count", "bad-figures"
NOTICE_SECONDS = 2.0  # a notice to a silo (a refusal, an acknowledgement) is not waited on longer
# The end of a run is told within this: a silo that misses it waits out its idle limit (minutes). A
# silo that was heard from and whose port now refuses connections has ended and is not waited for,
# so Ctrl-C stays quick; one never heard from may still be starting up and is retried.
FINISH_SECONDS = 5.0


class PluginFedMLAggregator(FedMLAggregator):
    """Keeps only the open round's uploads, by the user's position in the round's sample."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates: Dict[int, Tuple[float, Any]] = {}  # position -> (sample count, model)

    def aggregate(self):
        model_list = [self.updates[p] for p in sorted(self.updates)]  # sp's order of sampled users
        self.updates = {}
        averaged, kept, positions = aggregate_with_hooks(self.aggregator, model_list)
        self.set_global_model_params(averaged)
        return averaged, kept, positions


def to_silo(
    msg_type: int,
    silo: int,
    model: Any = None,
    user: Optional[int] = None,
    round_idx: Optional[int] = None,
    reason: Optional[str] = None,
    refused: bool = False,
    left_out: bool = False,
) -> Message:
    """A message from the server (rank 0) to ``silo``: FedML's keys, and the plugin's round stamp,
    reason (cut at 2000 characters), refusal and left-out flags where given."""
    message = Message(msg_type, 0, silo)
    if model is not None:
        message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, model)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(0 if user is None else user))
    if round_idx is not None:
        message.add_params(ROUND_KEY, round_idx)
    if reason is not None:
        message.add_params(wire.REASON, reason[:2000])
    if refused:
        message.add_params(wire.REFUSED, True)
    if left_out:
        message.add_params(wire.LEFT_OUT, True)
    return message


class PluginServerManager(FedMLServerManager):
    """The phases of the module doc. ``policy`` decides deadlines and when to stop; ``driver``
    samples each round's users and takes each new global model and evaluation; ``setup`` says
    the mode, the silos and what they must agree on."""

    def __init__(
        self,
        args: Any,
        aggregator: PluginFedMLAggregator,
        comm: Any = None,
        client_rank: int = 0,
        client_num: int = 0,
        backend: str = "GRPC",
        *,
        policy: SiloPolicy,
        driver: RoundDriver,
        setup: SiloSetup,
    ) -> None:
        super().__init__(args, aggregator, comm, client_rank, client_num, backend)
        if not setup.own_data and len(setup.silos) != args.client_num_per_round:
            raise ConfigError(
                f"train_args.client_num_per_round={args.client_num_per_round!r}: must equal the number "
                f"of silos ({len(setup.silos)}): each silo trains one sampled user per round"
            )
        self.policy, self.driver, self.setup = policy, driver, setup
        self.clock = PhaseClock(policy)
        self.roster = SiloRoster(setup)
        self.expected: List[int] = []  # the open round's silos (data-owner mode: offline ones too)
        self.assigned: Dict[int, Tuple[int, int]] = {}  # silo -> (position in the sample, user), open round
        self.answered: Set[int] = set()  # silos of the open round that answered (accepted or refused)
        self.awaiting: Set[int] = set()  # silos whose evaluation the open evaluation waits for
        self.evaluations: Dict[int, Dict[str, Any]] = {}  # user -> counts, open evaluation
        self.evaluation_started = 0.0
        self.evaluated_round = -1
        self.finished: Set[int] = set()
        self.silo_metrics: Dict[int, Dict[str, Any]] = {}  # silo -> its last evaluation (shared mode)

    @property
    def round_idx(self) -> int:
        return self.args.round_idx  # FedML's own counter, which the transport stamps on messages

    def on_idle(self) -> None:
        """The transport's tick while no message comes: act on a passed deadline."""
        if not self.clock.passed():
            return
        if self.clock.phase is Phase.ONLINE:
            self.clock.disarm()
            missing = [s for s in self.roster.live if s not in self.roster.online]
            go_on, _ = self.policy.after_deadline(self.roster.live, sorted(self.roster.online))
            self._give_up_on(
                missing,
                f"did not come online within comm_args.connect_timeout={self.policy.connect_timeout:g} s",
                go_on,
            )
            self._start_training()
        elif self.clock.phase is Phase.TRAINING:
            self._close_round(f"sent no update within {self.clock.deadline_words()}")
        elif self.clock.phase is Phase.EVALUATING:
            self._close_evaluation(f"sent no evaluation within {self.clock.deadline_words()}")
        elif self.clock.phase is Phase.FINISHING:
            self.clock.disarm()
            logger.warning(
                "no goodbye from silo rank(s) %s within the round deadline; the run is complete",
                sorted(set(self.roster.live) - self.finished),
            )
            self._complete()

    def _give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        if not silos:
            return
        self.driver.record_lost_silos(self.round_idx, sorted(silos), why)
        left = len([s for s in self.roster.live if s not in silos])
        if not go_on:
            self._stop(
                f"round {self.round_idx}: silo rank(s) {sorted(silos)} {why}; fewer than comm_args."
                f"min_clients_per_round={self.policy.min_clients} of the round's silos answered"
            )
        logger.warning(
            "round %d: going on without silo rank(s) %s (%s); %d left, comm_args.min_clients_per_round=%d",
            self.round_idx,
            sorted(silos),
            why,
            left,
            self.policy.min_clients,
        )
        self.roster.drop(silos)
        for silo in silos:
            self.assigned.pop(silo, None)
            self.awaiting.discard(silo)

    def run(self) -> None:
        try:
            super().run()
        except KeyboardInterrupt:  # SIGINT or SIGTERM (the run layer writes what was measured)
            self._tell_silos_to_stop("the server was interrupted (SIGINT or SIGTERM)")
            raise

    def _stop(self, reason: str) -> None:
        """End the run early, naming why."""
        self._tell_silos_to_stop(f"the server stopped the run: {reason}")
        raise SiloFailure(reason)

    def _tell_silos_to_stop(self, reason: Optional[str], seconds: float = FINISH_SECONDS) -> None:
        """Tell the live silos that the run is over (``reason``: it failed) within ``seconds``,
        then, within at most FINISH_SECONDS, those given up on (they may still be waiting, or be
        gone for good), without waiting on any that do not answer."""
        if self.clock.phase is not Phase.DONE:
            self.clock.enter(Phase.DONE)
        self._record_refusals()
        self._send_finish(self.roster.live, reason, seconds)
        self._send_finish(self.roster.given_up(), reason, min(seconds, FINISH_SECONDS))
        self.com_manager.stop_receive_message()

    def _send_finish(self, silos: List[int], reason: Optional[str], seconds: float) -> None:
        if not silos:
            return
        finish = [to_silo(MyMessage.MSG_TYPE_S2C_FINISH, silo, reason=reason) for silo in silos]
        try:
            heard_from = set(self.roster.hellos)  # they listened: a closed port now means they ended
            untold = self.com_manager.send_all(finish, time.monotonic() + seconds, gone_if_refused=heard_from)
            for silo, err in sorted(untold.items()):
                logger.warning(
                    "silo rank %d was not told that the run is over (%s); if it is still running it stops "
                    "at its own idle limit",
                    silo,
                    err,
                )
        except Exception as err:  # noqa: BLE001 - best effort: the run is ending either way, for its own reason
            logger.warning("could not tell every silo to stop: %s", err)

    def _notify(self, messages: List[Message]) -> None:
        """Send notices without letting a silo that does not take them hold the server up."""
        for silo, err in sorted(self.com_manager.send_all(messages, time.monotonic() + NOTICE_SECONDS).items()):
            logger.info("a notice to silo rank %d was not delivered: %s", silo, err)

    def _tell_if_left_out(self, silo: int) -> None:
        """A silo the server gave up on sent work (it answered late, or was frozen): tell it, once,
        to announce itself again, rather than leave it to notice the server's silence."""
        if self.roster.left_out_notice(silo):
            logger.info("silo rank %d was given up on and still sends work; it is told to announce itself", silo)
            self._notify([to_silo(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, silo, left_out=True)])

    def _refuse(self, silo: int, reason: str, text: str) -> None:
        self.com_manager.refusals.refuse(f"rank {silo}", reason, text, f"silo rank {silo}")

    def _record_refusals(self) -> None:
        self.driver.record_refusals(dict(self.com_manager.refusals.totals))

    # -- messages -----------------------------------------------------------------------------------
    def register_message_receive_handlers(self) -> None:
        self.register_message_receive_handler(MyMessage.MSG_TYPE_CONNECTION_IS_READY, self._on_listening)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self._on_status)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self._on_update)
        self.register_message_receive_handler(wire.EVALUATION, self._on_evaluation)

    def _on_listening(self, msg_params: Message) -> None:
        # FedML pings every silo here; silos announce themselves (retrying until the server
        # listens), so the server only starts its clock.
        self.clock.enter(Phase.ONLINE, self.policy.connect_timeout)
        logger.info("server listening; waiting for silos %s", self.roster.live)

    def _on_status(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        status = msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS)
        if status == self.ONLINE_STATUS_FLAG:
            self._on_hello(silo, msg_params.get(wire.HELLO), msg_params.get(SESSION_KEY))
        elif (
            status == self.RUN_FINISHED_STATUS_FLAG and self.clock.phase is Phase.FINISHING and silo in self.roster.live
        ):
            self.finished.add(silo)
            self._note_silo_metrics(silo, msg_params.get(wire.SILO_METRICS), self.round_idx)
            if all(s in self.finished for s in self.roster.live):
                self._complete()

    # -- a silo comes online ------------------------------------------------------------------------
    def _on_hello(self, silo: int, announced: Optional[Dict[str, Any]], session: Optional[str]) -> None:
        if self.clock.phase in (Phase.FINISHING, Phase.DONE) or silo not in self.setup.silos:
            return
        problem = self.roster.problem_with(silo, announced)
        if problem is not None:
            self._refuse_silo(silo, problem)
            return
        assert announced is not None  # (no announcement is a problem)
        restarted = self.roster.greet(silo, announced, session)
        if self.clock.phase in (Phase.STARTING, Phase.ONLINE):
            self.roster.online.add(silo)
            if self.clock.phase is Phase.ONLINE and self.roster.all_online():
                self._start_training()
            return
        if silo not in self.roster.live:
            self.roster.take_back(silo)
            why = "it announced itself again" + (" from a new process" if restarted else "")
            logger.warning(
                "round %d: silo rank %d is back (%s); it takes part from the next round", self.round_idx, silo, why
            )
            self.driver.record_rejoined_silo(self.round_idx, silo, why)
        elif restarted:
            self._forget_open_work(silo)
        self._notify([to_silo(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, silo)])  # "I hear you"
        self._close_if_complete()

    def _forget_open_work(self, silo: int) -> None:
        """A silo restarted: what its earlier process owed the open round or evaluation will not come."""
        if self.clock.phase is Phase.TRAINING and silo in self.assigned and silo not in self.answered:
            logger.warning(
                "round %d: silo rank %d restarted; its update for this round is missing", self.round_idx, silo
            )
            self.assigned.pop(silo)
        if self.clock.phase is Phase.EVALUATING and silo in self.awaiting:
            self.awaiting.discard(silo)

    def _refuse_silo(self, silo: int, problem: str) -> None:
        """Refuse a silo's announcement: it is told why and stops; the run goes on without it if
        enough silos are left (else it stops, naming the problem)."""
        logger.error("%s; it is refused", problem)
        self._refuse(silo, DISAGREEMENT, problem)
        self._notify(
            [to_silo(MyMessage.MSG_TYPE_S2C_FINISH, silo, reason=f"refused by the server: {problem}", refused=True)]
        )
        if silo not in self.roster.live:
            return
        left = [s for s in self.roster.live if s != silo]
        go_on = len(left) >= self.policy.min_clients if self.clock.phase in (Phase.STARTING, Phase.ONLINE) else True
        self.roster.refuse(silo)  # it was told why; a stop that follows need not tell it again
        self._give_up_on([silo], f"refused: {problem}", go_on)
        if self.clock.phase is Phase.ONLINE and self.roster.all_online():
            self._start_training()
        else:
            self._close_if_complete()

    # -- rounds ---------------------------------------------------------------------------------------
    def _start_training(self) -> None:
        self.is_initialized = True
        logger.info("silos %s %s", self.roster.live, TRAINING_STARTED)
        self._open_round(MyMessage.MSG_TYPE_S2C_INIT_CONFIG)

    def _open_round(self, msg_type: int) -> None:
        """Open the round ``self.round_idx``: send its model to its silos, within the round's deadline."""
        round_idx = self.round_idx
        self.expected, self.assigned = self.roster.assignment(self.driver.sample_clients(round_idx))
        self.answered = set()
        offline = [s for s in self.expected if s not in self.assigned]
        if offline:
            logger.warning(
                "round %d: sampled silo rank(s) %s are offline; they are missing from this round", round_idx, offline
            )
        self.clock.enter(Phase.TRAINING, self.clock.round_seconds())
        params = self.aggregator.get_global_model_params()
        messages = [to_silo(msg_type, s, params, user) for s, (_, user) in sorted(self.assigned.items())]
        unreachable = self.com_manager.send_all(messages, self.clock.deadline)
        for _, err in sorted(unreachable.items()):
            logger.warning("%s", err)
        if unreachable:
            reachable = [s for s in self.assigned if s not in unreachable]
            go_on, _ = self.policy.after_deadline(self.expected, reachable)
            self._give_up_on(sorted(unreachable), f"unreachable for {self.clock.deadline_words()}", go_on)
        self._close_if_complete()

    def _close_if_complete(self) -> None:
        """Close the open round or evaluation once nothing more is awaited."""
        if self.clock.phase is Phase.TRAINING and set(self.assigned) <= self.answered:
            self._close_round(None)
        elif self.clock.phase is Phase.EVALUATING and not self.awaiting:
            self._close_evaluation(None)

    def _on_update(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        stamped = msg_params.get(ROUND_KEY)
        if (
            self.clock.phase is not Phase.TRAINING
            or silo not in self.assigned
            or stamped != self.round_idx
            or silo in self.answered
        ):
            logger.warning(
                "ignored an update from silo rank %d for round %s (the server is %s round %d%s)",
                silo,
                stamped,
                self.clock.phase.value,
                self.round_idx,
                "; it already sent one" if silo in self.answered else "",
            )
            self._tell_if_left_out(silo)
            return
        self.answered.add(silo)
        position, user = self.assigned[silo]
        declared = msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES)
        known = self.roster.counts_of(silo, user)[0]
        if declared != known:
            self._refuse(
                silo,
                SAMPLE_COUNT,
                f"round {self.round_idx}: silo rank {silo} sent num_samples={declared!r} "
                f"for user {user}, who has {known} training samples; its update is "
                f"rejected",
            )
            self.driver.record_rejected_update(self.round_idx)
        else:
            self._note_silo_metrics(silo, msg_params.get(wire.SILO_METRICS), self.round_idx)
            self.aggregator.updates[position] = (known, msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
        if set(self.assigned) <= self.answered and set(self.expected) <= self.answered:
            # Only rounds every silo answered in time measure what a round takes.
            self.clock.measure_round()
        self._close_if_complete()

    def _close_round(self, why_missing: Optional[str]) -> None:
        """The round's deadline passed (``why_missing`` says what the missing silos failed to do)
        or every silo answered: give up on the missing, aggregate, evaluate, go on."""
        self.clock.disarm()
        go_on, missing = self.policy.after_deadline(self.expected, sorted(self.answered))
        waited = [s for s in missing if s in self.assigned]  # sent the round's model, sent nothing back
        if not go_on:
            self._give_up_on(missing, why_missing or "missed the round", False)
        self._give_up_on(waited, why_missing or "missed the round", True)
        round_idx = self.round_idx
        self.aggregator.aggregate()
        self.driver.round_finished(round_idx, self.aggregator.get_global_model_params())
        self._log_silo_metrics(f"round {round_idx}")
        self._record_refusals()
        if self.setup.own_data and self.driver.evaluates(round_idx):
            self._open_evaluation(round_idx)
        else:
            self._next_round()

    def _next_round(self) -> None:
        self.args.round_idx = self.round_idx + 1
        if self.round_idx < self.round_num:
            self._open_round(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
        elif self.setup.own_data:
            self._tell_silos_to_stop(
                None, self.clock.round_seconds()
            )  # the last evaluation is recorded: the run is over
            self._complete()
        else:
            self._send_final_model()

    # -- evaluation (data-owner mode) ----------------------------------------------------------------
    def _open_evaluation(self, round_idx: int) -> None:
        """Every online silo evaluates the model after ``round_idx`` on its own data."""
        self.evaluations, self.awaiting = {}, set(self.roster.live)
        self.evaluation_started = time.perf_counter()
        self.evaluated_round = round_idx
        self.clock.enter(Phase.EVALUATING, self.clock.round_seconds())
        params = self.aggregator.get_global_model_params()
        messages = [to_silo(wire.EVALUATE, s, params, s - 1, round_idx) for s in sorted(self.awaiting)]
        unreachable = self.com_manager.send_all(messages, self.clock.deadline)
        if unreachable:
            self._give_up_on(sorted(unreachable), f"unreachable for {self.clock.deadline_words()}", True)
        self._close_if_complete()

    def _on_evaluation(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        counts = msg_params.get(wire.SILO_METRICS)
        if self.clock.phase is not Phase.EVALUATING or silo not in self.awaiting:
            logger.warning(
                "ignored an evaluation from silo rank %d (the server is %s round %d)",
                silo,
                self.clock.phase.value,
                self.round_idx,
            )
            self._tell_if_left_out(silo)
            return
        self.awaiting.discard(silo)
        problem = self.roster.figures_problem(silo, counts, silo - 1, self.evaluated_round)
        if problem is not None:
            self._refuse(
                silo,
                BAD_FIGURES,
                f"{problem}; user {silo - 1} is missing from round {self.evaluated_round}'s evaluation",
            )
        else:
            self.evaluations[silo - 1] = counts
        self._close_if_complete()

    def _close_evaluation(self, why_missing: Optional[str]) -> None:
        self.clock.disarm()
        if self.awaiting:
            self._give_up_on(sorted(self.awaiting), why_missing or "sent no evaluation", True)
        missing = [s - 1 for s in self.setup.silos if s - 1 not in self.evaluations]
        self.driver.record_federated_evaluation(
            self.evaluated_round, dict(self.evaluations), missing, self.evaluation_started
        )
        self._record_refusals()
        self._next_round()

    # -- the end (shared mode: the silos evaluate the final model and say goodbye) -------------------------
    def _send_final_model(self) -> None:
        self.expected, self.assigned = self.roster.assignment(self.driver.sample_clients(self.round_idx))
        self.clock.enter(Phase.FINISHING, self.clock.round_seconds())
        params = self.aggregator.get_global_model_params()
        messages = [
            to_silo(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT, s, params, user)
            for s, (_, user) in sorted(self.assigned.items())
        ]
        for silo, err in sorted(self.com_manager.send_all(messages, self.clock.deadline).items()):
            logger.warning("%s", err)
            self.roster.drop([silo])
        if all(s in self.finished for s in self.roster.live):
            self._complete()

    def _complete(self) -> None:
        self._log_silo_metrics("final")
        self._record_refusals()
        if self.clock.phase is not Phase.DONE:  # shared mode: the live silos said goodbye; not these
            self.clock.enter(Phase.DONE)
            self._send_finish(self.roster.given_up(), None, NOTICE_SECONDS)
        self.finish()

    # -- the silos' own evaluations of the model they received (shared mode) --------------------------
    def _note_silo_metrics(self, silo: int, counts: Optional[Dict[str, Any]], round_idx: int) -> None:
        if counts is None or silo not in self.assigned:
            return
        user = self.assigned[silo][1]
        problem = self.roster.figures_problem(silo, counts, user, round_idx)
        if problem is not None:
            self._refuse(silo, BAD_FIGURES, f"{problem}; its figures are not recorded")
            return
        self.silo_metrics[silo] = counts

    def _log_silo_metrics(self, label: str) -> None:
        if not self.silo_metrics:
            return
        mean, entries = silo_accuracies(self.silo_metrics)
        logger.info(
            "%s: silos' own personalized accuracy %.4f (model they received, mean of %d silos, each on its user: %s)",
            label,
            mean,
            len(entries),
            ", ".join(f"rank {s} user {e['user']} {e['accuracy']:.4f}" for s, e in entries.items()),
        )
        self.driver.record_silo_evaluation(label, mean, entries)
        self.silo_metrics = {}
