from __future__ import annotations

import logging
import queue
import time
from typing import Any, Dict, List, Tuple

from ...silo.server.records import SiloServerDriver
from ...core.errors import ConfigError
from ...secagg import vectors
from ..bootstrap import import_fedml
from ..trainer_aggregator import aggregate_with_hooks
from ...silo.server import readiness
from ...silo.server.agreement import ServerSetup
from ...silo.server.events import NOTICE, Action, EndRun, Fail, Finish, Goodbye, Hello, Listening, Record, Refuse, Send
from ...silo.server.events import (
    Evaluation,
    SecAggMessage,
    SiloDeclined,
    SiloFailed,
    Stopped,
    Tick,
    Undelivered,
    Update,
)
from .server_sends import ServerSends
from ...silo.server.phases import Phase
from ...silo.server.policy import SiloPolicy
from ...silo.server.protocol import SiloServerProtocol
from .transport import ARRIVED_KEY, ROUND_KEY, SESSION_KEY, SIZE_KEY, OwnTransport
from ...net import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator  # noqa: E402
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)

# What the protocol may ask of the run's record (the SiloServerDriver's methods).
RECORDS = frozenset(
    {
        "round_finished",
        "record_lost_silos",
        "record_rejoined_silo",
        "record_silo_evaluation",
        "record_federated_evaluation",
        "record_secure_evaluation",
        "record_rejected_update",
        "record_refusals",
        "record_secure_round",
        "record_training",
    }
)


class PluginFedMLAggregator(FedMLAggregator):
    """Averages one round's updates only (FedML's averages every upload slot it ever filled)."""

    def aggregate_updates(self, updates: Dict[int, Tuple[float, Any]], senders: Dict[int, str]) -> Any:
        """The new global model from ``updates`` (position in the round's sample -> (sample count,
        model)), taken in sp's order of sampled users, through the aggregator's hooks; the
        plugin's aggregator hears who sent each (``senders``), for its update screen's record."""
        if hasattr(self.aggregator, "senders"):
            self.aggregator.senders = [senders[p] for p in sorted(updates)]
        averaged, _, _ = aggregate_with_hooks(self.aggregator, [updates[p] for p in sorted(updates)])
        self.set_global_model_params(averaged)
        return averaged


class _FedMLGlobalModel:
    """The protocol's :class:`~.rounds.GlobalModel` over FedML's aggregator; FedML's counter
    ``args.round_idx`` says the round while the aggregator's hooks run."""

    def __init__(self, aggregator: PluginFedMLAggregator, args: Any) -> None:
        self.aggregator, self.args = aggregator, args

    def params(self) -> Any:
        return self.aggregator.get_global_model_params()

    def aggregate(self, round_idx: int, updates: Dict[int, Tuple[float, Any]], senders: Dict[int, str]) -> Any:
        self.args.round_idx = round_idx
        return self.aggregator.aggregate_updates(updates, senders)

    # Secure aggregation: the plugin's algorithm on the global model, past FedML's per-update hooks
    # (the server has no update to hand them).
    @property
    def algorithm(self) -> Any:
        algorithm = getattr(self.aggregator.aggregator, "algorithm", None)
        if algorithm is None:
            raise ConfigError(
                "secagg_args.enable_secagg: the server's aggregator is not the plugin's (a ServerAggregator "
                "handed to FedMLRunner); secure aggregation needs the plugin's algorithm on the server"
            )
        return algorithm

    def secure_average(self, round_idx: int, average_delta: Any) -> Any:
        self.args.round_idx = round_idx
        state = self.algorithm.aggregate_secure_mean(round_idx, average_delta, self.params())
        self.aggregator.set_global_model_params(state)
        return state

    def keep(self, round_idx: int) -> Any:
        self.args.round_idx = round_idx
        state = self.algorithm.keep_global(round_idx, self.params())
        self.aggregator.set_global_model_params(state)
        return state

    def update_bound(self) -> float:
        settings = self.algorithm.settings
        names = self.algorithm.parameter_names
        return vectors.bound(self.params(), names, settings.max_update_ratio, settings.max_update_norm)

    def vector_length(self) -> int:
        return vectors.length(self.params(), self.algorithm.parameter_names)


class PluginServerManager(OwnTransport, FedMLServerManager):
    """FedML's face of :class:`~.protocol.SiloServerProtocol`. ``policy`` decides deadlines and
    when to stop; ``driver`` samples each round's users and takes each new global model and
    evaluation; ``setup`` says the mode, the silos and what they must agree on; a resumed server
    starts at ``start_round`` and names the session it ``resumes``."""

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
        driver: SiloServerDriver,
        setup: ServerSetup,
        start_round: int = 0,
        resumes: str = "",
    ) -> None:
        super().__init__(args, aggregator, comm, client_rank, client_num, backend)
        self.driver = driver
        model = _FedMLGlobalModel(aggregator, args)
        self.protocol = SiloServerProtocol(
            setup, policy, driver, model, self.round_num, args.client_num_per_round, start_round
        )
        self.com_manager.screen_announcement = self.protocol.roster.fingerprint_problem
        self.protocol.sightings = self.com_manager.sightings
        if resumes:  # every message says which server process this one resumes (the silos check it)
            self.com_manager.resumes = resumes
            logger.info("resuming at round %d the run of server session %s", start_round, resumes)
        self.sends = ServerSends(self.com_manager)
        self._arrived = 0.0  # when the last message handled arrived
        self._late: "queue.Queue[Any]" = queue.Queue()  # Undelivered events (or errors) of background sends

    def on_idle(self) -> None:
        """The transport's tick: a deadline may have passed. While messages wait in its queue (the
        server was busy), the protocol's time is the arrival of the last one it handled: a message
        that came before a deadline is never judged late because the server took it late."""
        while True:  # what the background sends reported first: they happened before this tick
            try:
                late = self._late.get_nowait()
            except queue.Empty:
                break
            if isinstance(late, BaseException):
                raise late
            self._handle(late)
        now = time.monotonic()
        if self.com_manager.backlog():
            now = min(now, self._arrived)
        self._handle(Tick(now))

    def _time_of(self, msg_params: Message) -> float:
        """When a silo's message arrived: the protocol's time for it."""
        arrived = msg_params.get(ARRIVED_KEY)
        self._arrived = float(arrived) if arrived else time.monotonic()
        return self._arrived

    def run(self) -> None:
        try:
            super().run()
        except KeyboardInterrupt:  # SIGINT or SIGTERM (the run layer writes what was measured)
            self._handle_at_end(Stopped(time.monotonic(), "the server was interrupted (SIGINT or SIGTERM)"))
            raise
        except Exception as err:  # the protocol's own stop (its Fail) was told already; anything else is now
            self._handle_at_end(
                Stopped(time.monotonic(), f"the server stopped the run: {type(err).__name__}: {err}", failed=True)
            )
            raise

    def _handle_at_end(self, event: Stopped) -> None:
        """The process is ending: tell the silos (the protocol knows whether they were told)."""
        try:
            self._handle(event)
        except Exception as err:  # noqa: BLE001 - the original error is what the caller raises
            logger.warning("could not tell every silo that the run ended: %s", err)
        if self.com_manager.is_running:
            self.com_manager.stop_receive_message()

    # -- events in ----------------------------------------------------------------------------------
    def register_message_receive_handlers(self) -> None:
        self.register_message_receive_handler(MyMessage.MSG_TYPE_CONNECTION_IS_READY, self._on_listening)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self._on_status)
        self.register_message_receive_handler(MyMessage.MSG_TYPE_C2S_SEND_MODEL_TO_SERVER, self._on_update)
        self.register_message_receive_handler(wire.EVALUATION, self._on_evaluation)
        for kind in wire.SECAGG_FROM_SILO:
            self.register_message_receive_handler(kind, self._on_secagg)

    def _on_listening(self, msg_params: Message) -> None:
        readiness.signal(readiness.LISTENING)
        self._handle(Listening(time.monotonic()))

    def _on_status(self, msg_params: Message) -> None:
        silo = int(msg_params.get_sender_id())
        status = msg_params.get(MyMessage.MSG_ARG_KEY_CLIENT_STATUS)
        now = self._time_of(msg_params)
        if status == self.ONLINE_STATUS_FLAG:
            self._handle(Hello(now, silo, msg_params.get(wire.HELLO), msg_params.get(SESSION_KEY)))
        elif status == self.RUN_FINISHED_STATUS_FLAG:
            self._handle(Goodbye(now, silo, msg_params.get(wire.SILO_METRICS)))
        elif status == wire.FAILED:
            self._handle(SiloFailed(now, silo, str(msg_params.get(wire.REASON) or "no reason given")))
        elif status == wire.LEAVING:
            self._handle(SiloFailed(now, silo, str(msg_params.get(wire.REASON) or "stopped"), stopped=True))
        elif status == wire.DECLINED:
            self._handle(SiloDeclined(now, silo, str(msg_params.get(wire.REASON) or "no reason given")))

    def _on_update(self, msg_params: Message) -> None:
        self._handle(
            Update(
                self._time_of(msg_params),
                int(msg_params.get_sender_id()),
                msg_params.get(ROUND_KEY),
                msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES),
                msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                msg_params.get(wire.SILO_METRICS),
                msg_params.get(wire.TRAINING),
            )
        )

    def _on_evaluation(self, msg_params: Message) -> None:
        now = self._time_of(msg_params)
        self._handle(Evaluation(now, int(msg_params.get_sender_id()), msg_params.get(wire.SILO_METRICS)))

    def _on_secagg(self, msg_params: Message) -> None:
        params = dict(msg_params.get_params())
        self._handle(
            SecAggMessage(
                self._time_of(msg_params),
                int(msg_params.get_sender_id()),
                int(msg_params.get_type()),
                params.get(ROUND_KEY),
                params,
                params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                int(params.get(SIZE_KEY) or 0),
            )
        )

    # -- actions out --------------------------------------------------------------------------------
    def _handle(self, event: Any) -> None:
        """Hand ``event`` to the protocol and carry out what it asks, then the events those actions
        give (sends that failed), until none is left."""
        pending: List[Any] = [event]
        while pending:
            phase = self.protocol.phase
            self.args.round_idx = self.protocol.round_idx  # FedML's counter, read by its aggregator
            actions = self.protocol.handle(pending.pop(0))
            self._hold_seats()  # before the sends, which may take a while: the seats hold from now
            for action in actions:
                pending.extend(self._carry_out(action))
            self.args.round_idx = self.protocol.round_idx
            self._hold_seats()
            if self.protocol.phase is not phase:
                self.is_initialized = self.protocol.phase not in (Phase.STARTING, Phase.ONLINE)
                readiness.signal(self.protocol.phase.name.lower())

    def _hold_seats(self) -> None:
        """Once training started, each live silo's process keeps its seat against a second one with
        its key (conversations.py); before, or once given up on, a new process may take over."""
        training = self.protocol.phase not in (Phase.STARTING, Phase.ONLINE)
        self.com_manager.conversations.hold_seats(set(self.protocol.roster.live) if training else set())

    def _carry_out(self, action: Action) -> List[Any]:
        """Carry out one action; the events it gives (a send that did not reach some silos)."""
        if isinstance(action, Send):
            if action.purpose == NOTICE:
                self.sends.notify(action.messages, action.deadline)
                return []
            purpose, stage = action.purpose, self.protocol.stage

            def report(outcome: Any) -> None:  # from the sending thread: handled at the next tick
                late = (
                    outcome
                    if isinstance(outcome, BaseException)
                    else Undelivered(time.monotonic(), purpose, outcome, stage)
                )
                self._late.put(late)

            # A silo heard from listened: its port refusing connections means it has ended.
            self.sends.send(action.messages, action.deadline, set(self.protocol.roster.hellos), report)
        elif isinstance(action, Record):
            self._record(action)
        elif isinstance(action, Refuse):
            self.sends.count_refusal(action.silo, action.kind, action.text)
        elif isinstance(action, EndRun):
            self.com_manager.ended = action.reason or ""  # a silo that announces itself from now on is told
            self.sends.end_run(action, self.protocol.round_idx)
            if action.stop_listening:
                self.com_manager.stop_receive_message()
        elif isinstance(action, Finish):
            self.finish()
        elif isinstance(action, Fail):
            raise action.error
        else:
            raise TypeError(f"not an action of the cross-silo protocol: {action!r}")
        return []

    def _record(self, record: Record) -> None:
        if record.method not in RECORDS:
            raise ValueError(f"the cross-silo protocol asked for an unknown record {record.method!r}")
        args = record.args
        if record.method == "record_refusals":
            args = (self.sends.refusal_totals(),)
        elif record.method == "record_federated_evaluation":  # its start, on the clock the record reads
            args = (*args[:3], time.perf_counter() - (time.monotonic() - args[3]))
        elif record.method == "record_secure_evaluation":
            args = (*args[:4], time.perf_counter() - (time.monotonic() - args[4]), *args[5:])
        getattr(self.driver, record.method)(*args)
