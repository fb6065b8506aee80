"""The cross-silo client (a silo) as a state machine over FedML's client manager, trainer and
adapter (cross_silo/client/).

FedML's client counts rounds itself (a silo that is not sampled every round would train with
the wrong round's batches), never tells the ``ClientTrainer`` which user it trains, waits for the
server forever, and its evaluations never reach the server. Here::

    ANNOUNCING --(a message from the server)--> LISTENING --(nothing for the idle limit, or an
        ^                                          |        upload the server did not take)
        |                                          v
        +------------------------------------- REJOINING --(no answer within connect_timeout)--> gone

- ANNOUNCING: the silo's ONLINE status carries its announcement (:func:`.agreement.hello`): the
  values that must agree with the server's and, in data-owner mode, its data's counts and shape.
- LISTENING: each model is trained at the round the server stamped on it, on the user the server
  names (data-owner mode: only the silo's own, and only in a round the keyed schedule samples it,
  each round once and in order, within its own DP budget; a round it trained comes again only
  from a resumed server, which gets the stored answer); an evaluation request (data-owner mode) is
  answered with the counts of the silo's own test split; shared mode's silo also evaluates each
  model it receives and sends the counts with its update.
- REJOINING: after ``SiloPolicy.client_idle_deadline`` without a word from the server (adaptive,
  see there), when an upload cannot be delivered, or when the server says it gave up on the silo
  (it answered late), the silo announces itself again; a server still running takes it back (it
  answers at once). With no answer within ``connect_timeout`` the silo stops, saying the server
  may be gone.

A FINISH from the server ends the silo: the run is over (or ended early, saying why), or this
silo was refused (its announcement), which is this silo's failure. A silo's own error ends it with
FAILED to the server, a stop signal with LEAVING: either way the server gives it up at once, and a
new process of it (started again) is taken back when it announces itself.
"""

from __future__ import annotations

import enum
import logging
import math
import platform
import time
from typing import Any, Dict, List, Optional

from ...core.errors import SiloFailure
from ...core.ledger import silo_report
from ..bootstrap import import_fedml
from .agreement import SiloSetup
from .modes import data_mode
from ...silo.outcome import SiloOutcome, StoredAnswer, state_digest
from ...secagg.primitives import SecAggError
from .policy import SiloPolicy
from .secure_rounds import advert_to_wire
from ...silo.rules import STORED, DataOwnerRules
from .secure_silo import SecureSiloRound
from .conversations import TWIN
from .transport import IDENTITY, OTHER_RUN, ROUND_KEY, SESSION_KEY, PeerUnreachable
from . import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager  # noqa: E402
from fedml.cross_silo.client.fedml_trainer import FedMLTrainer  # noqa: E402
from fedml.cross_silo.client.fedml_trainer_dist_adapter import TrainerDistAdapter  # noqa: E402
from fedml.cross_silo.client.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


class PluginFedMLTrainer(FedMLTrainer):
    """cross_silo/client/fedml_trainer.py never tells the ``ClientTrainer`` which user it now
    trains (``set_id``), so minibatches would be drawn as the silo's first user; and it cannot
    say how a model does on the user's test split in counts the server can check."""

    def update_dataset(self, client_index):
        super().update_dataset(client_index)
        self.trainer.set_id(client_index)

    def training_figures(self, round_idx: int) -> Optional[List[Any]]:
        """The current user's training figures of round ``round_idx`` [loss, accuracy], where the
        algorithm records them (not under DP-SGD: core/training_record.py) and this process trained it."""
        algorithm = getattr(self.trainer, "algorithm", None)
        if algorithm is None or not algorithm.reports_training:
            return None
        rows = algorithm.training.of(round_idx, [int(self.client_index)])
        return rows[0][1:] if rows else None

    def evaluate(self, round_idx: int, received: bool = False) -> Dict[str, Any]:
        """The personalized evaluation of the current model on the current user's test split, as
        whole counts (what the server checks and averages). ``received``: the model the server sent
        for round ``round_idx`` (shared mode's figures); with DP-SGD its personalization is keyed
        by the round that produced that model, so this and the server's evaluation of the same
        model are one release, never two with the same noise on different models."""
        private = getattr(self.trainer, "algorithm", None) is not None and self.trainer.algorithm.settings.privacy
        self.args.round_idx = round_idx - 1 if received and private else round_idx
        result = self.trainer.test(self.test_local, self.device, self.args)
        total = int(result["test_total"])
        loss = float(result["test_loss"]) / total
        own = result.get("test_own_metrics")
        return {
            "round": int(round_idx),
            "user": int(self.client_index),
            "correct": int(round(result["test_correct"])),
            "correct_before": int(round(result["test_correct_before_adaptation"])),
            "total": total,
            "loss": loss if math.isfinite(loss) and loss < 1e11 else 1e11,
            **({"own": {name: float(value) for name, value in own.items()}} if own else {}),
        }


def with_privacy(counts: Dict[str, Any], ledger: Any) -> Dict[str, Any]:
    """A data owner's evaluation counts, with its user's DP-SGD account (the personalization just
    done included) where the run has DP-SGD."""
    if ledger is not None:
        ledger.evaluated(counts["round"], [counts["user"]])
        counts["privacy"] = silo_report(ledger, counts["user"])
    return counts


def say_goodbye(manager: Any, counts: Dict[str, Any]) -> None:
    """Shared mode's last word: FINISHED, with the silo's evaluation of the final model."""
    message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, manager.client_real_id, 0)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, manager.RUN_FINISHED_STATUS_FLAG)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
    message.add_params(wire.SILO_METRICS, counts)
    try:
        manager.com_manager.send_message(message, deadline=time.monotonic() + manager.GOODBYE_SECONDS)
    except PeerUnreachable as err:
        logger.info("silo rank %d: the server has already ended (%s); this silo is done", manager.rank, err)


FAILURE_SECONDS = 5.0  # how long a failing silo tries to tell the server before it exits
LEAVING_SECONDS = 2.0  # how long a stopped silo tries to tell the server (its operator waits)


def tell_failure(manager: Any, err: Exception) -> None:
    """A silo's last word before an error ends it: FAILED and the error, to the server (best effort:
    a server already gone is not waited for; none when the server ended the run, or is gone)."""
    if manager.state is not State.LISTENING:
        return
    message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, manager.client_real_id, 0)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, wire.FAILED)
    message.add_params(wire.REASON, f"silo rank {manager.rank}: {type(err).__name__}: {err}"[:2000])
    try:
        manager.com_manager.send_message(message, deadline=time.monotonic() + FAILURE_SECONDS)
    except Exception as again:  # noqa: BLE001 - the original error is what ends the silo
        logger.info("silo rank %d could not tell the server it fails (%s)", manager.rank, again)


def tell_leaving(manager: Any) -> None:
    """A stopped silo's last word (SIGINT or SIGTERM to its process): LEAVING, so that the server
    gives up on it at once, not at its deadline, and a new process started with the same command
    takes its place when it announces itself (best effort, as :func:`tell_failure`)."""
    if manager.state not in (State.LISTENING, State.ANNOUNCING, State.REJOINING):
        return
    message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, manager.client_real_id, 0)
    message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, wire.LEAVING)
    message.add_params(wire.REASON, f"silo rank {manager.rank}'s process was stopped (SIGINT or SIGTERM)")
    try:
        manager.com_manager.send_message(message, deadline=time.monotonic() + LEAVING_SECONDS)
    except Exception as again:  # noqa: BLE001 - the stop is what ends the silo
        logger.info("silo rank %d could not tell the server it stops (%s)", manager.rank, again)


class PluginTrainerDistAdapter(TrainerDistAdapter):
    def get_trainer(
        self,
        client_index,
        train_data_local_dict,
        train_data_local_num_dict,
        test_data_local_dict,
        train_data_num,
        device,
        args,
        model_trainer,
    ):
        return PluginFedMLTrainer(
            client_index,
            train_data_local_dict,
            train_data_local_num_dict,
            test_data_local_dict,
            train_data_num,
            device,
            args,
            model_trainer,
        )

    def update_dataset(self, client_index=None):
        # fedml_trainer_dist_adapter.py: ``client_index or self.client_index`` turns user 0
        # into the silo's own index.
        self.trainer.update_dataset(int(self.client_index if client_index is None else client_index))


class State(enum.Enum):
    ANNOUNCING = "announcing"
    LISTENING = "listening"
    REJOINING = "rejoining"
    DONE = "done"


class SecureSiloMessages:
    """A silo's messages of secure aggregation's stages (secure_silo.py), as
    :class:`PluginClientMasterManager` handles them (its ``rank``, transport and trainer)."""

    rank: int
    client_real_id: int
    secure: Optional[SecureSiloRound]
    setup: SiloSetup
    com_manager: Any
    outcome: SiloOutcome
    rules: Optional[DataOwnerRules]  # a data owner's (None in shared mode)

    @property
    def trainer(self) -> PluginFedMLTrainer:
        raise NotImplementedError  # PluginClientMasterManager's

    def _send_or_rejoin(self, message: Message, what: str) -> None:
        raise NotImplementedError  # PluginClientMasterManager's

    def _decline(self, round_idx: int, reason: str) -> None:
        """Tell the server that this silo's own checks refused round ``round_idx``, and why, so the
        round goes on without it now rather than at its deadline, and the server's operator reads
        the cause (the refusal itself is this silo's: nothing of its data goes with it)."""
        message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, 0)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, wire.DECLINED)
        message.add_params(wire.REASON, f"silo rank {self.rank}: {reason}"[:2000])
        self._send_or_rejoin(message, f"its refusal of round {round_idx}")

    def _secure_round(self, round_idx: int, terms: Any, received: Any, trained: Any) -> Optional[SecureSiloRound]:
        """This silo's part of the round's secure aggregation, its update clipped and encoded;
        None (logged) when the server's terms are not this run's."""
        try:
            return SecureSiloRound.start(
                self.rank,
                round_idx,
                terms,
                self.setup,
                received,
                trained,
                self.trainer.trainer,
                self.com_manager.settings,
            )
        except SecAggError as err:
            logger.error("silo rank %d: round %d: %s; it sends no update this round", self.rank, round_idx, err)
            self._decline(round_idx, str(err))
            return None

    def _on_secagg(self, msg_params: Message) -> None:
        kind, round_idx = int(msg_params.get_type()), int(msg_params.get(ROUND_KEY))
        if self.secure is None or self.secure.round_idx != round_idx:
            logger.warning(
                "silo rank %d: a secure-aggregation message for round %d, which it is not in", self.rank, round_idx
            )
            return
        survivors = None
        try:
            params = dict(msg_params.get_params())
            if kind in (wire.SECAGG_SURVIVORS, wire.SECAGG_UNMASK) and self.rules is not None:
                survivors = [int(r) for r in params["survivors"]]
                decision = self.rules.unmasking(round_idx, survivors)
                if decision.refused:
                    raise SecAggError(str(decision.reason))
            answer, params, tensors = self.secure.answer(kind, params)
        except SecAggError as err:
            logger.error(
                "silo rank %d: round %d: %s; it leaves this round's secure aggregation", self.rank, round_idx, err
            )
            self.secure = None
            self._decline(round_idx, str(err))
            return
        if kind == wire.SECAGG_UNMASK and survivors is not None:
            # kept only now, as the shares leave: a round declined before this (too few survivors,
            # a list it would not sign) revealed nothing, and a resumed server may run it again (issue 76)
            self.outcome.unmasked_for(round_idx, survivors)
        self._send_secagg(answer, params, round_idx, tensors)

    def _send_secagg(self, kind: int, params: Dict[str, Any], round_idx: int, tensors: Any = None) -> None:
        message = Message(kind, self.client_real_id, 0)
        for key, value in params.items():
            message.add_params(key, value)
        if tensors is not None:
            message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, tensors)
        self._send_or_rejoin(message, f"its secure-aggregation message (type {kind}) of round {round_idx}")


class PluginClientMasterManager(SecureSiloMessages, ClientMasterManager):
    """The states of the module doc, over FedML's message dispatch and our transport."""

    GOODBYE_SECONDS = 2.0  # a finished run's goodbye: a server that has already ended is not waited for
    # Idle, the silo looks at its clock every fraction of a second: a gap this long means it was not
    # running (frozen, a suspended machine), and the server may have gone on without it.
    FROZEN_SECONDS = 5.0
    TWIN_RETRY_SECONDS = 5.0  # refused while its earlier process holds the seat: announce again this often

    def __init__(
        self,
        args: Any,
        trainer_dist_adapter: Any,
        comm: Any = None,
        rank: int = 0,
        size: int = 0,
        backend: str = "GRPC",
        *,
        policy: SiloPolicy,
        setup: SiloSetup,
    ) -> None:
        super().__init__(args, trainer_dist_adapter, comm, rank, size, backend)
        self.policy, self.setup, self.mode = policy, setup, data_mode(setup.own_data)
        self.own_user = self.mode.own_user(rank)
        self.state = State.ANNOUNCING
        self.state_since = self.last_heard = self.last_awake = time.monotonic()
        self.last_model: Optional[float] = None
        self.secure: Optional[SecureSiloRound] = None  # the round's secure aggregation, while it runs
        self.slowest_gap: Optional[float] = None  # between two models from the server
        self.gaps_measured = 0
        self.outcome = setup.outcome or SiloOutcome(self.own_user)  # what a data owner keeps (run layer's)
        # a data owner's own rules (silo/rules.py): what it trains, evaluates and unmasks, whatever is asked
        self.rules = (
            None
            if self.own_user is None
            else DataOwnerRules(
                rank, self.own_user, self.outcome, self.num_rounds, setup.scheduled, setup.evaluates, setup.privacy
            )
        )
        self.announce_again_at: Optional[float] = None  # refused as a twin: when to announce again

    def _become(self, state: State) -> None:
        self.state, self.state_since = state, time.monotonic()

    @property
    def trainer(self) -> PluginFedMLTrainer:
        return self.trainer_dist_adapter.trainer

    # -- messages -----------------------------------------------------------------------------------
    def register_message_receive_handlers(self) -> None:
        self.register_message_receive_handler(MyMessage.MSG_TYPE_CONNECTION_IS_READY, self._on_ready)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, self._on_check_status)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_INIT_CONFIG, self._on_model)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT, self._on_model)
        self.register_message_receive_handler(wire.EVALUATE, self._on_evaluate)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_FINISH, self._on_finish)
        self.register_message_receive_handler(wire.SECAGG_KEYS, self._on_secagg)
        self.register_message_receive_handler(wire.SECAGG_SHARES, self._on_secagg)
        self.register_message_receive_handler(wire.SECAGG_SURVIVORS, self._on_secagg)
        self.register_message_receive_handler(wire.SECAGG_UNMASK, self._on_secagg)

    def receive_message(self, msg_type, msg_params) -> None:
        if msg_params.get_sender_id() != self.rank:  # a word from the server (not the local "ready")
            if self.announce_again_at is not None and msg_type != MyMessage.MSG_TYPE_S2C_FINISH:
                # Refused as a twin and not yet taken back: the server still seats this silo's
                # earlier process, so what it sends is that process's (a model sent before the kill
                # reaches this address on a retry). Answering it would spend the user's data (and
                # its DP budget) on an update the server refuses, and would stop the announcements.
                logger.info(
                    "silo rank %d: message type %s from the server is for this silo's earlier process "
                    "(the server has not taken this one back yet): not answered",
                    self.rank,
                    msg_type,
                )
                return
            now = self.last_heard = time.monotonic()
            if self.state is not State.LISTENING:
                if self.state is State.REJOINING:
                    logger.info("silo rank %d: the server answered; the silo is back in the run", self.rank)
                self._become(State.LISTENING)
            if msg_type in (
                MyMessage.MSG_TYPE_S2C_INIT_CONFIG,
                MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT,
                wire.EVALUATE,
            ):
                if self.last_model is not None:
                    self.slowest_gap = max(now - self.last_model, self.slowest_gap or 0.0)
                    self.gaps_measured += 1
                self.last_model = now
                # An upload to a server that was up and is gone is retried no longer than it is waited for.
                limit = self.policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
                self.com_manager.retry_seconds = min(self.policy.connect_timeout, limit)
        try:
            super().receive_message(msg_type, msg_params)
        except Exception as err:  # the silo ends: the server hears why now, not at its deadline
            tell_failure(self, err)
            raise
        self.last_awake = time.monotonic()

    def _on_ready(self, msg_params: Message) -> None:
        self._announce(time.monotonic() + self.policy.connect_timeout)

    def _announce(self, deadline: float) -> None:
        """The silo's ONLINE status with its announcement; :class:`PeerUnreachable` if the server
        did not take it by ``deadline``. Refused because the silo's earlier process still holds
        its seat (this one was started again after a kill), it announces itself again every few
        seconds until the server gives that process up (at its deadline); refused as another run's
        or another rank's, it stops at once (:class:`SiloFailure`), naming the server's words."""
        message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, 0)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, self.ONLINE_STATUS_FLAG)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
        message.add_params(wire.HELLO, self.setup.hello)
        refused = self.com_manager.send_message(message, deadline=deadline)
        reason = wire.refusal_reason(refused)
        self.announce_again_at = None
        if reason == wire.RUN_OVER:  # it started (or came back) after the server ended the run
            words = wire.refusal_text(str(refused))
            self._become(State.DONE)
            self.finish()
            if words == wire.RUN_FINISHED:  # every round ran: the run finished, and so does this process
                logger.info("silo rank %d: the run had finished when this silo announced itself", self.rank)
                return
            self.outcome.ended_early = words
            logger.warning("silo rank %d: the server ended the run before this silo took part: %s", self.rank, words)
            return
        if reason == wire.DISAGREEMENT:  # told at once, even where the server cannot reach this silo
            raise SiloFailure(f"silo rank {self.rank}: refused by the server: {wire.refusal_text(str(refused))}")
        if reason in (OTHER_RUN, IDENTITY):
            raise SiloFailure(
                f"silo rank {self.rank}: the server refused its announcement: {refused}; this silo cannot "
                f"take part as it was started (its --run_id, its certificate, or its rank in the address file)"
            )
        if reason == TWIN:
            wait = min(self.TWIN_RETRY_SECONDS, self.policy.round_timeout)
            self.announce_again_at = time.monotonic() + wait
            self.state_since = self.last_heard = time.monotonic()  # the server answered: it is there
            logger.warning(
                "silo rank %d: the server still seats this silo's earlier process; announcing itself again "
                "every %g s until the server gives that process up at its deadline",
                self.rank,
                wait,
            )

    def _on_check_status(self, msg_params: Message) -> None:
        """The server hears this silo, or (LEFT_OUT) it gave up on it: then the silo announces
        itself again, to take part from the next round."""
        if msg_params.get(wire.LEFT_OUT) and self.state is State.LISTENING:
            self._rejoin("the server gave up on this silo (an answer of it came late, or not at all)")

    def _on_model(self, msg_params: Message) -> None:
        round_idx = int(msg_params.get(ROUND_KEY))
        user = int(msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_INDEX))
        if self.own_user is not None and user != self.own_user:
            raise SiloFailure(
                f"silo rank {self.rank}: the server asked it to train user {user}; it holds user "
                f"{self.own_user}'s data only (comm_args.silo_data own)"
            )
        if round_idx >= self.num_rounds and self.rules is not None:  # data-owner mode has no final model
            self._refuse(round_idx, self.rules.final_model(round_idx).reason, msg_params)
            return
        self.round_idx = round_idx
        self.trainer_dist_adapter.update_dataset(user)
        self.trainer_dist_adapter.update_model(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
        if round_idx >= self.num_rounds:  # shared mode: the final model, evaluated and said goodbye to
            self._goodbye(self.trainer.evaluate(round_idx, received=True))
            self.finish()
            return
        after = self.setup.figures_after  # DP-SGD: figures only of a model the server evaluates
        figures = self.mode.figures_with_updates and (after is None or (round_idx >= 1 and after(round_idx - 1)))
        counts = self.trainer.evaluate(round_idx, received=True) if figures else None
        received = msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
        decision = self.rules.training(round_idx, received) if self.rules is not None else None
        if decision is not None and decision.refused:
            self._refuse(round_idx, decision.reason, msg_params)
            return
        stored = decision.stored if decision is not None and decision.action == STORED else None
        if stored is not None:
            logger.warning(
                "silo rank %d: round %d again, on the model it trained it on (a resumed server): the stored answer "
                "goes, not a retraining",
                self.rank,
                round_idx,
            )
            weights, samples = stored.weights, stored.samples
        else:
            weights, samples = self.trainer_dist_adapter.train(round_idx)
            if self.setup.privacy is not None:  # the round's local update used its user's data
                self.setup.privacy.trained(round_idx, [user])
            answer = None
            if self.own_user is not None:
                answer = StoredAnswer(round_idx, state_digest(received), dict(weights), int(samples))
            self.outcome.trained(round_idx, answer)  # kept after its account: a restarted silo counts this use
        terms = msg_params.get(wire.SECAGG)
        if terms is not None or self.setup.secure_threshold:
            self.secure = self._secure_round(round_idx, terms, received, weights)
            if self.secure is not None:
                self._send_secagg(wire.SECAGG_ADVERT, {"advert": advert_to_wire(self.secure.advertise())}, round_idx)
            return
        message = Message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self.client_real_id, 0)
        message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, weights)
        message.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, samples)
        message.add_params(wire.SILO_METRICS, counts)
        training = self.trainer.training_figures(round_idx)
        if training is not None:
            message.add_params(wire.TRAINING, training)
        self._send_or_rejoin(message, f"its update for round {round_idx}")

    def _refuse(self, round_idx: int, reason: Optional[str], msg_params: Message) -> None:
        """This silo's own rules refuse what the server asked of round ``round_idx``: logged, and the
        server told why (a decline), so it goes on without this silo now, not at its deadline."""
        logger.error(
            "silo rank %d: refuses round %d from the server (session %s): %s",
            self.rank,
            round_idx,
            msg_params.get(SESSION_KEY),
            reason,
        )
        self._decline(round_idx, str(reason))

    def _on_evaluate(self, msg_params: Message) -> None:
        round_idx = int(msg_params.get(ROUND_KEY))
        model = msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
        if self.rules is None:  # an evaluation request exists in data-owner mode only
            raise SiloFailure(f"silo rank {self.rank}: an evaluation request in shared mode (comm_args.silo_data)")
        decision = self.rules.evaluation(round_idx, model)
        if decision.refused:
            self._refuse(round_idx, decision.reason, msg_params)
            return
        if decision.action == STORED:  # the same round's model again (a resumed server): the same counts
            logger.warning(
                "silo rank %d: the evaluation after round %d again, on the model it evaluated: the stored counts go, "
                "no new personalization",
                self.rank,
                round_idx,
            )
            counts = decision.stored
        else:
            self.trainer_dist_adapter.update_dataset(self.own_user)
            self.trainer_dist_adapter.update_model(model)
            # the use is in the ledger and the record before the counts leave
            counts = with_privacy(self.trainer.evaluate(round_idx), self.setup.privacy)
            self.outcome.evaluated(counts, model)
        message = Message(wire.EVALUATION, self.client_real_id, 0)
        message.add_params(wire.SILO_METRICS, counts)
        message.add_params(ROUND_KEY, round_idx)
        self._send_or_rejoin(message, f"its evaluation of round {round_idx}")

    def _on_finish(self, msg_params: Message) -> None:
        reason = msg_params.get(wire.REASON)
        self._become(State.DONE)
        self.finish()
        if msg_params.get(wire.REFUSED):  # this silo cannot take part: its run fails, saying why
            raise SiloFailure(f"silo rank {self.rank}: {reason}")
        if reason:
            self.outcome.ended_early = str(reason)
            logger.warning("silo rank %d: the server ended the run early: %s", self.rank, reason)
        else:
            logger.info("silo rank %d: the server ended the run", self.rank)

    def _goodbye(self, counts: Dict[str, Any]) -> None:
        say_goodbye(self, counts)

    # -- losing and finding the server --------------------------------------------------------------
    def _send_or_rejoin(self, message: Message, what: str) -> None:
        try:
            self.com_manager.send_message(message)
        except PeerUnreachable as err:
            self._rejoin(f"the server did not take {what} ({err})")

    def _rejoin(self, why: str) -> None:
        """Announce the silo again (the server takes back a silo it gave up on); stop if the server
        does not take the announcement within ``connect_timeout``."""
        logger.warning(
            "silo rank %d: %s; announcing itself again (for up to comm_args.connect_timeout=%g s)",
            self.rank,
            why,
            self.policy.connect_timeout,
        )
        self._become(State.REJOINING)
        try:
            self._announce(time.monotonic() + self.policy.connect_timeout)
        except PeerUnreachable as err:
            self._gone(f"{why}, and it did not take the silo's announcement either ({err})")

    def _gone(self, why: str) -> None:
        self._become(State.DONE)
        self.com_manager.stop_receive_message()
        raise SiloFailure(f"silo rank {self.rank}: {why}; is the server gone?")

    def on_idle(self) -> None:
        now = time.monotonic()
        asleep, self.last_awake = now - self.last_awake, now
        if self.announce_again_at is not None and now >= self.announce_again_at and self.state is not State.LISTENING:
            try:
                self._announce(now + self.policy.connect_timeout)
            except PeerUnreachable as err:
                self._gone(f"it did not take the silo's announcement ({err})")
        elif self.state is State.LISTENING and asleep > self.FROZEN_SECONDS:
            self._rejoin(f"this silo was not running for {asleep:.1f} s (frozen or suspended)")
        elif self.state in (State.ANNOUNCING, State.LISTENING):
            limit = self.policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
            if now - self.last_heard > limit:
                gap = "none measured" if self.slowest_gap is None else f"{self.slowest_gap:.2f} s"
                self._rejoin(
                    f"nothing from the server for {now - self.last_heard:.1f} s (its limit {limit:.1f} s: comm_args."
                    f"round_timeout_factor x the slowest gap between its models so far ({gap}, "
                    f"{self.gaps_measured} measured), + {self.policy.MIN_ADAPTIVE_SECONDS:g} s; before "
                    f"{self.policy.ADAPT_AFTER_ROUNDS}: 2 x comm_args.round_timeout + comm_args.connect_timeout)"
                )
        elif self.state is State.REJOINING and now - self.state_since > self.policy.connect_timeout:
            self._gone(
                f"the server took the silo's announcement but sent nothing for "
                f"{now - self.state_since:.1f} s (comm_args.connect_timeout={self.policy.connect_timeout:g})"
            )
