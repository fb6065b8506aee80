"""The cross-silo server's rounds: its TRAINING and EVALUATING phases (server.py has the run's
start and end, and routes messages here). Each round's model goes to the round's silos; their
updates are checked (:mod:`.open_work`) and averaged by FedML's aggregator with the plugin's
hooks; in data-owner mode, on the run's evaluation rounds, every live silo evaluates the new
model on its own data. A silo that misses a deadline is given up on (:mod:`.membership`).

Every method that may close the last round returns True then, and the server ends the run.
FedML's counter ``args.round_idx`` is the round (its transport stamps it on every message)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

from ...algorithms.base import RoundDriver
from ..bootstrap import import_fedml
from .agreement import SiloSetup
from .mail import ServerMail, to_silo
from .membership import SiloMembership
from .open_work import OpenEvaluation, OpenRound, SiloFigures
from .phases import Phase, PhaseClock
from .roster import SiloRoster
from . import wire

import_fedml()
from fedml.core.distributed.communication.message import Message  # noqa: E402
from fedml.cross_silo.server.message_define import MyMessage  # noqa: E402

logger = logging.getLogger(__name__)


class SiloRounds:
    """Rounds ``args.round_idx`` up to ``round_num`` over the silos ``members`` keeps; models come
    from and go to ``aggregator`` (the plugin's FedML aggregator); ``driver`` samples each round's
    users and takes each new global model and evaluation."""

    def __init__(
        self,
        args: Any,
        round_num: int,
        aggregator: Any,
        clock: PhaseClock,
        members: SiloMembership,
        mail: ServerMail,
        figures: SiloFigures,
        driver: RoundDriver,
        setup: SiloSetup,
    ) -> None:
        self.args, self.round_num, self.aggregator, self.clock = args, round_num, aggregator, clock
        self.members, self.mail, self.figures, self.driver, self.setup = members, mail, figures, driver, setup
        self.roster: SiloRoster = members.roster
        self.round = OpenRound(-1, [], {})
        self.evaluation = OpenEvaluation(-1, [])
        self.roster.on_drop.append(self.drop_open_work)

    @property
    def round_idx(self) -> int:
        return self.args.round_idx

    def give_up_on(self, silos: List[int], why: str, go_on: bool) -> None:
        self.members.give_up_on(self.round_idx, silos, why, go_on)

    def drop_open_work(self, silos: Sequence[int]) -> None:
        """What ``silos``, no longer taking part, owed the open round or evaluation will not come
        (the roster calls this whenever silos leave)."""
        for silo in silos:
            self.round.assigned.pop(silo, None)
            self.evaluation.awaiting.discard(silo)

    def restarted(self, silo: int) -> None:
        """``silo`` restarted: what its earlier process owed will not come."""
        if self.clock.phase is Phase.TRAINING and self.round.forget(silo):
            logger.warning(
                "round %d: silo rank %d restarted; its update for this round is missing", self.round_idx, silo
            )
        self.evaluation.awaiting.discard(silo)

    # -- training ------------------------------------------------------------------------------------
    def open_round(self, msg_type: int) -> bool:
        """Open round ``round_idx``: send its model to its silos, within the round's deadline."""
        round_idx = self.round_idx
        self.round = self.sampled(round_idx)
        if self.round.offline():
            logger.warning(
                "round %d: sampled silo rank(s) %s are offline; they are missing from this round",
                round_idx,
                self.round.offline(),
            )
        self.clock.enter(Phase.TRAINING, self.clock.round_seconds())
        unreachable = self.mail.send(self.models_for(self.round, msg_type), self.clock.deadline)
        for _, err in sorted(unreachable.items()):
            logger.warning("%s", err)
        if unreachable:
            reachable = [s for s in self.round.assigned if s not in unreachable]
            go_on, _ = self.members.policy.after_deadline(self.round.expected, reachable)
            self.give_up_on(sorted(unreachable), f"unreachable for {self.clock.deadline_words()}", go_on)
        return self.close_if_complete()

    def sampled(self, round_idx: int) -> OpenRound:
        """Round ``round_idx``'s silos and users: the algorithm's keyed sample, as in sp."""
        return OpenRound(round_idx, *self.roster.assignment(self.driver.sample_clients(round_idx)))

    def models_for(self, round_: OpenRound, msg_type: int) -> List[Message]:
        """The global model, to each silo of ``round_`` with the user it trains."""
        params = self.aggregator.get_global_model_params()
        return [to_silo(msg_type, s, params, user) for s, (_, user) in sorted(round_.assigned.items())]

    def close_if_complete(self) -> bool:
        """Close the open round or evaluation once nothing more is awaited."""
        if self.clock.phase is Phase.TRAINING and self.round.complete():
            return self.close_round(None)
        if self.clock.phase is Phase.EVALUATING and not self.evaluation.awaiting:
            return self.close_evaluation(None)
        return False

    def on_update(self, silo: int, stamped: Any, declared: Any, model: Any, counts: Optional[Dict[str, Any]]) -> bool:
        """``silo``'s update for round ``stamped``, declaring ``declared`` samples, with its own
        evaluation ``counts`` of the model it received (shared mode)."""
        if self.clock.phase is not Phase.TRAINING or not self.round.takes(silo, stamped):
            logger.warning(
                "ignored an update from silo rank %d for round %s (the server is %s round %d%s)",
                silo,
                stamped,
                self.clock.phase.value,
                self.round_idx,
                "; it already sent one" if silo in self.round.answered else "",
            )
            self.mail.tell_if_left_out(silo)
            return False
        if self.round.take(silo, declared, model, self.roster, self.mail.count_refusal):
            self.figures.note(silo, counts, self.round.user_of(silo), self.round_idx)
        else:
            self.driver.record_rejected_update(self.round_idx)
        if self.round.answered_by_all():
            self.clock.measure_round()
        return self.close_if_complete()

    def close_round(self, why_missing: Optional[str]) -> bool:
        """The round's deadline passed (``why_missing`` says what the missing silos failed to do)
        or every silo answered: give up on the missing, aggregate, evaluate, go on."""
        self.clock.disarm()
        go_on, missing = self.members.policy.after_deadline(self.round.expected, sorted(self.round.answered))
        waited = [s for s in missing if s in self.round.assigned]  # sent the round's model, sent nothing back
        if not go_on:
            self.give_up_on(missing, why_missing or "missed the round", False)
        self.give_up_on(waited, why_missing or "missed the round", True)
        round_idx = self.round_idx
        self.driver.round_finished(round_idx, self.aggregator.aggregate_updates(self.round.updates))
        self.figures.log(f"round {round_idx}")
        self.driver.record_refusals(self.mail.refusal_totals())
        if self.setup.own_data and self.driver.evaluates(round_idx):
            return self.open_evaluation(round_idx)
        return self.next_round()

    def next_round(self) -> bool:
        self.args.round_idx = self.round_idx + 1
        if self.round_idx < self.round_num:
            return self.open_round(MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT)
        return True

    # -- evaluation (data-owner mode) ----------------------------------------------------------------
    def open_evaluation(self, round_idx: int) -> bool:
        """Every live silo evaluates the model after ``round_idx`` on its own data."""
        self.evaluation = OpenEvaluation(round_idx, self.roster.live)
        self.clock.enter(Phase.EVALUATING, self.clock.round_seconds())
        params = self.aggregator.get_global_model_params()
        messages = [to_silo(wire.EVALUATE, s, params, s - 1, round_idx) for s in sorted(self.evaluation.awaiting)]
        unreachable = self.mail.send(messages, self.clock.deadline)
        if unreachable:
            self.give_up_on(sorted(unreachable), f"unreachable for {self.clock.deadline_words()}", True)
        return self.close_if_complete()

    def on_evaluation(self, silo: int, counts: Any) -> bool:
        if self.clock.phase is not Phase.EVALUATING or silo not in self.evaluation.awaiting:
            logger.warning(
                "ignored an evaluation from silo rank %d (the server is %s round %d)",
                silo,
                self.clock.phase.value,
                self.round_idx,
            )
            self.mail.tell_if_left_out(silo)
            return False
        self.evaluation.take(silo, counts, self.roster, self.mail.count_refusal)
        return self.close_if_complete()

    def close_evaluation(self, why_missing: Optional[str]) -> bool:
        self.clock.disarm()
        if self.evaluation.awaiting:
            self.give_up_on(sorted(self.evaluation.awaiting), why_missing or "sent no evaluation", True)
        self.evaluation.record(self.driver, self.setup.silos)
        self.driver.record_refusals(self.mail.refusal_totals())
        return self.next_round()
