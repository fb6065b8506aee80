"""The cross-silo protocol's rounds: its TRAINING and EVALUATING phases (:mod:`.protocol` has the
run's start and end, and routes events here). Each round's model goes to the round's silos; their
updates are checked (:mod:`.awaited`) and averaged by the global model's owner
(:class:`GlobalModel`: FedML's aggregator with the plugin's hooks); where the data mode says so
(data-owner mode, on the run's evaluation rounds) every live silo evaluates the new model on its
own data. A silo that misses a deadline, or cannot be reached, is given up on (:mod:`.membership`).

Every method that may close the last round returns True then, and the protocol ends the run.
Nothing here reads a clock or sends: each method is told the time, and its sends and records go
to the event's :class:`~.events.Outbox`."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Protocol, Sequence

from ...secagg import fixed_point
from ...secagg.primitives import SecAggError
from ...secagg.rounds import RoundFailed
from .events import EVALUATION, ROUND, Outbox, ToSilo
from .membership import SiloMembership
from .awaited import OpenEvaluation, OpenRound
from .phases import Phase, PhaseClock
from .roster import SiloRoster
from .secure_rounds import REFUSED_SECAGG, SecureRound, UnclippedInputs
from . import wire

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


class SecureStages:
    """The open round's secure-aggregation stages (secure_rounds.py), as :class:`SiloRounds` runs
    them: its state (``round``, ``secure``, ``clock``, ``members``, ``model``, ``outbox``) is
    SiloRounds', and the round ends through its ``round_closed``."""

    round: OpenRound
    secure: Optional[SecureRound]
    unclipped: UnclippedInputs
    round_idx: int
    clock: PhaseClock
    members: SiloMembership
    model: GlobalModel
    outbox: Outbox
    roster: SiloRoster

    def give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        raise NotImplementedError  # SiloRounds'

    def close_if_complete(self, now: float) -> bool:
        raise NotImplementedError  # SiloRounds'

    def round_closed(self, now: float, round_idx: int, params: Any) -> bool:
        raise NotImplementedError  # SiloRounds'

    def secure_round(self) -> SecureRound:
        """The open round's secure aggregation: weights adding up to 1 over the silos sent its
        model, fraction bits that the sum of inputs within the update bound cannot wrap."""
        setup, silos = self.roster.setup, sorted(self.round.assigned)
        if setup.sample_weighted:
            counts = {s: self.roster.counts_of(s, self.round.assigned[s][1])[0] for s in silos}
        else:
            counts = {s: 1 for s in silos}
        bound = self.model.update_bound()
        bits = fixed_point.fraction_bits(bound)
        if bits < fixed_point.MIN_FRACTION_BITS:
            raise SecAggError(
                f"round {self.round_idx}: the update bound {bound:.4g} (train_args.max_update_ratio x max(||w||, 1), "
                f"or max_update_norm) leaves {bits} fraction bits in 32-bit fixed point, fewer than "
                f"{fixed_point.MIN_FRACTION_BITS}; lower train_args.max_update_ratio or set max_update_norm"
            )
        threshold = int(setup.secure_threshold or 2)
        weighted = counts if setup.sample_weighted else None
        length = self.model.vector_length()
        return SecureRound(self.round_idx, silos, weighted, threshold, length, bits, bound, setup.run_id)

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        """``silo``'s message of a secure-aggregation stage for round ``stamped``."""
        secure = self.secure
        if (
            self.clock.phase is not Phase.TRAINING
            or secure is None
            or stamped != self.round_idx
            or silo not in secure.awaiting
        ):
            logger.warning(
                "ignored a secure-aggregation message (type %d) from silo rank %d for round %s "
                "(the server is %s round %d)",
                kind,
                silo,
                stamped,
                self.clock.phase.value,
                self.round_idx,
            )
            self.members.tell_if_left_out(now, self.round_idx, silo)
            return False
        problem = secure.take(silo, kind, params, model, size)
        if problem is not None:
            self.outbox.refuse(silo, REFUSED_SECAGG, problem)
            standing = [s for s in secure.stage_silos if s not in secure.lost]
            go_on, _ = self.members.policy.after_deadline(self.round.expected, standing)
            self.give_up_on([silo], problem, go_on)  # one bad silo fails only itself, named in lost_silos
        return self.close_if_complete(now)

    def advance_secure(self, now: float) -> bool:
        """Every silo of the stage answered (or the rest were given up on): the next stage, or the
        round's end with the unmasked sum; fewer than the threshold left end it without one."""
        assert self.secure is not None
        try:
            total = self.secure.advance(self.outbox, now + self.clock.round_seconds())
        except RoundFailed as err:
            logger.error("%s; the global model is kept", err)
            return self.close_secure(now, None, str(err))
        if total is None:
            self.clock.deadline = now + self.clock.round_seconds()
            return self.close_if_complete(now)
        for silo, why in sorted(self.secure.false_shares.items()):  # the round was rebuilt without them
            problem = f"round {self.round_idx}: silo rank {silo}'s secure aggregation: {why}"
            self.outbox.refuse(silo, REFUSED_SECAGG, problem)
            self.give_up_on([silo], problem, True)
        return self.close_secure(now, total, None)

    def secure_deadline(self, now: float, why: str) -> bool:
        """The stage's deadline passed: the silos it still awaits are given up on."""
        assert self.secure is not None
        missing = sorted(self.secure.awaiting)
        go_on, _ = self.members.policy.after_deadline(self.round.expected, self.secure.answered())
        self.give_up_on(missing, f"{why} ({self.secure.stage.value})", go_on)
        self.secure.drop(missing, why)
        return self.advance_secure(now)

    def close_secure(self, now: float, total: Any, failed: Optional[str]) -> bool:
        assert self.secure is not None
        self.clock.disarm()
        secure, round_idx = self.secure, self.round_idx
        if total is not None and not secure.lost and set(secure.server.survivors) >= set(self.round.expected):
            self.clock.measure_round(now)
        average = None
        if total is not None:
            try:
                average = secure.average(total)
            except RoundFailed as err:
                logger.error("%s; the global model is kept", err)
                failed = str(err)
            self.found_out(now, round_idx, list(secure.server.survivors), average is None)
        params = self.model.keep(round_idx) if average is None else self.model.secure_average(round_idx, average)
        self.outbox.record("record_secure_round", round_idx, secure.record(failed))
        self.secure = None
        return self.round_closed(now, round_idx, params)

    def found_out(self, now: float, round_idx: int, summed: List[int], over_bound: bool) -> None:
        """Refuse the silos that the rounds over the bound single out (:class:`UnclippedInputs`):
        one silo that keeps sending unclipped inputs stops failing everyone's rounds."""
        named = self.unclipped.note(summed, over_bound)
        for silo in named:
            problem = (
                f"round {round_idx}: silo rank {silo} was summed in every one of the last rounds whose secure "
                f"average broke the update bound ({len(self.unclipped.failed)}), and in no round that kept to it: "
                f"it sends inputs it does not clip"
            )
            self.members.refuse(now, round_idx, silo, problem, True)


class SiloRounds(SecureStages):
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
        self.secure: Optional[SecureRound] = None  # the open round's secure aggregation
        self.unclipped = UnclippedInputs()  # which silo's inputs keep breaking the bound
        self.averaged_from: List[int] = []  # the silos whose updates the last round's average was given
        self.roster.on_drop.append(self.drop_awaited)

    def give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        self.members.give_up_on(self.round_idx, silos, why, go_on)

    def drop_awaited(self, silos: Sequence[int]) -> None:
        """What ``silos``, no longer taking part, owed the open round or evaluation will not come
        (the roster calls this whenever silos leave)."""
        for silo in silos:
            self.round.assigned.pop(silo, None)
            self.evaluation.awaiting.discard(silo)
        if self.secure is not None:
            self.secure.drop(list(silos), "left the run")

    def restarted(self, silo: int) -> None:
        """``silo`` restarted: what its earlier process owed will not come."""
        if self.clock.phase is Phase.TRAINING and self.round.forget(silo):
            logger.warning(
                "round %d: silo rank %d restarted; its update for this round is missing", self.round_idx, silo
            )
        self.evaluation.awaiting.discard(silo)
        if self.secure is not None:
            self.secure.drop([silo], "restarted")

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
        self.secure = self.secure_round() if self.roster.setup.secure_threshold else None
        self.outbox.send(self.models_for(self.round, kind), self.clock.deadline or now, ROUND)
        return self.close_if_complete(now)

    def sampled(self, round_idx: int) -> OpenRound:
        """Round ``round_idx``'s silos and users: the algorithm's keyed sample, as in sp."""
        return OpenRound(round_idx, *self.roster.assignment(self.plan.sample_clients(round_idx)))

    def models_for(self, round_: OpenRound, kind: int) -> List[ToSilo]:
        """The global model, to each silo of ``round_`` with the user it trains."""
        params = self.model.params()
        secure = self.secure if round_ is self.round else None
        return [
            ToSilo(
                kind, s, self.round_idx, params, user, params=None if secure is None else {wire.SECAGG: secure.terms(s)}
            )
            for s, (_, user) in sorted(round_.assigned.items())
        ]

    def unreachable(self, now: float, purpose: str, silos: Dict[int, str]) -> bool:
        """The round's or the evaluation's models did not reach ``silos`` (silo -> why) in time."""
        for _, why in sorted(silos.items()):
            logger.warning("%s", why)
        words = f"unreachable for {self.clock.deadline_words(now)}"
        if purpose == ROUND and self.clock.phase is Phase.TRAINING and self.secure is not None:
            go_on, _ = self.members.policy.after_deadline(
                self.round.expected, [s for s in self.round.assigned if s not in silos]
            )
            self.give_up_on(sorted(s for s in silos if s in self.round.assigned), words, go_on)
        elif purpose == ROUND and self.clock.phase is Phase.TRAINING:
            reachable = [s for s in self.round.assigned if s not in silos]
            go_on, _ = self.members.policy.after_deadline(self.round.expected, reachable)
            self.give_up_on(sorted(s for s in silos if s in self.round.assigned), words, go_on)
        elif purpose == EVALUATION and self.clock.phase is Phase.EVALUATING:
            self.give_up_on(sorted(s for s in silos if s in self.evaluation.awaiting), words, True)
        return self.close_if_complete(now)

    def close_if_complete(self, now: float) -> bool:
        """Close the open round or evaluation once nothing more is awaited."""
        if self.clock.phase is Phase.TRAINING and self.secure is not None:
            return self.advance_secure(now) if not self.secure.awaiting else False
        if self.clock.phase is Phase.TRAINING and self.round.complete():
            return self.close_round(now, None)
        if self.clock.phase is Phase.EVALUATING and not self.evaluation.awaiting:
            return self.close_evaluation(now, None)
        return False

    def on_update(self, now: float, silo: int, stamped: Any, declared: Any, model: Any, counts: Any) -> bool:
        """``silo``'s update for round ``stamped``, declaring ``declared`` samples, with its own
        evaluation ``counts`` of the model it received (shared mode)."""
        if self.secure is not None and self.clock.phase is Phase.TRAINING:
            why = f"round {self.round_idx}: silo rank {silo} sent its update in the clear; this run aggregates securely"
            self.outbox.refuse(silo, REFUSED_SECAGG, why)
            return False
        if self.clock.phase is not Phase.TRAINING or not self.round.takes(silo, stamped):
            logger.warning(
                "ignored an update from silo rank %d for round %s (the server is %s round %d%s)",
                silo,
                stamped,
                self.clock.phase.value,
                self.round_idx,
                "; it already sent one" if silo in self.round.answered else "",
            )
            self.members.tell_if_left_out(now, self.round_idx, silo)
            return False
        if self.round.take(silo, declared, model, self.roster, self.outbox.refuse):
            self.figures.note(silo, counts, self.round.user_of(silo), self.round_idx)
        else:
            self.outbox.record("record_rejected_update", self.round_idx)
        if self.round.answered_by_all():
            self.clock.measure_round(now)
        return self.close_if_complete(now)

    # -- in the clear -----------------------------------------------------------------------------------
    def close_round(self, now: float, why_missing: Optional[str]) -> bool:
        """The round's deadline passed (``why_missing`` says what the missing silos failed to do)
        or every silo answered: give up on the missing, aggregate, evaluate, go on."""
        if self.secure is not None:
            return self.secure_deadline(now, why_missing or "missed the round")
        self.clock.disarm()
        go_on, missing = self.members.policy.after_deadline(self.round.expected, sorted(self.round.answered))
        waited = [s for s in missing if s in self.round.assigned]  # sent the round's model, sent nothing back
        if not go_on:
            self.give_up_on(missing, why_missing or "missed the round", False)
        self.give_up_on(waited, why_missing or "missed the round", True)
        round_idx, senders = self.round_idx, {p: s for s, (p, _) in self.round.assigned.items()}
        self.averaged_from = sorted(senders[p] for p in self.round.updates)  # before the screen's judgement
        named = {p: f"silo rank {senders[p]}" for p in self.round.updates}
        return self.round_closed(now, round_idx, self.model.aggregate(round_idx, self.round.updates, named))

    def round_closed(self, now: float, round_idx: int, params: Any) -> bool:
        """Round ``round_idx`` gave the global model ``params``: record it, evaluate, go on."""
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
        messages = [ToSilo(wire.EVALUATE, s, round_idx, params, s - 1) for s in sorted(self.evaluation.awaiting)]
        self.outbox.send(messages, self.clock.deadline or now, EVALUATION)
        return self.close_if_complete(now)

    def on_evaluation(self, now: float, silo: int, counts: Any) -> bool:
        if self.clock.phase is not Phase.EVALUATING or silo not in self.evaluation.awaiting:
            logger.warning(
                "ignored an evaluation from silo rank %d (the server is %s round %d)",
                silo,
                self.clock.phase.value,
                self.round_idx,
            )
            self.members.tell_if_left_out(now, self.round_idx, silo)
            return False
        self.evaluation.take(silo, counts, self.roster, self.outbox.refuse)
        return self.close_if_complete(now)

    def close_evaluation(self, now: float, why_missing: Optional[str]) -> bool:
        self.clock.disarm()
        if self.evaluation.awaiting:
            self.give_up_on(sorted(self.evaluation.awaiting), why_missing or "sent no evaluation", True)
        self.evaluation.record(self.outbox, self.roster.setup.silos)
        self.outbox.record("record_refusals")
        return self.next_round(now)


def silo_failed(rounds: SiloRounds, now: float, silo: int, why: str) -> bool:
    """``silo`` said it fails: ``rounds`` give up on it now; the run stops if its round cannot do
    without it (the rule for a silo that misses a deadline). True once the last round closed."""
    if silo not in rounds.roster.live:
        return False
    if "DivergenceError" in why and rounds.averaged_from:  # the model it was sent may be what diverged
        why += (
            f" (training from the global model of round {rounds.round_idx - 1}, averaged from the updates of "
            f"silo rank(s) {rounds.averaged_from}: a diverging model is not this silo's doing alone)"
        )
    logger.error("silo rank %d %s", silo, why)
    go_on = True
    if rounds.clock.phase is Phase.TRAINING and silo in rounds.round.assigned:
        others = [s for s in rounds.round.assigned if s != silo]
        go_on = rounds.members.policy.after_deadline(rounds.round.expected, others)[0]
    rounds.give_up_on([silo], why, go_on)
    return rounds.close_if_complete(now)
