"""The cross-silo server's protocol as one object with no I/O: :meth:`SiloServerProtocol.handle`
takes an event (:mod:`.events`: a silo's message, a tick of time, sends that failed, a stop) and
returns the actions it calls for (sends, records, the end). It reads no clock, opens no socket and
starts no thread, so a test drives it with a list of events; :mod:`.server` is the thin class
FedML sees, which turns FedML's messages into events and carries the actions out.

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
  round's users are the algorithm's keyed sample, as in sp; which silo trains which user is the
  data mode's (:mod:`.modes`), and a sampled silo that is offline is missing at once.
- EVALUATING (data-owner mode, on the run's evaluation rounds): every online silo, sampled or
  not, evaluates the new model on its own data and sends its counts; a silo that sends none is
  listed as missing, never counted as zero.
- FINISHING (shared mode): the final model was sent, waiting for the silos' goodbyes.

What a silo sends is checked against what the server knows, never taken from the message: an
upload's sample count must be its user's (the server's data in shared mode, the silo's
announcement in data-owner mode); reported counts must be of the silo's own user in that round,
of its test split's size. A refusal is counted and logged (summary.json's ``refusals``), and a
refused upload is a rejected update.

At a deadline the silos that did not answer are given up on; the run goes on if at least
``min_clients`` of the round's silos answered (:meth:`SiloPolicy.after_deadline`), else it stops
naming them. A silo given up on that announces itself again (it lost the server for a while, was
frozen, or restarted) takes part again; one that sends work as if nothing happened is told, once,
that it was given up on, so it announces itself at once. However the run ends (finished, too few
silos, an error, a signal) every silo that may still wait is told, except those refused, which
were told why and have ended.

The pieces: the rounds (TRAINING, EVALUATING) are :mod:`.rounds`'s, what they wait for
:mod:`.awaited`'s, who takes part :mod:`.membership`'s, what is known of each silo
:mod:`.roster`'s; this class has the run's start and end and routes each event.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Set, Tuple

from ...core.errors import ConfigError
from . import TRAINING_STARTED
from ...net import wire
from .agreement import ServerSetup
from .events import (
    EVALUATION,
    FINAL,
    ROUND,
    Action,
    EndRun,
    Evaluation,
    Event,
    Fail,
    Finish,
    Goodbye,
    Hello,
    Listening,
    Outbox,
    SecAggMessage,
    SiloDeclined,
    SiloFailed,
    Stopped,
    Tick,
    Undelivered,
    Update,
)
from .membership import Greeting, SiloMembership, TooFewSilos
from .awaited import OpenRound, SiloOwnEvaluations
from .phases import Phase, PhaseClock
from .policy import FINISH_SECONDS, NOTICE_SECONDS, SiloPolicy
from .roster import SiloRoster
from .rounds import GlobalModel, RoundPlan, SiloRounds, silo_declined, silo_failed

logger = logging.getLogger(__name__)


class SiloServerProtocol:
    """The phases of the module doc for ``setup``'s silos and data mode, ``round_num`` rounds;
    ``policy`` decides deadlines and when to stop; ``plan`` samples each round's users and says
    which rounds are evaluated; ``model`` owns the global model and its average."""

    def __init__(
        self,
        setup: ServerSetup,
        policy: SiloPolicy,
        plan: RoundPlan,
        model: GlobalModel,
        round_num: int,
        client_num_per_round: int,
        start_round: int = 0,
    ) -> None:
        self.roster = SiloRoster(setup)
        problem = self.roster.mode.start_problem(setup.silos, client_num_per_round)
        if problem is not None:
            raise ConfigError(problem)
        self.setup, self.policy, self.outbox = setup, policy, Outbox()
        self.clock = PhaseClock(policy)
        self.figures = SiloOwnEvaluations(self.roster, self.outbox)
        self.members = SiloMembership(self.roster, policy, self.outbox)
        self.rounds = SiloRounds(round_num, model, plan, self.clock, self.members, self.outbox, self.figures)
        self.rounds.round_idx = start_round  # a resumed server: the round after its checkpoint
        self.final = OpenRound(-1, [], {})  # shared mode: the silos sent the final model
        self.finished: Set[int] = set()  # shared mode: the silos that said goodbye
        self._now = 0.0  # the time of the event being handled
        # what the transport refused from the addresses of silos that never came online, in words
        # (the server manager plugs in the transport's; the protocol itself knows no addresses)
        self.sightings: Callable[[List[int]], str] = lambda silos: ""

    @property
    def phase(self) -> Phase:
        return self.clock.phase

    @property
    def round_idx(self) -> int:
        return self.rounds.round_idx

    def handle(self, event: Event) -> List[Action]:
        """The actions ``event`` calls for, in the order they are to be carried out. A run that
        cannot go on (too few silos, an error while aggregating) ends here: every silo that may
        wait is told, and the last action is :class:`~.events.Fail`."""
        self._now = event.now
        try:
            self._dispatch(event)
        except Exception as err:  # the run stops: whatever the cause, the silos are told why
            if self.phase is not Phase.DONE:
                self._end(f"the server stopped the run: {err}", FINISH_SECONDS)
            self.outbox.add(Fail(err))
        return self.outbox.take()

    def _dispatch(self, event: Event) -> None:
        now = event.now
        if isinstance(event, Tick):
            self._on_tick(now)
        elif isinstance(event, Update):
            u = event
            self._after(now, self.rounds.on_update(now, u.silo, u.stamped, u.declared, u.model, u.counts, u.training))
        elif isinstance(event, SecAggMessage):
            e = event
            self._after(now, self.rounds.on_secagg(now, e.silo, e.kind, e.stamped, e.params, e.model, e.size))
        elif isinstance(event, Evaluation):
            self._after(now, self.rounds.on_evaluation(now, event.silo, event.counts))
        elif isinstance(event, Hello):
            self._on_hello(now, event.silo, event.announced, event.session)
        elif isinstance(event, Goodbye):
            self._on_goodbye(now, event)
        elif isinstance(event, SiloFailed) and self.phase is Phase.FINISHING:  # as a final model not delivered
            self._on_undelivered(now, Undelivered(now, FINAL, {event.silo: f"silo rank {event.silo} failed"}))
        elif isinstance(event, SiloFailed) and self.phase is not Phase.DONE:  # the run goes on without it now
            self._after(now, silo_failed(self.rounds, now, event.silo, event.reason, stopped=event.stopped))
        elif isinstance(event, SiloDeclined):  # the round (or evaluation) goes on without it now; else noted
            if self.phase in (Phase.TRAINING, Phase.EVALUATING):
                self._after(now, silo_declined(self.rounds, now, event.silo, event.reason))
            else:
                phase, reason = self.phase.value, event.reason
                logger.warning("ignored a refusal from silo rank %d (the server is %s): %s", event.silo, phase, reason)
        elif isinstance(event, Undelivered):
            self._on_undelivered(now, event)
        elif isinstance(event, Listening):
            # Silos announce themselves (retrying until the server listens), so the server only
            # starts its clock.
            self.clock.enter(Phase.ONLINE, now, self.policy.connect_timeout)
            logger.info("server listening; waiting for silos %s", self.roster.live)
        elif isinstance(event, Stopped):
            if self.phase is not Phase.DONE:
                self._end(event.reason, FINISH_SECONDS)
        else:
            raise TypeError(f"not an event of the cross-silo protocol: {event!r}")

    # -- time ---------------------------------------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        if not self.clock.passed(now):
            return
        phase = self.phase
        if phase is Phase.ONLINE:
            self.clock.disarm()
            missing = [s for s in self.roster.live if s not in self.roster.online]
            go_on, _ = self.policy.after_deadline(self.roster.live, sorted(self.roster.online))
            why = f"did not come online within comm_args.connect_timeout={self.policy.connect_timeout:g} s"
            seen = self.sightings(missing)
            why += f"; connections from their addresses refused: {seen}" if seen else ""
            self.rounds.give_up_on(missing, why, go_on)
            self._start_training(now)
        elif phase is Phase.TRAINING:
            self._after(now, self.rounds.close_round(now, f"sent no update within {self.clock.deadline_words(now)}"))
        elif phase is Phase.EVALUATING:
            why = f"sent no evaluation within {self.clock.deadline_words(now)}"
            self._after(now, self.rounds.close_evaluation(now, why))
        elif phase is Phase.FINISHING:
            self.clock.disarm()
            logger.warning(
                "no goodbye from silo rank(s) %s within the round deadline; the run is complete",
                sorted(set(self.roster.live) - self.finished),
            )
            self._complete()

    @property
    def stage(self) -> Tuple[int, str]:  # what a send made now is stamped with (events.Undelivered)
        return self.round_idx, self.phase.value

    def _on_undelivered(self, now: float, event: Undelivered) -> None:
        if event.sent_in not in (None, self.stage):  # stale: the deadline dealt with those silos then
            why = f"{event.purpose} sends of {event.sent_in} not delivered to silo rank(s) {sorted(event.silos)}"
            logger.info("%s; the protocol is at %s now", why, self.stage)
            return
        if event.purpose in (ROUND, EVALUATION):
            self._after(now, self.rounds.unreachable(now, event.purpose, event.silos))
        elif event.purpose == FINAL and self.phase is Phase.FINISHING:
            logger.warning("%s", "; ".join(why for _, why in sorted(event.silos.items())))
            self.roster.drop(sorted(event.silos))
            self._complete_if_all_said_goodbye()

    # -- a silo comes online ------------------------------------------------------------------------
    def _on_hello(self, now: float, silo: int, announced: Optional[dict], session: Optional[str]) -> None:
        if self.phase in (Phase.FINISHING, Phase.DONE) or silo not in self.setup.silos:
            return
        started = self.phase not in (Phase.STARTING, Phase.ONLINE)
        problem = self.roster.problem_with(silo, announced)
        if problem is not None:
            if self.members.refuse(now, self.round_idx, silo, problem, started):
                if started:
                    self._after(now, self.rounds.close_if_complete(now))
                else:
                    self._start_if_all_online(now)
            return
        assert announced is not None  # (no announcement is a problem)
        greeting = self.members.greet(self.round_idx, silo, announced, session, started)
        if greeting is Greeting.ONLINE:
            self._start_if_all_online(now)
            return
        if greeting is Greeting.RESTARTED:
            self.rounds.restarted(silo)
        self.members.acknowledge(now, self.round_idx, silo, greeting)
        self._after(now, self.rounds.close_if_complete(now))

    def _start_if_all_online(self, now: float) -> None:
        if self.phase is Phase.ONLINE and self.roster.all_online():
            self._start_training(now)

    def _on_goodbye(self, now: float, event: Goodbye) -> None:
        if self.phase is not Phase.FINISHING or event.silo not in self.roster.live:
            return
        self.finished.add(event.silo)
        self.figures.note(event.silo, event.counts, self.final.user_of(event.silo), self.round_idx)
        self._complete_if_all_said_goodbye()

    # -- the start and the end --------------------------------------------------------------------------
    def _start_training(self, now: float) -> None:
        self._refuse_a_plan_that_cannot_run()
        privacy = self.setup.privacy
        secure = [f"secure aggregation (threshold {self.setup.secure_threshold})"] if self.setup.secure else []
        how = "; ".join(secure + ([privacy] if privacy else []))
        logger.info(
            "silos %s %s %d starts%s",
            self.roster.live,
            TRAINING_STARTED,
            self.rounds.round_idx,
            f" ({how})" if how else "",
        )
        self._after(now, self.rounds.open_round(now, wire.INIT_CONFIG))

    def _refuse_a_plan_that_cannot_run(self) -> None:
        """Silos refused at start (a DP budget their user's plan would pass, data that does not
        fit) take no part in any round, yet the keyed schedule samples them as it does on every
        backend: a round whose other silos are too few would stop the run there (secure rounds
        one after another, "no acceptable client update"). :class:`TooFewSilos` now, naming the
        first such round, rather than after the rounds before it."""
        out = set(self.roster.refused)
        if not out:
            return
        needed, why = self.policy.min_clients, f"comm_args.min_clients_per_round={self.policy.min_clients}"
        threshold = self.setup.secure_threshold
        if self.setup.secure and threshold is not None and threshold > needed:
            needed, why = threshold, f"secure aggregation's threshold of {threshold} silos to unmask a round"
        short = self.rounds.first_round_short_of(out, needed)
        if short is not None:
            round_idx, expected, able = short
            raise TooFewSilos(
                f"silo rank(s) {sorted(out)} were refused at start (the reasons above) and take no part; the keyed "
                f"schedule samples silo rank(s) {expected} for round {round_idx}, of which {len(able)} can take part "
                f"({able}), fewer than {why}. The run would stop there: start it with the users of the "
                f"organizations that can take part, or set right what refused the others"
            )

    def _after(self, now: float, rounds_over: bool) -> None:
        """Once the last round closed: in data-owner mode the run is over (its last evaluation is
        recorded); in shared mode the silos evaluate the final model and say goodbye."""
        if not rounds_over:
            return
        if not self.roster.mode.ends_with_final_model:
            self._end(None, self.clock.round_seconds())
            self._complete()
            return
        self.final = self.rounds.sampled(self.round_idx)
        self.clock.enter(Phase.FINISHING, now, self.clock.round_seconds())
        self.outbox.send(self.rounds.models_for(self.final, wire.SYNC_MODEL), self.clock.deadline or now, FINAL)
        self._complete_if_all_said_goodbye()

    def _complete_if_all_said_goodbye(self) -> None:
        if self.phase is Phase.FINISHING and all(s in self.finished for s in self.roster.live):
            self._complete()

    def _end(self, reason: Optional[str], seconds: float) -> None:
        """The run is over (``reason``: it failed or was stopped): every silo that may still wait
        is told, the live ones within ``seconds``, and the server stops listening."""
        if self.phase is not Phase.DONE:
            self.clock.enter(Phase.DONE, self._now)
        self.outbox.record("record_refusals")
        self.outbox.add(self._end_run(reason, self.roster.live, seconds, min(seconds, FINISH_SECONDS), True))

    def _complete(self) -> None:
        self.figures.log("final")
        self.outbox.record("record_refusals")
        if self.phase is not Phase.DONE:  # shared mode: the live silos said goodbye; not these
            self.clock.enter(Phase.DONE, self._now)
            self.outbox.add(self._end_run(None, [], NOTICE_SECONDS, NOTICE_SECONDS, False))
        self.outbox.add(Finish())

    def _end_run(self, reason: Optional[str], live: List[int], seconds: float, later: float, stop: bool) -> EndRun:
        roster = self.roster
        return EndRun(reason, tuple(live), tuple(roster.given_up()), tuple(sorted(roster.hellos)), seconds, later, stop)
