"""The cross-silo protocol's rounds: its TRAINING and EVALUATING phases (:mod:`.protocol` has the
run's start and end, and routes events here). Each round's model goes to the round's silos; how
their answers become the new global model is the round's :class:`RoundAggregation`, chosen once
when the round opens: :class:`ClearAggregation` (updates checked by :mod:`.awaited` and averaged by
the global model's owner, :class:`GlobalModel`: FedML's aggregator with the plugin's hooks) or
:class:`~.secure_rounds.SecureAggregation` (secure aggregation's stages, the sum through the
algorithm). Where the data mode says so (data-owner mode, on the run's evaluation rounds) every
live silo evaluates the new model on its own data. A silo that misses a deadline, or cannot be
reached, is given up on (:mod:`.membership`).

Every method that may close the last round returns True then, and the protocol ends the run.
Nothing here reads a clock or sends: each method is told the time, and its sends and records go
to the event's :class:`~.events.Outbox`."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from ...core.sampling import with_reserves
from .events import EVALUATION, ROUND, Outbox, ToSilo
from .membership import SiloMembership, TooFewSilos
from .awaited import OpenEvaluation, OpenRound
from .phases import Phase, PhaseClock
from .roster import SiloRoster
from .secure_evaluation import SecureEvaluation
from .secure_rounds import REFUSED_SECAGG, SecureAggregation, UnclippedInputs
from ...net import wire

logger = logging.getLogger(__name__)


class GlobalModel(Protocol):
    """The global model's owner: what the protocol sends, and the average it asks for."""

    def params(self) -> Any: ...

    def aggregate(self, round_idx: int, updates: Dict[int, tuple], senders: Dict[int, str]) -> Any:
        """The new global model from ``updates`` (position in the round's sample -> (sample count,
        model)), taken in sp's order of sampled users, through the aggregator's hooks; ``senders``
        names who sent each (for the update screen's record)."""

    def secure_average(self, round_idx: int, average_delta: Any) -> Any:
        """The new global model from the securely aggregated average of the silos' deltas."""

    def keep(self, round_idx: int) -> Any:
        """A round that could not finish: the global model stays (a skipped round)."""

    def update_bound(self) -> float:
        """The L2 bound on an update from the current model (what a silo clips to)."""

    def vector_length(self) -> int:
        """Words in the vector of the model's parameters that secure aggregation sums."""


class RoundPlan(Protocol):
    """What the run decides of a round: its users (the algorithm's keyed sample, as in sp) and
    whether the model after it is evaluated."""

    def sample_clients(self, round_idx: int) -> List[int]: ...

    def evaluates(self, round_idx: int) -> bool: ...


class RoundAggregation(Protocol):
    """How the open round's answers become the new global model (one object a round)."""

    def terms(self, silo: int) -> Optional[Dict[str, Any]]:
        """What goes to ``silo`` with the round's model, beside it (None: nothing)."""

    def on_update(
        self, now: float, silo: int, stamped: Any, declared: Any, model: Any, counts: Any, training: Any = None
    ) -> bool:
        """A silo's update in the clear (``training``: its training figures, or None)."""

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        """A silo's message of a secure-aggregation stage."""

    def drop(self, silos: Sequence[int], why: str) -> None:
        """``silos`` left the run: what they owed the round will not come."""

    def ready(self) -> bool:
        """Nothing more is awaited at this point of the round."""

    def advance(self, now: float) -> bool:
        """Go on from a ready round: its next stage, or its close."""

    def deadline(self, now: float, why: str) -> bool:
        """The round's (or its stage's) deadline passed: give up on the silos awaited (``why``)."""

    def go_on(self, leaving: Sequence[int]) -> bool:
        """Whether the run goes on once the open round's ``leaving`` silos are given up on."""


class ClearAggregation:
    """Updates in the clear: each checked as it comes (:mod:`.awaited`), averaged by the global
    model's owner once every silo answered or the deadline passed."""

    def go_on(self, leaving: Sequence[int]) -> bool:
        """Round in the clear: if at least comm_args.min_clients_per_round of its silos are left."""
        r = self.rounds
        left = [s for s in r.round.assigned if s not in set(leaving)]
        return r.members.policy.after_deadline(r.round.expected, left)[0]

    def __init__(self, rounds: "SiloRounds") -> None:
        self.rounds = rounds

    def terms(self, silo: int) -> Optional[Dict[str, Any]]:
        return None

    def on_update(
        self, now: float, silo: int, stamped: Any, declared: Any, model: Any, counts: Any, training: Any = None
    ) -> bool:
        r = self.rounds
        if r.clock.phase is not Phase.TRAINING or not r.round.takes(silo, stamped):
            again = "; it already sent one" if silo in r.round.answered else ""
            return r.ignore(now, "an update", silo, stamped, again)
        if r.round.take(silo, declared, model, r.roster, r.outbox.refuse):
            r.figures.note(silo, counts, r.round.user_of(silo), r.round_idx)
            user = r.round.user_of(silo)
            if training is not None and user is not None:  # an accepted update's figures only
                r.outbox.record("record_training", r.round_idx, user, training)
        else:
            r.outbox.record("record_rejected_update", r.round_idx)
        if r.round.answered_by_all():
            r.clock.measure_round(now)
        return r.close_if_complete(now)

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        what = f"a secure-aggregation message (type {kind}); this round aggregates in the clear,"
        return self.rounds.ignore(now, what, silo, stamped)

    def drop(self, silos: Sequence[int], why: str) -> None:
        pass  # the round's assignment forgets them (SiloRounds.drop_awaited)

    def ready(self) -> bool:
        return self.rounds.round.complete()

    def advance(self, now: float) -> bool:
        return self.close(now, None)

    def deadline(self, now: float, why: str) -> bool:
        return self.close(now, why)

    def close(self, now: float, why_missing: Optional[str]) -> bool:
        """The round's deadline passed (``why_missing`` says what the missing silos failed to do)
        or every silo answered: give up on the missing, aggregate, evaluate, go on."""
        r = self.rounds
        r.clock.disarm()
        go_on, missing = r.members.policy.after_deadline(r.round.expected, sorted(r.round.answered))
        waited = [s for s in missing if s in r.round.assigned]  # sent the round's model, sent nothing back
        if not go_on:
            r.give_up_on(missing, why_missing or "missed the round", False)
        r.give_up_on(waited, why_missing or "missed the round", True)
        round_idx, senders = r.round_idx, {p: s for s, (p, _) in r.round.assigned.items()}
        r.averaged_from = sorted(senders[p] for p in r.round.updates)  # before the screen's judgement
        named = {p: f"silo rank {senders[p]}" for p in r.round.updates}
        return r.round_closed(now, round_idx, r.model.aggregate(round_idx, r.round.updates, named))


class SiloRounds:
    """Rounds ``round_idx`` up to ``round_num`` over the silos ``members`` keeps; models come from
    and go to ``model``; ``plan`` samples each round's users and says which are evaluated."""

    def __init__(
        self,
        round_num: int,
        model: GlobalModel,
        plan: RoundPlan,
        clock: PhaseClock,
        members: SiloMembership,
        outbox: Outbox,
        figures: Any,
    ) -> None:
        self.round_num, self.model, self.plan, self.clock = round_num, model, plan, clock
        self.members, self.outbox, self.figures = members, outbox, figures
        self.roster: SiloRoster = members.roster
        self.mode = self.roster.mode
        self.round_idx = 0
        self.round = OpenRound(-1, [], {})
        self.evaluation = OpenEvaluation(-1, [])
        self.evaluation_sum: Optional[SecureEvaluation] = None  # the open evaluation's secure sum (secure runs)
        self.aggregation: RoundAggregation = ClearAggregation(self)  # the open round's
        self.unclipped = UnclippedInputs()  # secure rounds: which silo's inputs keep breaking the bound
        self.averaged_from: List[int] = []  # the silos whose updates the last round's average was given
        self.roster.on_drop.append(self.drop_awaited)

    def give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        self.members.give_up_on(self.round_idx, silos, why, go_on)

    def ignore(self, now: float, what: str, silo: int, stamped: Any, note: str = "") -> bool:
        """A message the open round does not take (``what``, for round ``stamped``): logged, and a
        silo the server gave up on is told so. False: nothing closed."""
        logger.warning(
            "ignored %s from silo rank %d for round %s (the server is %s round %d%s)",
            what,
            silo,
            stamped,
            self.clock.phase.value,
            self.round_idx,
            note,
        )
        self.members.tell_if_left_out(now, self.round_idx, silo)
        return False

    def drop_awaited(self, silos: Sequence[int]) -> None:
        """What ``silos``, no longer taking part, owed the open round or evaluation will not come
        (the roster calls this whenever silos leave)."""
        for silo in silos:
            # an update it sent before it left stays in the round (trained on the round's model); only
            # what it still owed is dropped (its assignment popped after its answer, the round's close
            # could not name the update's sender: a KeyError that ended the run)
            self.round.forget(silo)
            self.evaluation.awaiting.discard(silo)
        self.aggregation.drop(list(silos), "left the run")
        if self.evaluation_sum is not None:
            self.evaluation_sum.drop(list(silos), "left the run")

    def restarted(self, silo: int) -> None:
        """``silo`` restarted: what its earlier process owed will not come."""
        if self.clock.phase is Phase.TRAINING and self.round.forget(silo):
            logger.warning(
                "round %d: silo rank %d restarted; its update for this round is missing", self.round_idx, silo
            )
        self.evaluation.awaiting.discard(silo)
        self.aggregation.drop([silo], "restarted")
        if self.evaluation_sum is not None:
            self.evaluation_sum.drop([silo], "restarted")

    # -- training ------------------------------------------------------------------------------------
    def open_round(self, now: float, kind: int) -> bool:
        """Open round ``round_idx``: send its model to its silos, within the round's deadline."""
        self.round = self.sampled(self.round_idx)
        if self.round.offline():
            logger.warning(
                "round %d: sampled silo rank(s) %s are offline; they are missing from this round",
                self.round_idx,
                self.round.offline(),
            )
        self.clock.enter(Phase.TRAINING, now, self.clock.round_seconds())
        if not self.roster.setup.secure:
            self.aggregation = ClearAggregation(self)
        else:
            aggregation = self.aggregation = SecureAggregation.open(self)
            short = aggregation.short_at_start()
            if short is not None:  # honest silos would decline it: no model goes out, the global model is kept
                if len(self.roster.live) < aggregation.secure.need:  # and so would every later round
                    left = len(self.roster.live)
                    raise TooFewSilos(f"{short}; {left} silo(s) are left in the run: no round can be summed")
                logger.error("%s; the global model is kept", short)
                return aggregation.close(now, None, short)
        self.outbox.send(self.models_for(self.round, kind), self.clock.deadline or now, ROUND)
        return self.close_if_complete(now)

    def first_round_short_of(self, out: Set[int], needed: int) -> Optional[Tuple[int, List[int], List[int]]]:
        """The first round left to run whose silos, ``out`` silos taken away (and their places taken
        as :meth:`sampled` takes them), are fewer than ``needed``, as (round, its keyed sample's
        silos, those that can take part); None if every round has enough."""
        silos = self.roster.setup.silos
        for round_idx in range(self.round_idx, self.round_num):
            sample = self.plan.sample_clients(round_idx)
            expected, _ = self.mode.assignment(silos, silos, sample)
            users = self.round_users(round_idx, sample, [s - 1 for s in out])
            able = [s for s in self.mode.assignment(silos, silos, users)[0] if s not in out]
            if len(able) < needed:
                return round_idx, sorted(expected), sorted(able)
        return None

    def round_users(self, round_idx: int, users: List[int], lost: Sequence[int]) -> List[int]:
        """Round ``round_idx``'s users from its keyed sample ``users`` (as in sp); in a secure
        data-owner round, the places of ``lost`` users go to the next users of the round's keyed order
        (secagg_args.reserve_silos), which every silo checks."""
        setup = self.roster.setup
        if setup.secure and setup.reserve_silos and setup.keyed_order is not None and setup.own_data:
            return with_reserves(setup.keyed_order(round_idx), len(users), lost, setup.reserve_silos)
        return users

    def sampled(self, round_idx: int) -> OpenRound:
        """Round ``round_idx``'s silos and users (:meth:`round_users`, the silos the server has lost
        replaced where the run allows)."""
        users = self.plan.sample_clients(round_idx)
        setup = self.roster.setup
        order = setup.keyed_order(round_idx) if setup.keyed_order is not None else users
        replaced = self.round_users(round_idx, users, [u for u in order if u + 1 not in self.roster.live])
        if sorted(replaced) != sorted(users):
            logger.warning(
                "round %d: silo rank(s) %s are lost; their places go to silo rank(s) %s, next in the round's keyed "
                "order (secagg_args.reserve_silos=%d)",
                round_idx,
                sorted(u + 1 for u in users if u not in replaced),
                sorted(u + 1 for u in replaced if u not in users),
                setup.reserve_silos,
            )
        return OpenRound(round_idx, *self.roster.assignment(replaced))

    def models_for(self, round_: OpenRound, kind: int) -> List[ToSilo]:
        """The global model, to each silo of ``round_`` with the user it trains."""
        params = self.model.params()
        terms = self.aggregation.terms if round_ is self.round else (lambda silo: None)
        return [
            ToSilo(kind, s, self.round_idx, params, user, params=terms(s))
            for s, (_, user) in sorted(round_.assigned.items())
        ]

    def unreachable(self, now: float, purpose: str, silos: Dict[int, str]) -> bool:
        """The round's or the evaluation's models did not reach ``silos`` (silo -> why) in time."""
        for _, why in sorted(silos.items()):
            logger.warning("%s", why)
        words = f"unreachable for {self.clock.deadline_words(now)}"
        if purpose == ROUND and self.clock.phase is Phase.TRAINING:
            leaving = sorted(s for s in silos if s in self.round.assigned)
            self.give_up_on(leaving, words, self.aggregation.go_on(leaving))
        elif purpose == EVALUATION and self.clock.phase is Phase.EVALUATING:
            self.give_up_on(sorted(s for s in silos if s in self.evaluation.awaiting), words, True)
        return self.close_if_complete(now)

    def close_if_complete(self, now: float) -> bool:
        """Close the open round or evaluation once nothing more is awaited."""
        if self.clock.phase is Phase.TRAINING:
            return self.aggregation.advance(now) if self.aggregation.ready() else False
        if self.clock.phase is Phase.EVALUATING and self.evaluation_sum is not None:
            return self.evaluation_sum.advance(now) if self.evaluation_sum.ready() else False
        if self.clock.phase is Phase.EVALUATING and not self.evaluation.awaiting:
            return self.close_evaluation(now, None)
        return False

    def on_update(
        self, now: float, silo: int, stamped: Any, declared: Any, model: Any, counts: Any, training: Any = None
    ) -> bool:
        """``silo``'s update for round ``stamped``, declaring ``declared`` samples, with its own
        evaluation ``counts`` of the model it received (shared mode) and its training figures."""
        return self.aggregation.on_update(now, silo, stamped, declared, model, counts, training)

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        """``silo``'s message of a secure-aggregation stage for round ``stamped`` (or, evaluating, of
        the evaluation's secure sum)."""
        if self.clock.phase is Phase.EVALUATING and self.evaluation_sum is not None:
            return self.evaluation_sum.on_secagg(now, silo, kind, stamped, params, model, size)
        return self.aggregation.on_secagg(now, silo, kind, stamped, params, model, size)

    def close_round(self, now: float, why_missing: Optional[str]) -> bool:
        """The round's deadline passed (``why_missing`` says what the missing silos failed to do)."""
        return self.aggregation.deadline(now, why_missing or "missed the round")

    def round_closed(self, now: float, round_idx: int, params: Any) -> bool:
        """Round ``round_idx`` gave the global model ``params``: record it, evaluate, go on."""
        setup = self.roster.setup
        how = "securely summed" if setup.secure else "averaged in the clear"
        logger.info(
            "round %d closed after %.2f s: the updates of silo rank(s) %s %s (of %s sampled)%s",
            round_idx,
            now - self.clock.opened,
            self.averaged_from,
            how,
            self.round.expected,
            "; each update under DP-SGD" if setup.privacy else "",
        )
        self.outbox.record("round_finished", round_idx, params)
        self.figures.log(f"round {round_idx}")
        self.outbox.record("record_refusals")
        if self.mode.silos_evaluate(self.plan.evaluates(round_idx)):
            return self.open_evaluation(now, round_idx)
        return self.next_round(now)

    def next_round(self, now: float) -> bool:
        self.round_idx += 1
        if self.round_idx < self.round_num:
            return self.open_round(now, wire.SYNC_MODEL)
        return True

    # -- evaluation on the silos' own data --------------------------------------------------------------
    def open_evaluation(self, now: float, round_idx: int) -> bool:
        """Every live silo evaluates the model after ``round_idx`` on its own data."""
        self.evaluation = OpenEvaluation(round_idx, self.roster.live, now)
        self.clock.enter(Phase.EVALUATING, now, self.clock.round_seconds())
        params = self.model.params()
        silos = sorted(self.evaluation.awaiting)
        self.evaluation_sum = None
        terms: Any = lambda silo: None  # noqa: E731
        if self.roster.setup.secure:  # the figures leave each silo only inside a secure sum
            self.evaluation_sum = SecureEvaluation.open(self, round_idx, silos, now)
            terms = self.evaluation_sum.terms
        messages = [ToSilo(wire.EVALUATE, s, round_idx, params, s - 1, params=terms(s)) for s in silos]
        self.outbox.send(messages, self.clock.deadline or now, EVALUATION)
        return self.close_if_complete(now)

    def on_evaluation(self, now: float, silo: int, counts: Any) -> bool:
        if self.clock.phase is not Phase.EVALUATING or silo not in self.evaluation.awaiting:
            return self.ignore(now, "an evaluation", silo, self.evaluation.round_idx)
        if self.evaluation_sum is not None:
            why = (
                f"the evaluation after round {self.evaluation.round_idx}: silo rank {silo} sent its figures in the "
                f"clear; this run sums evaluations securely"
            )
            self.outbox.refuse(silo, REFUSED_SECAGG, why)
            return False
        self.evaluation.take(silo, counts, self.roster, self.outbox.refuse)
        return self.close_if_complete(now)

    def close_evaluation(self, now: float, why_missing: Optional[str]) -> bool:
        """The evaluation's deadline passed (or nothing more is awaited): record it, go on. A secure
        evaluation's deadline is its stage's: the sum goes on without the silos that missed it."""
        if self.evaluation_sum is not None and not self.evaluation_sum.closed:
            return self.evaluation_sum.deadline(now, why_missing or "sent nothing")
        if self.evaluation.awaiting:
            self.give_up_on(sorted(self.evaluation.awaiting), why_missing or "sent no evaluation", True)
        self.evaluation.record(self.outbox, self.roster.setup.silos)
        return self.finish_evaluation(now)

    def finish_evaluation(self, now: float) -> bool:
        """The evaluation is recorded: the next round."""
        self.clock.disarm()
        self.outbox.record("record_refusals")
        return self.next_round(now)


def silo_failed(rounds: SiloRounds, now: float, silo: int, reason: str, stopped: bool = False) -> bool:
    """``silo`` said it fails, and why (or, ``stopped``, that its process was stopped): ``rounds``
    give up on it now, so a new process of it is taken back when it announces itself; the run stops
    if its round cannot do without it (the rule for a silo that misses a deadline). True once the
    last round closed."""
    if silo not in rounds.roster.live:
        return False
    if stopped:
        why = f"was stopped: {reason}; a new process of it is taken back when it announces itself"
    else:
        why = f"failed: {reason}"
    if "DivergenceError" in why and rounds.averaged_from:  # the model it was sent may be what diverged
        why += (
            f" (training from the global model of round {rounds.round_idx - 1}, averaged from the updates of "
            f"silo rank(s) {rounds.averaged_from}: a diverging model is not this silo's doing alone)"
        )
    logger.log(logging.WARNING if stopped else logging.ERROR, "silo rank %d %s", silo, why)
    return _without(rounds, now, silo, why)


def _without(rounds: SiloRounds, now: float, silo: int, why: str) -> bool:
    """Give up on ``silo`` now (``why``); the run stops if the open round cannot do without it."""
    go_on = True
    if rounds.clock.phase is Phase.TRAINING and silo in rounds.round.assigned:
        go_on = rounds.aggregation.go_on([silo])
    rounds.give_up_on([silo], why, go_on)
    return rounds.close_if_complete(now)


def silo_declined(rounds: SiloRounds, now: float, silo: int, reason: str) -> bool:
    """``silo``'s own checks refused the open round (a model, terms or schedule that are not this
    run's, a spent DP budget; ``reason`` is its words): the round goes on without it now, by the
    rule for a silo that misses a deadline, rather than at the deadline; the silo is told it was
    left out, announces itself again and takes part from a later round. A decline of a round the
    silo is not awaited in (late, or sent twice) changes nothing. A declined evaluation leaves the
    silo's user out of that evaluation at once; the silo stays. True once the last round closed."""
    if rounds.clock.phase is Phase.EVALUATING and silo in rounds.evaluation.awaiting:
        # its own rules refused the evaluation (not scheduled, done already, its budget spent): its
        # user is missing from this evaluation, now rather than at the deadline; it stays in the run
        logger.error(
            "silo rank %d declined the evaluation after round %d: %s", silo, rounds.evaluation.round_idx, reason
        )
        rounds.evaluation.awaiting.discard(silo)
        if rounds.evaluation_sum is not None:
            rounds.evaluation_sum.drop([silo], "declined")
        return rounds.close_if_complete(now)
    if rounds.clock.phase is not Phase.TRAINING or silo not in rounds.round.assigned:
        return rounds.ignore(now, "a refusal", silo, rounds.round_idx, f"; it said: {reason}"[:300])
    why = f"declined round {rounds.round_idx}: {reason}"
    logger.error("silo rank %d %s", silo, why)
    closed = _without(rounds, now, silo, why)
    rounds.members.tell_if_left_out(now, rounds.round_idx, silo)
    return closed
