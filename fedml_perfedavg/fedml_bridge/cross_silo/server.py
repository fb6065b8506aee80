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

The pieces: this class is FedML's face (messages in, the run's start and end); the rounds
(TRAINING, EVALUATING) are :mod:`.rounds`'s, what they wait for :mod:`.open_work`'s, who takes
part :mod:`.membership`'s, what is known of each silo :mod:`.roster`'s, what is sent :mod:`.mail`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Set, Tuple

from ...core.errors import ConfigError, SiloFailure
from ..bootstrap import import_fedml
from ..shims import aggregate_with_hooks
from ...algorithms.base import RoundDriver
from .agreement import SiloSetup
from .mail import FINISH_SECONDS, NOTICE_SECONDS, ServerMail
from .membership import Greeting, SiloMembership
from .open_work import OpenRound, SiloFigures
from .rounds import SiloRounds
from .phases import Phase, PhaseClock
from .policy import SiloPolicy
from .roster import SiloRoster
from . import TRAINING_STARTED
from .transport import ROUND_KEY, SESSION_KEY
from . import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator  # noqa: E402
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


class PluginFedMLAggregator(FedMLAggregator):
    """Averages one round's updates only (FedML's averages every upload slot it ever filled)."""

    def aggregate_updates(self, updates: Dict[int, Tuple[float, Any]]) -> Any:
        """The new global model from ``updates`` (position in the round's sample -> (sample count,
        model)), taken in sp's order of sampled users, through the aggregator's hooks."""
        averaged, _, _ = aggregate_with_hooks(self.aggregator, [updates[p] for p in sorted(updates)])
        self.set_global_model_params(averaged)
        return averaged


class PluginServerManager(FedMLServerManager):
    """The phases of the module doc. ``policy`` decides deadlines and when to stop; ``driver``
    samples each round's users and takes each new global model and evaluation; ``setup`` says
    the mode, the silos and what they must agree on. What is awaited is in ``round`` and
    ``evaluation`` (:mod:`.open_work`); what is sent goes through ``mail`` (:mod:`.mail`)."""

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
        self.mail = ServerMail(self.com_manager, self.roster)
        self.figures = SiloFigures(self.roster, driver, self.mail.count_refusal)
        self.members = SiloMembership(self.roster, policy, driver, self.mail)
        self.rounds = SiloRounds(
            args, self.round_num, aggregator, self.clock, self.members, self.mail, self.figures, driver, setup
        )
        self.final = OpenRound(-1, [], {})  # shared mode: the silos sent the final model
        self.finished: Set[int] = set()  # shared mode: the silos that said goodbye

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
            why = f"did not come online within comm_args.connect_timeout={self.policy.connect_timeout:g} s"
            self.rounds.give_up_on(missing, why, go_on)
            self._start_training()
        elif self.clock.phase is Phase.TRAINING:
            self._after(self.rounds.close_round(f"sent no update within {self.clock.deadline_words()}"))
        elif self.clock.phase is Phase.EVALUATING:
            self._after(self.rounds.close_evaluation(f"sent no evaluation within {self.clock.deadline_words()}"))
        elif self.clock.phase is Phase.FINISHING:
            self.clock.disarm()
            logger.warning(
                "no goodbye from silo rank(s) %s within the round deadline; the run is complete",
                sorted(set(self.roster.live) - self.finished),
            )
            self._complete()

    def run(self) -> None:
        try:
            super().run()
        except KeyboardInterrupt:  # SIGINT or SIGTERM (the run layer writes what was measured)
            self._tell_silos_to_stop("the server was interrupted (SIGINT or SIGTERM)")
            raise
        except SiloFailure as err:  # e.g. too few silos left: the run ends early, saying why
            if self.clock.phase is not Phase.DONE:
                self._tell_silos_to_stop(f"the server stopped the run: {err}")
            raise

    def _tell_silos_to_stop(self, reason: Optional[str], seconds: float = FINISH_SECONDS) -> None:
        """The run is over (``reason``: it failed): every silo that may still wait is told."""
        if self.clock.phase is not Phase.DONE:
            self.clock.enter(Phase.DONE)
        self.driver.record_refusals(self.mail.refusal_totals())
        self.mail.tell_run_over(reason, seconds)
        self.com_manager.stop_receive_message()

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
            self.figures.note(silo, msg_params.get(wire.SILO_METRICS), self.final.user_of(silo), self.round_idx)
            if all(s in self.finished for s in self.roster.live):
                self._complete()

    def _on_update(self, msg_params: Message) -> None:
        self._after(
            self.rounds.on_update(
                int(msg_params.get_sender_id()),
                msg_params.get(ROUND_KEY),
                msg_params.get(MyMessage.MSG_ARG_KEY_NUM_SAMPLES),
                msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS),
                msg_params.get(wire.SILO_METRICS),
            )
        )

    def _on_evaluation(self, msg_params: Message) -> None:
        self._after(self.rounds.on_evaluation(int(msg_params.get_sender_id()), msg_params.get(wire.SILO_METRICS)))

    # -- a silo comes online ------------------------------------------------------------------------
    def _on_hello(self, silo: int, announced: Optional[Dict[str, Any]], session: Optional[str]) -> None:
        if self.clock.phase in (Phase.FINISHING, Phase.DONE) or silo not in self.setup.silos:
            return
        started = self.clock.phase not in (Phase.STARTING, Phase.ONLINE)
        problem = self.roster.problem_with(silo, announced)
        if problem is not None:
            if self.members.refuse(self.round_idx, silo, problem, started):
                if started:
                    self._after(self.rounds.close_if_complete())
                else:
                    self._start_if_all_online()
            return
        assert announced is not None  # (no announcement is a problem)
        greeting = self.members.greet(self.round_idx, silo, announced, session, started)
        if greeting is Greeting.ONLINE:
            self._start_if_all_online()
            return
        if greeting is Greeting.RESTARTED:
            self.rounds.restarted(silo)
        self.mail.acknowledge(silo)
        self._after(self.rounds.close_if_complete())

    def _start_if_all_online(self) -> None:
        if self.clock.phase is Phase.ONLINE and self.roster.all_online():
            self._start_training()

    # -- the start and the end --------------------------------------------------------------------------
    def _start_training(self) -> None:
        self.is_initialized = True
        logger.info("silos %s %s", self.roster.live, TRAINING_STARTED)
        self._after(self.rounds.open_round(MyMessage.MSG_TYPE_S2C_INIT_CONFIG))

    def _after(self, rounds_over: bool) -> None:
        """Once the last round closed: in data-owner mode the run is over (its last evaluation is
        recorded); in shared mode the silos evaluate the final model and say goodbye."""
        if not rounds_over:
            return
        if self.setup.own_data:
            self._tell_silos_to_stop(None, self.clock.round_seconds())
            self._complete()
            return
        self.final = self.rounds.sampled(self.round_idx)
        self.clock.enter(Phase.FINISHING, self.clock.round_seconds())
        final_models = self.rounds.models_for(self.final, MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
        for silo, err in sorted(self.mail.send(final_models, self.clock.deadline).items()):
            logger.warning("%s", err)
            self.roster.drop([silo])
        if all(s in self.finished for s in self.roster.live):
            self._complete()

    def _complete(self) -> None:
        self.figures.log("final")
        self.driver.record_refusals(self.mail.refusal_totals())
        if self.clock.phase is not Phase.DONE:  # shared mode: the live silos said goodbye; not these
            self.clock.enter(Phase.DONE)
            self.mail.finish(self.roster.given_up(), None, NOTICE_SECONDS)
        self.finish()
