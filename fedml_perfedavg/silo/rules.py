"""What a data owner's silo lets the server have of its data, decided by the silo's own process from
its own copy of the run's plan and its own record, whatever the server says (docs/security.md):

- **training**: only in a round the keyed schedule samples it, each round once and in order, within
  its DP budget; the same round again on the same model (a resumed server) gets the stored answer;
- **evaluation is a use like training**: only for a round the run's evaluation schedule evaluates
  (``frequency_of_the_test`` and the last round, which every party agrees on), each once and in
  order, within its DP budget; the same round again on the same model gets the stored counts
  (nothing is computed: no personalization noise is drawn twice), on another model it is refused,
  so no noise key is ever used on two models;
- **no final-model stage** in data-owner mode: the last round's evaluation is the run's end, so a
  model stamped past the last round is refused, never personalized;
- **one survivor list per round**: shares are revealed for one list of survivors a round, and the
  list is recorded only when the shares are about to leave (a round declined before that can be
  sent again by a resumed server).

Each rule is a method that returns a :class:`Decision` and changes nothing; the silo records what it
did (its :class:`~.outcome.SiloOutcome`, its ledger) once it does it. Events in, decisions out: the
tests (tests/silo/test_rules.py) are lists of events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..core.sampling import reserve_problem
from .outcome import SiloOutcome, StoredAnswer, state_digest

TRAIN, EVALUATE, UNMASK, STORED, REFUSE = "train", "evaluate", "unmask", "stored", "refuse"


@dataclass(frozen=True)
class Decision:
    """What the silo does with the server's request: ``action`` is TRAIN, EVALUATE or UNMASK (do it now),
    STORED (send ``stored`` again: a stored answer, or stored counts) or REFUSE (``reason``)."""

    action: str
    reason: Optional[str] = None
    stored: Any = None

    @property
    def refused(self) -> bool:
        return self.action == REFUSE


class DataOwnerRules:
    """The rules of the module doc for silo ``rank`` holding user ``user``: ``scheduled(round)``
    (the keyed schedule's silo ranks), ``evaluates(round)`` (the run's evaluation schedule),
    ``round_num`` rounds, ``ledger`` the user's DP-SGD account (None without DP-SGD)."""

    def __init__(
        self,
        rank: int,
        user: int,
        outcome: SiloOutcome,
        round_num: int,
        scheduled: Optional[Callable[[int], List[int]]] = None,
        evaluates: Optional[Callable[[int], bool]] = None,
        ledger: Any = None,
        keyed_order: Optional[Callable[[int], List[int]]] = None,
        reserves: int = 0,
    ) -> None:
        self.rank, self.user, self.outcome, self.round_num = rank, user, outcome, int(round_num)
        self.scheduled, self.evaluates, self.ledger = scheduled, evaluates, ledger
        self.keyed_order, self.reserves = keyed_order, int(reserves)

    # -- training -------------------------------------------------------------------------------------
    def training(self, round_idx: int, received: Dict[str, Any], silos: Optional[Sequence[int]] = None) -> Decision:
        """Whether to train round ``round_idx`` on the model ``received``; ``silos``: the round's silos
        as a secure round's terms list them (a silo past the keyed sample takes a lost one's place)."""
        if not 0 <= round_idx < self.round_num:
            return Decision(REFUSE, self._past_the_run(round_idx, "a model to train"))
        scheduled = self.scheduled
        if scheduled is not None and self.rank not in scheduled(round_idx):
            replacing = self.replacement_problem(round_idx, silos)
            if replacing is not None:
                return Decision(
                    REFUSE,
                    f"the keyed schedule (train_args.random_seed, round) does not sample this silo in round "
                    f"{round_idx}; it samples silo rank(s) {scheduled(round_idx)}" + replacing,
                )
        last, answer = self.outcome.trained_round, self.outcome.answer
        if last is not None and round_idx < last:
            return Decision(REFUSE, f"it has trained round {last}; rounds go forwards, each trained once")
        if last is not None and round_idx == last:
            if answer is not None and answer.round_idx == round_idx and answer.model_digest == state_digest(received):
                return Decision(STORED, stored=answer)
            return Decision(REFUSE, f"it trained round {round_idx} already, on another model; a round is trained once")
        over = self._over_budget(round_idx, "training")
        return Decision(REFUSE, over) if over else Decision(TRAIN)

    def replacement_problem(self, round_idx: int, silos: Optional[Sequence[int]]) -> Optional[str]:
        """Why this silo, not in round ``round_idx``'s keyed sample, cannot take a lost silo's place in
        it (None: it can): the round's ``silos`` must be at most the sample's size, all within the round's
        keyed order's first sample + ``reserves`` (core/sampling.py ``reserve_problem``), this one among them."""
        if not self.reserves or self.keyed_order is None or self.scheduled is None:
            return ""
        if silos is None or self.rank not in silos:
            return f", and no secure round lists it in a lost silo's place (secagg_args.reserve_silos={self.reserves})"
        problem = reserve_problem(self.keyed_order(round_idx), len(self.scheduled(round_idx)), self.reserves, silos)
        return None if problem is None else f"; the round's silos {problem}"

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluation(self, round_idx: int, model: Dict[str, Any]) -> Decision:
        """Whether to evaluate the model ``model`` the server says is round ``round_idx``'s."""
        if not 0 <= round_idx < self.round_num:
            return Decision(REFUSE, self._past_the_run(round_idx, "an evaluation"))
        if self.evaluates is not None and not self.evaluates(round_idx):
            return Decision(
                REFUSE,
                f"the run's evaluation schedule (train_args.frequency_of_the_test, comm_round={self.round_num}) "
                f"does not evaluate after round {round_idx}; an evaluation uses this silo's data as training does",
            )
        done = self.outcome.evaluations
        if done:
            last = int(done[-1]["round"])
            if round_idx < last:
                return Decision(REFUSE, f"it has evaluated after round {last}; evaluations go forwards, each once")
            if round_idx == last:
                same = self.outcome.model is not None and state_digest(self.outcome.model) == state_digest(model)
                if same:
                    return Decision(STORED, stored=dict(done[-1]))
                return Decision(
                    REFUSE,
                    f"it evaluated after round {round_idx} already, on another model; the same personalization "
                    f"noise is never used on two models",
                )
        over = self._over_budget(round_idx, "evaluation")
        return Decision(REFUSE, over) if over else Decision(EVALUATE)

    def final_model(self, round_idx: int) -> Decision:
        """A model stamped ``round_idx`` >= the run's rounds (shared mode's final model): refused in
        data-owner mode, whose last round's evaluation ends the run."""
        return Decision(REFUSE, self._past_the_run(round_idx, "a final model"))

    # -- secure aggregation ---------------------------------------------------------------------------
    def unmasking(self, round_idx: int, survivors: Sequence[int], evaluation: bool = False) -> Decision:
        """Whether the silo may reveal its shares of round ``round_idx`` (``evaluation``: of the
        evaluation after it) for ``survivors`` (checked at the survivors' signature and at the
        unmasking; recorded by :meth:`SiloOutcome.unmasked_for` only when the shares leave)."""
        problem = self.outcome.unmasking_problem(round_idx, survivors, evaluation)
        return Decision(REFUSE, problem) if problem else Decision(UNMASK)

    # -- helpers --------------------------------------------------------------------------------------
    def _past_the_run(self, round_idx: int, what: str) -> str:
        return (
            f"{what} stamped round {round_idx}: this run has rounds 0..{self.round_num - 1} (comm_round="
            f"{self.round_num}), and in data-owner mode the last round's evaluation ends it; there is no final model"
        )

    def _over_budget(self, round_idx: int, what: str) -> Optional[str]:
        ledger = self.ledger
        budget = None if ledger is None else ledger.dp.max_epsilon
        if ledger is None or budget is None or not ledger.would_pass(round_idx, self.user, budget, what):
            return None
        after = ledger.after_training(round_idx, self.user, what)
        use = "training" if what == "training" else "the evaluation's personalization"
        return (
            f"{use} would take user {self.user}'s epsilon from {ledger.epsilon(self.user):.4g} to {after:.4g}, "
            f"past this silo's dp_args.max_epsilon={budget:g}"
        )


__all__ = ["DataOwnerRules", "Decision", "StoredAnswer", "TRAIN", "EVALUATE", "UNMASK", "STORED", "REFUSE"]
