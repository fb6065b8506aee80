"""The cross-silo client (a silo): FedML's client manager, trainer and adapter (cross_silo/client/)
as the thin adapter of the silo's protocol (fedml_perfedavg/silo/protocol.py, which holds its states,
rules and deadlines with no I/O).

FedML's trainer never tells the ``ClientTrainer`` which user it trains, and its evaluations cannot
say how a model does in counts the server can check: :class:`PluginFedMLTrainer` does both. A
silo's own error ends it with FAILED to the server, a stop signal with LEAVING: either way the server
gives it up at once, and a new process of it (started again) is taken back when it announces itself.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from collections import deque
from typing import Any, Dict, List, Optional

from ...core.errors import SiloFailure
from ...stopping import stop_in_place_of
from ...core.ledger import silo_report
from ..bootstrap import import_fedml
from ...silo.server.agreement import SiloSetup
from ...silo import events
from ...silo.outcome import SiloOutcome
from ...silo.protocol import SiloProtocol, SiloState
from ...silo.server.policy import SiloPolicy
from ...silo.secure import SecureSiloRound
from ...net.conversations import TWIN
from .transport import IDENTITY, OTHER_RUN, ROUND_KEY, SESSION_KEY, OwnTransport, PeerUnreachable
from ...net import wire

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
    if manager.state is not SiloState.LISTENING:
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
    if manager.state not in (SiloState.LISTENING, SiloState.ANNOUNCING, SiloState.REJOINING):
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


#: the server's stage messages of secure aggregation, by the silo protocol's names for them
SECURE_STAGES = {
    wire.SECAGG_KEYS: events.KEYS,
    wire.SECAGG_SHARES: events.SHARES,
    wire.SECAGG_SURVIVORS: events.SURVIVORS,
    wire.SECAGG_UNMASK: events.UNMASK,
}


def answer_of(refused: Optional[str]) -> events.Answered:
    """The server's answer to an announcement (the transport's refusal, None if it took it), in the
    silo protocol's words; a refusal for another reason (the server's own trouble) is not an answer
    the silo acts on."""
    reason = wire.refusal_reason(refused)
    words = wire.refusal_text(str(refused)) if refused is not None else ""
    if reason == wire.RUN_OVER:
        answer = events.RUN_FINISHED if words == wire.RUN_FINISHED else events.RUN_OVER
    else:
        answer = {
            wire.DISAGREEMENT: events.DISAGREEMENT,
            OTHER_RUN: events.NOT_THIS_RUN,
            IDENTITY: events.NOT_THIS_RUN,
            TWIN: events.TWIN,
        }.get(reason or "", events.TAKEN)
    return events.Answered(time.monotonic(), answer, words, str(refused or ""))


class PluginClientMasterManager(OwnTransport, ClientMasterManager):
    """FedML's client manager as the thin adapter of the silo's protocol (silo/protocol.py): each
    message from the server becomes an event, each action the protocol returns is carried out here
    (the trainer, the transport), and each piece of work's result goes back as an event."""

    GOODBYE_SECONDS = 2.0  # a finished run's goodbye: a server that has already ended is not waited for

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
        self.policy, self.setup, self.mode = policy, setup, setup.mode
        self.own_user = self.mode.own_user(rank)
        self.protocol = SiloProtocol(
            rank,
            self.num_rounds,
            policy,
            setup,
            own_user=self.own_user,
            figures_with_updates=self.mode.figures_with_updates,
            start_secure=self._start_secure,
            now=time.monotonic(),
            start_secure_evaluation=self._start_secure_evaluation,
        )

    @property
    def state(self) -> SiloState:
        return self.protocol.state

    @property
    def outcome(self) -> SiloOutcome:
        return self.protocol.outcome

    @property
    def trainer(self) -> PluginFedMLTrainer:
        return self.trainer_dist_adapter.trainer

    # -- messages in: events ------------------------------------------------------------------------
    def register_message_receive_handlers(self) -> None:
        self.register_message_receive_handler(MyMessage.MSG_TYPE_CONNECTION_IS_READY, self._on_ready)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, self._on_check_status)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_INIT_CONFIG, self._on_model)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT, self._on_model)
        self.register_message_receive_handler(wire.EVALUATE, self._on_evaluate)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_S2C_FINISH, self._on_finish)
        for kind in SECURE_STAGES:
            self.register_message_receive_handler(kind, self._on_secagg)

    def receive_message(self, msg_type, msg_params) -> None:
        try:
            super().receive_message(msg_type, msg_params)
        except Exception as err:
            stop_in_place_of(err)  # the silo was stopped: not its failure, no traceback
            tell_failure(self, err)  # the silo ends: the server hears why now, not at its deadline
            raise

    def _on_ready(self, msg_params: Message) -> None:
        self._handle(events.Ready(time.monotonic()))

    def _on_check_status(self, msg_params: Message) -> None:
        self._handle(events.StatusCheck(time.monotonic(), bool(msg_params.get(wire.LEFT_OUT))))

    def _on_model(self, msg_params: Message) -> None:
        self._handle(
            events.ModelArrived(
                time.monotonic(),
                int(msg_params.get(ROUND_KEY)),
                int(msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_INDEX)),
                msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                msg_params.get(wire.SECAGG),
                msg_params.get(SESSION_KEY),
            )
        )

    def _on_evaluate(self, msg_params: Message) -> None:
        round_idx, model = int(msg_params.get(ROUND_KEY)), msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
        terms = msg_params.get(wire.SECAGG)
        self._handle(events.EvaluationAsked(time.monotonic(), round_idx, model, msg_params.get(SESSION_KEY), terms))

    def _on_secagg(self, msg_params: Message) -> None:
        kind = int(msg_params.get_type())
        params = dict(msg_params.get_params())
        round_idx = int(msg_params.get(ROUND_KEY))
        self._handle(events.SecureStage(time.monotonic(), SECURE_STAGES[kind], kind, round_idx, params))

    def _on_finish(self, msg_params: Message) -> None:
        reason = msg_params.get(wire.REASON)
        self._handle(events.FinishArrived(time.monotonic(), reason, bool(msg_params.get(wire.REFUSED))))

    def on_idle(self) -> None:
        self._handle(events.Tick(time.monotonic()))

    # -- actions out ------------------------------------------------------------------------------------
    def _handle(self, event: Any) -> None:
        """``event`` to the protocol, then its actions in order; an action whose result is an event
        (a training, an announcement's answer, a send not taken) hands it back before the next."""
        pending = deque(self.protocol.handle(event))
        while pending:
            result = self._carry_out(pending.popleft())
            if result is not None:
                pending.extendleft(reversed(self.protocol.handle(result)))
        self.protocol.handle(events.WorkDone(time.monotonic()))

    def _carry_out(self, action: Any) -> Any:
        if isinstance(action, events.Train):
            self.round_idx = action.round_idx
            self.trainer_dist_adapter.update_dataset(action.user)
            self.trainer_dist_adapter.update_model(action.model)
            counts = self.trainer.evaluate(action.round_idx, received=True) if action.figures else None
            weights, samples = self.trainer_dist_adapter.train(action.round_idx)
            return events.Trained(time.monotonic(), action.round_idx, weights, int(samples), counts)
        if isinstance(action, events.Evaluate):
            self.round_idx = action.round_idx
            self.trainer_dist_adapter.update_dataset(action.user)
            self.trainer_dist_adapter.update_model(action.model)
            if action.final:
                counts = self.trainer.evaluate(action.round_idx, received=True)
            else:  # the use is in the ledger before the counts leave
                counts = with_privacy(self.trainer.evaluate(action.round_idx), self.setup.privacy)
            return events.Evaluated(time.monotonic(), action.round_idx, counts)
        if isinstance(action, events.Announce):
            return self._announce(action.deadline)
        if isinstance(action, events.SendUpdate):
            message = Message(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self.client_real_id, 0)
            message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, action.weights)
            message.add_params(MyMessage.MSG_ARG_KEY_NUM_SAMPLES, action.samples)
            message.add_params(wire.SILO_METRICS, action.counts)
            training = self.trainer.training_figures(action.round_idx)
            if training is not None:
                message.add_params(wire.TRAINING, training)
            return self._send(message, f"its update for round {action.round_idx}")
        if isinstance(action, events.SendEvaluation):
            message = Message(wire.EVALUATION, self.client_real_id, 0)
            message.add_params(wire.SILO_METRICS, action.counts)
            message.add_params(ROUND_KEY, action.round_idx)
            return self._send(message, f"its evaluation of round {action.round_idx}")
        if isinstance(action, events.SendSecure):
            return self._send_secagg(action.kind, action.params, action.round_idx, action.tensors)
        if isinstance(action, events.SendDecline):
            message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, 0)
            message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, wire.DECLINED)
            message.add_params(wire.REASON, action.reason)
            return self._send(message, f"its refusal of round {action.round_idx}")
        if isinstance(action, events.SendGoodbye):
            say_goodbye(self, action.counts)
        elif isinstance(action, events.RetryFor):
            self.com_manager.retry_seconds = action.seconds
        elif isinstance(action, events.Finish):
            self.finish()
        elif isinstance(action, events.StopReceiving):
            self.com_manager.stop_receive_message()
        elif isinstance(action, events.Fail):
            raise action.error if action.error is not None else SiloFailure(action.reason)
        else:
            raise TypeError(f"not an action of a silo's protocol: {action!r}")
        return None

    def _announce(self, deadline: float) -> Any:
        """The silo's ONLINE status with its announcement, sent; the server's answer as an event."""
        message = Message(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, 0)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, self.ONLINE_STATUS_FLAG)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
        message.add_params(wire.HELLO, self.setup.hello)
        try:
            refused = self.com_manager.send_message(message, deadline=deadline)
        except PeerUnreachable as err:
            return events.Unanswered(time.monotonic(), err)
        return answer_of(refused)

    def _send_secagg(self, kind: int, params: Dict[str, Any], round_idx: int, tensors: Any = None) -> Any:
        message = Message(kind, self.client_real_id, 0)
        for key, value in params.items():
            message.add_params(key, value)
        if tensors is not None:
            message.add_params(MyMessage.MSG_ARG_KEY_MODEL_PARAMS, tensors)
        message.add_params(ROUND_KEY, round_idx)  # an evaluation's sum is stamped with its round, not the last model's
        return self._send(message, f"its secure-aggregation message (type {kind}) of round {round_idx}")

    def _send(self, message: Message, what: str) -> Any:
        try:
            self.com_manager.send_message(message)
        except PeerUnreachable as err:
            return events.NotDelivered(time.monotonic(), what, str(err))
        return None

    def _start_secure(self, round_idx: int, terms: Any, received: Any, trained: Any) -> SecureSiloRound:
        """This silo's part of the round's secure aggregation, its update clipped and encoded
        (silo/secure.py); SecAggError where the server's terms are not this run's."""
        return SecureSiloRound.start(
            self.rank, round_idx, terms, self.setup, received, trained, self.trainer.trainer, self.com_manager.settings
        )

    def _start_secure_evaluation(self, round_idx: int, terms: Any, model: Any, counts: Any) -> SecureSiloRound:
        """This silo's part of the secure sum of the evaluation after ``round_idx`` (its figures
        leave it only in that sum); SecAggError where the server's terms are not this run's."""
        return SecureSiloRound.start_evaluation(
            self.rank, round_idx, terms, self.setup, model, counts, self.com_manager.settings
        )
