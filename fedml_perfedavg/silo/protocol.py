"""A silo's side of the cross-silo protocol as one object with no I/O: :meth:`SiloProtocol.handle`
takes an event (:mod:`.events`: a server message, a tick of time, the result of the silo's own work)
and returns the actions it calls for. It reads no clock, opens no socket and trains nothing, so a
test drives it with a list of events (tests/silo/test_protocol.py); the FedML-facing silo
(fedml_bridge/cross_silo/client.py) is the thin adapter that turns FedML's messages into events and
carries out the actions.

FedML's client counts rounds itself (a silo that is not sampled every round would train with the
wrong round's batches), never tells the ``ClientTrainer`` which user it trains, waits for the server
forever, and its evaluations never reach the server. Here::

    ANNOUNCING --(a message from the server)--> LISTENING --(nothing for the idle limit, or an
        ^                                          |        upload the server did not take)
        |                                          v
        +------------------------------------- REJOINING --(no answer within connect_timeout)--> gone

- ANNOUNCING: the silo's ONLINE status carries its announcement: the values that must agree with the
  server's and, in data-owner mode, its data's counts and shape.
- LISTENING: each model is trained at the round the server stamped on it, on the user the server
  names; in data-owner mode only the silo's own user, and only as its own rules allow
  (:class:`~.rules.DataOwnerRules`: the keyed schedule, each round once and in order, its DP
  budget; a round it trained comes again only from a resumed server, which gets the stored answer).
  An evaluation request (data-owner mode) is answered as the rules allow; shared mode's silo
  evaluates each model it receives and sends the counts with its update.
- REJOINING: after the policy's idle limit without a word from the server (adaptive: it follows the
  gaps between models), when an upload cannot be delivered, or when the server says it gave up on
  the silo (it answered late), the silo announces itself again; a server still running takes it back
  (it answers at once). With no answer within ``connect_timeout`` the silo stops: the server may be gone.

Secure aggregation: a round with terms runs through its stages (keys, shares, survivors, unmask) with
the round's party (``start_secure``); any stage the party or the rules refuse (a ciphertext that does
not decrypt, a second survivor list) ends this silo's part of the round with a decline, and the
survivor list it unmasks for is recorded only as its shares are about to leave.

A FINISH from the server ends the silo: the run is over (or ended early, saying why), or this silo
was refused (its announcement), which is this silo's failure.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..secagg.primitives import SecAggError
from .events import (
    DISAGREEMENT,
    NOT_THIS_RUN,
    RUN_FINISHED,
    RUN_OVER,
    SERVER_MESSAGES,
    SURVIVORS,
    TAKEN,
    TWIN,
    UNMASK,
    Action,
    Announce,
    Answered,
    Evaluate,
    Evaluated,
    EvaluationAsked,
    Fail,
    Finish,
    FinishArrived,
    ModelArrived,
    NotDelivered,
    Ready,
    RetryFor,
    SecureStage,
    SendDecline,
    SendEvaluation,
    SendGoodbye,
    SendSecure,
    SendUpdate,
    StatusCheck,
    StopReceiving,
    Tick,
    Train,
    Trained,
    Unanswered,
    WorkDone,
)
from .outcome import SiloOutcome, StoredAnswer, state_digest
from .rules import STORED, DataOwnerRules

logger = logging.getLogger(__name__)


class SiloState(enum.Enum):
    ANNOUNCING = "announcing"
    LISTENING = "listening"
    REJOINING = "rejoining"
    DONE = "done"


#: ``start_secure(round, terms, received, trained)``: the round's party (``opening()`` -> the advert
#: message (kind, params); ``answer(kind, params)`` -> (kind, params, tensors)), or SecAggError.
SecureStart = Callable[[int, Optional[Dict[str, Any]], Any, Any], Any]
#: ``start_secure_evaluation(round, terms, model, counts)``: the party that sums the silo's evaluation
#: figures of ``model`` (the same interface), or SecAggError.
SecureEvaluationStart = Callable[[int, Dict[str, Any], Any, Dict[str, Any]], Any]


class SiloProtocol:
    """Silo ``rank`` of a run of ``num_rounds`` rounds, as the module doc says. ``policy``: its
    deadlines (``connect_timeout``, ``round_timeout``, ``client_idle_deadline``); ``setup``: what the
    run agreed (its keyed schedule ``scheduled``, evaluation rounds ``evaluates``, DP ledger
    ``privacy``, ``figures_after``, ``secure`` and ``secure_threshold``, the run layer's ``outcome``); ``own_user``:
    the data owner's user (None in shared mode); ``figures_with_updates``: shared mode's counts."""

    FROZEN_SECONDS = 5.0  # a gap this long between ticks: the silo was not running (frozen, suspended)
    TWIN_RETRY_SECONDS = 5.0  # refused while its earlier process holds the seat: announce again this often

    def __init__(
        self,
        rank: int,
        num_rounds: int,
        policy: Any,
        setup: Any,
        *,
        own_user: Optional[int],
        figures_with_updates: bool,
        start_secure: SecureStart,
        now: float,
        start_secure_evaluation: Optional[SecureEvaluationStart] = None,
    ) -> None:
        self.rank, self.num_rounds, self.policy, self.setup = rank, int(num_rounds), policy, setup
        self.own_user, self.figures_with_updates, self.start_secure = own_user, figures_with_updates, start_secure
        self.start_secure_evaluation = start_secure_evaluation
        self.state = SiloState.ANNOUNCING
        self.state_since = self.last_heard = self.last_awake = now
        self.last_model: Optional[float] = None  # when the last model came
        self.slowest_gap: Optional[float] = None  # between two models from the server
        self.gaps_measured = 0
        self.secure: Any = None  # the round's secure-aggregation party, while it runs
        self.outcome: SiloOutcome = setup.outcome or SiloOutcome(own_user)
        self.rules: Optional[DataOwnerRules] = (
            None
            if own_user is None
            else DataOwnerRules(
                rank,
                own_user,
                self.outcome,
                self.num_rounds,
                setup.scheduled,
                setup.evaluates,
                setup.privacy,
                getattr(setup, "keyed_order", None),
                getattr(setup, "reserve_silos", 0),
            )
        )
        self.announce_again_at: Optional[float] = None  # refused as a twin: when to announce again
        self._announcing: Optional[Tuple[str, str]] = None  # (why, words) of the announcement under way
        self._asked: Optional[Tuple[str, int, int, Any, Any]] = None  # the work under way, for its result
        self._actions: List[Action] = []

    # -- the edge ---------------------------------------------------------------------------------------
    def handle(self, event: Any) -> List[Action]:
        """The actions ``event`` calls for, in the order they are to be carried out. A :class:`Fail`
        is the last of them."""
        self._actions = []
        now = getattr(event, "now", None)
        if now is None:
            raise TypeError(f"not an event of a silo's protocol: {event!r}")
        if isinstance(event, Tick):
            self._on_tick(now)
        elif isinstance(event, SERVER_MESSAGES):
            self._from_server(event)
        elif isinstance(event, Ready):
            self._announce(now, "start", "")
        elif isinstance(event, Answered):
            self._on_answer(event)
        elif isinstance(event, Unanswered):
            self._on_unanswered(event)
        elif isinstance(event, Trained):
            self._on_trained(event)
        elif isinstance(event, Evaluated):
            self._on_evaluated(event)
        elif isinstance(event, NotDelivered):
            self._rejoin(now, f"the server did not take {event.what} ({event.why})")
        elif not isinstance(event, WorkDone):
            raise TypeError(f"not an event of a silo's protocol: {event!r}")
        self.last_awake = now
        return self._actions

    def _do(self, action: Action) -> None:
        self._actions.append(action)

    def _become(self, state: SiloState, now: float) -> None:
        self.state, self.state_since = state, now

    # -- the server's messages --------------------------------------------------------------------------
    def _from_server(self, event: Any) -> None:
        now = event.now
        if self.announce_again_at is not None and not isinstance(event, FinishArrived):
            # Refused as a twin and not yet taken back: the server still seats this silo's earlier
            # process, so what it sends is that process's (a model sent before the kill reaches this
            # address on a retry). Answering it would spend the user's data (and its DP budget) on an
            # update the server refuses, and would stop the announcements.
            logger.info(
                "silo rank %d: %s from the server is for this silo's earlier process (the server has not taken "
                "this one back yet): not answered",
                self.rank,
                type(event).__name__,
            )
            return
        self.last_heard = now
        if self.state is not SiloState.LISTENING:
            if self.state is SiloState.REJOINING:
                logger.info("silo rank %d: the server answered; the silo is back in the run", self.rank)
            self._become(SiloState.LISTENING, now)
        if isinstance(event, (ModelArrived, EvaluationAsked)):
            if self.last_model is not None:
                self.slowest_gap = max(now - self.last_model, self.slowest_gap or 0.0)
                self.gaps_measured += 1
            self.last_model = now
            # An upload to a server that was up and is gone is retried no longer than it is waited for.
            limit = self.policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
            self._do(RetryFor(min(self.policy.connect_timeout, limit)))
        if isinstance(event, ModelArrived):
            self._on_model(event)
        elif isinstance(event, EvaluationAsked):
            self._on_evaluation(event)
        elif isinstance(event, SecureStage):
            self._on_secure(event)
        elif isinstance(event, StatusCheck):
            if event.left_out and self.state is SiloState.LISTENING:
                self._rejoin(now, "the server gave up on this silo (an answer of it came late, or not at all)")
        else:
            self._on_finish(event)

    def _on_model(self, event: ModelArrived) -> None:
        round_idx, user = event.round_idx, event.user
        if self.own_user is not None and user != self.own_user:
            self._do(
                Fail(
                    f"silo rank {self.rank}: the server asked it to train user {user}; it holds user "
                    f"{self.own_user}'s data only (comm_args.silo_data own)"
                )
            )
            return
        if round_idx >= self.num_rounds:
            if self.rules is not None:  # data-owner mode has no final model
                self._refuse(round_idx, self.rules.final_model(round_idx).reason, event.session)
                return
            self._ask(Evaluate(round_idx, user, event.model, final=True), "final", None)
            return
        listed = event.terms.get("silos") if isinstance(event.terms, dict) else None
        decision = self.rules.training(round_idx, event.model, listed) if self.rules is not None else None
        if decision is not None and decision.refused:
            self._refuse(round_idx, decision.reason, event.session)
            return
        if decision is not None and decision.action == STORED:
            logger.warning(
                "silo rank %d: round %d again, on the model it trained it on (a resumed server): the stored answer "
                "goes, not a retraining",
                self.rank,
                round_idx,
            )
            stored = decision.stored
            self._answer(round_idx, event.model, event.terms, stored.weights, stored.samples, None)
            return
        after = self.setup.figures_after  # DP-SGD: figures only of a model the server evaluates
        figures = self.figures_with_updates and (after is None or (round_idx >= 1 and after(round_idx - 1)))
        self._ask(Train(round_idx, user, event.model, figures), "train", event.terms)

    def _on_evaluation(self, event: EvaluationAsked) -> None:
        round_idx = event.round_idx
        if self.rules is None:  # an evaluation request exists in data-owner mode only
            self._do(Fail(f"silo rank {self.rank}: an evaluation request in shared mode (comm_args.silo_data)"))
            return
        secure = self.setup.secure
        if secure != (event.terms is not None):
            why = (
                "this run sums evaluations securely (secagg_args.enable_secagg); the server's evaluation request "
                "came without terms: its figures would leave this silo alone"
                if secure
                else "the server's evaluation request came with secure-aggregation terms; this silo's "
                "secagg_args.enable_secagg is false: the two disagree"
            )
            self._refuse(round_idx, why, event.session)
            return
        decision = self.rules.evaluation(round_idx, event.model)
        if decision.refused:
            self._refuse(round_idx, decision.reason, event.session)
        elif decision.action == STORED:  # the same round's model again (a resumed server): the same counts
            logger.warning(
                "silo rank %d: the evaluation after round %d again, on the model it evaluated: the stored counts go, "
                "no new personalization",
                self.rank,
                round_idx,
            )
            self._send_evaluation(round_idx, decision.stored, event.model, event.terms)
        else:
            self._ask(Evaluate(round_idx, self.rules.user, event.model), "evaluate", event.terms)

    def _on_finish(self, event: FinishArrived) -> None:
        self._become(SiloState.DONE, event.now)
        self._do(Finish())
        if event.refused:  # this silo cannot take part: its run fails, saying why
            self._do(Fail(f"silo rank {self.rank}: {event.reason}"))
        elif event.reason:
            self.outcome.ended_early = str(event.reason)
            logger.warning("silo rank %d: the server ended the run early: %s", self.rank, event.reason)
        else:
            logger.info("silo rank %d: the server ended the run", self.rank)

    # -- the silo's own work ------------------------------------------------------------------------------
    def _ask(self, work: Any, what: str, terms: Any) -> None:
        self._asked = (what, work.round_idx, work.user, work.model, terms)
        self._do(work)

    def _done(self, what: str, round_idx: int) -> Tuple[int, Any, Any]:
        asked = self._asked
        if asked is None or asked[0] != what or asked[1] != round_idx:
            raise RuntimeError(f"a result ({what}, round {round_idx}) the silo did not ask for (it asked {asked})")
        self._asked = None
        return asked[2], asked[3], asked[4]

    def _on_trained(self, event: Trained) -> None:
        round_idx = event.round_idx
        user, received, terms = self._done("train", round_idx)
        if self.setup.privacy is not None:  # the round's local update used its user's data
            self.setup.privacy.trained(round_idx, [user])
        answer = None
        if self.own_user is not None:
            answer = StoredAnswer(round_idx, state_digest(received), dict(event.weights), int(event.samples))
        self.outcome.trained(round_idx, answer)  # kept after its account: a restarted silo counts this use
        self._answer(round_idx, received, terms, event.weights, event.samples, event.counts)

    def _on_evaluated(self, event: Evaluated) -> None:
        if self._asked is not None and self._asked[0] == "final":
            self._done("final", event.round_idx)
            self._become(SiloState.DONE, event.now)
            self._do(SendGoodbye(event.counts))
            self._do(Finish())
            return
        _, model, terms = self._done("evaluate", event.round_idx)
        self.outcome.evaluated(event.counts, model)  # in the record (and the ledger) before the counts leave
        self._send_evaluation(event.round_idx, event.counts, model, terms)

    def _send_evaluation(self, round_idx: int, counts: Dict[str, Any], model: Any, terms: Any) -> None:
        """The evaluation's figures: in the clear, or (secure aggregation) as the first message of the
        secure sum they leave this silo in; the per-user counts stay in its own record."""
        if terms is None:
            self._do(SendEvaluation(round_idx, counts))
            return
        try:
            if self.start_secure_evaluation is None:
                raise SecAggError("this silo sums no evaluation securely (no secure evaluation was set up)")
            self.secure = self.start_secure_evaluation(round_idx, terms, model, counts)
        except SecAggError as err:
            logger.error(
                "silo rank %d: the evaluation after round %d: %s; its figures stay here", self.rank, round_idx, err
            )
            self._decline(round_idx, str(err))
            return
        kind, params = self.secure.opening()
        self._do(SendSecure(kind, round_idx, params))

    def _answer(self, round_idx: int, received: Any, terms: Any, weights: Any, samples: int, counts: Any) -> None:
        """The round's answer: in the clear, or the first message of its secure aggregation."""
        if terms is None and not self.setup.secure:
            self._do(SendUpdate(round_idx, weights, int(samples), counts))
            return
        try:
            self.secure = self.start_secure(round_idx, terms, received, weights)
        except SecAggError as err:
            logger.error("silo rank %d: round %d: %s; it sends no update this round", self.rank, round_idx, err)
            self._decline(round_idx, str(err))
            return
        kind, params = self.secure.opening()
        self._do(SendSecure(kind, round_idx, params))

    # -- secure aggregation ---------------------------------------------------------------------------------
    def _on_secure(self, event: SecureStage) -> None:
        round_idx, secure = event.round_idx, self.secure
        if secure is None or secure.round_idx != round_idx:
            logger.warning(
                "silo rank %d: a secure-aggregation message for round %d, which it is not in", self.rank, round_idx
            )
            return
        survivors = None
        evaluation = bool(getattr(secure, "evaluation", False))
        try:
            if event.stage in (SURVIVORS, UNMASK) and self.rules is not None:
                survivors = [int(r) for r in event.params["survivors"]]
                decision = self.rules.unmasking(round_idx, survivors, evaluation)
                if decision.refused:
                    raise SecAggError(str(decision.reason))
            kind, params, tensors = secure.answer(event.kind, dict(event.params))
        except SecAggError as err:
            logger.error(
                "silo rank %d: round %d: %s; it leaves this round's secure aggregation", self.rank, round_idx, err
            )
            self.secure = None
            self._decline(round_idx, str(err))
            return
        if event.stage == UNMASK and survivors is not None:
            # kept only now, as the shares leave: a round declined before this (too few survivors,
            # a list it would not sign) revealed nothing, and a resumed server may run it again (issue 76)
            self.outcome.unmasked_for(round_idx, survivors, evaluation)
        self._do(SendSecure(kind, round_idx, params, tensors))

    # -- refusals --------------------------------------------------------------------------------------------
    def _refuse(self, round_idx: int, reason: Optional[str], session: Optional[str]) -> None:
        """This silo's own rules refuse what the server asked of round ``round_idx``: logged, and the
        server told why (a decline), so it goes on without this silo now, not at its deadline."""
        logger.error(
            "silo rank %d: refuses round %d from the server (session %s): %s", self.rank, round_idx, session, reason
        )
        self._decline(round_idx, str(reason))

    def _decline(self, round_idx: int, reason: str) -> None:
        self._do(SendDecline(round_idx, f"silo rank {self.rank}: {reason}"[:2000]))

    # -- announcing, losing and finding the server ----------------------------------------------------------
    def _announce(self, now: float, why: str, words: str) -> None:
        self._announcing = (why, words)
        self._do(Announce(now + self.policy.connect_timeout))

    def _on_answer(self, event: Answered) -> None:
        now, answer, words = event.now, event.answer, event.words
        self._announcing, self.announce_again_at = None, None
        if answer in (RUN_FINISHED, RUN_OVER):  # it started (or came back) after the server ended the run
            self._become(SiloState.DONE, now)
            self._do(Finish())
            if answer == RUN_FINISHED:  # every round ran: the run finished, and so does this process
                logger.info("silo rank %d: the run had finished when this silo announced itself", self.rank)
                return
            self.outcome.ended_early = words
            logger.warning("silo rank %d: the server ended the run before this silo took part: %s", self.rank, words)
        elif answer == DISAGREEMENT:  # told at once, even where the server cannot reach this silo
            self._do(Fail(f"silo rank {self.rank}: refused by the server: {words}"))
        elif answer == NOT_THIS_RUN:
            self._do(
                Fail(
                    f"silo rank {self.rank}: the server refused its announcement: {event.refusal}; this silo cannot "
                    f"take part as it was started (its --run_id, its certificate, or its rank in the address file)"
                )
            )
        elif answer == TWIN:
            wait = min(self.TWIN_RETRY_SECONDS, self.policy.round_timeout)
            self.announce_again_at = now + wait
            self.state_since = self.last_heard = now  # the server answered: it is there
            logger.warning(
                "silo rank %d: the server still seats this silo's earlier process; announcing itself again "
                "every %g s until the server gives that process up at its deadline",
                self.rank,
                wait,
            )
        elif answer != TAKEN:
            raise ValueError(f"not an answer to an announcement: {answer!r}")

    def _on_unanswered(self, event: Unanswered) -> None:
        why, words = self._announcing or ("start", "")
        self._announcing = None
        if why == "start":
            self._do(Fail(str(event.error), event.error))
        elif why == "rejoin":
            self._gone(event.now, f"{words}, and it did not take the silo's announcement either ({event.error})")
        else:
            self._gone(event.now, f"it did not take the silo's announcement ({event.error})")

    def _rejoin(self, now: float, why: str) -> None:
        """Announce the silo again (the server takes back a silo it gave up on); stop if the server
        does not take the announcement within ``connect_timeout``."""
        logger.warning(
            "silo rank %d: %s; announcing itself again (for up to comm_args.connect_timeout=%g s)",
            self.rank,
            why,
            self.policy.connect_timeout,
        )
        self._become(SiloState.REJOINING, now)
        self._announce(now, "rejoin", why)

    def _gone(self, now: float, why: str) -> None:
        self._become(SiloState.DONE, now)
        self._do(StopReceiving())
        self._do(Fail(f"silo rank {self.rank}: {why}; is the server gone?"))

    def _on_tick(self, now: float) -> None:
        asleep = now - self.last_awake
        state, policy = self.state, self.policy
        if self.announce_again_at is not None and now >= self.announce_again_at and state is not SiloState.LISTENING:
            self._announce(now, "twin", "")
        elif state is SiloState.LISTENING and asleep > self.FROZEN_SECONDS:
            self._rejoin(now, f"this silo was not running for {asleep:.1f} s (frozen or suspended)")
        elif state in (SiloState.ANNOUNCING, SiloState.LISTENING):
            limit = policy.client_idle_deadline(self.slowest_gap, self.gaps_measured)
            if now - self.last_heard > limit:
                gap = "none measured" if self.slowest_gap is None else f"{self.slowest_gap:.2f} s"
                self._rejoin(
                    now,
                    f"nothing from the server for {now - self.last_heard:.1f} s (its limit {limit:.1f} s: comm_args."
                    f"round_timeout_factor x the slowest gap between its models so far ({gap}, "
                    f"{self.gaps_measured} measured), + {policy.MIN_ADAPTIVE_SECONDS:g} s; before "
                    f"{policy.ADAPT_AFTER_ROUNDS}: 2 x comm_args.round_timeout + comm_args.connect_timeout)",
                )
        elif state is SiloState.REJOINING and now - self.state_since > policy.connect_timeout:
            self._gone(
                now,
                f"the server took the silo's announcement but sent nothing for "
                f"{now - self.state_since:.1f} s (comm_args.connect_timeout={policy.connect_timeout:g})",
            )


__all__ = ["SiloProtocol", "SiloState"]
