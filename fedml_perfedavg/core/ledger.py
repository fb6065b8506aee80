"""Each user's privacy account under DP-SGD: the uses of the mechanism its data saw (sample rate
-> count), counted once per (round, user), and the epsilon they add up to.

:class:`PrivacyLedger` keeps the uses of the users a process trains (every user in a simulation,
its own user in a data owner's silo); :class:`ReportedPrivacy` keeps what data-owner silos report
of their own users (the server of such a run holds no data). Both are a :class:`PrivacyRecord`:
what the run's reporting reads. The accountants that turn uses into epsilon are
core/accounting.py's; the mechanism itself is core/private_draws.py's (draws) and
core/private_steps.py's (clipping, noise). FedML-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from . import accounting
from .accounting import epsilon as accountant_epsilon
from .client_maths import Step
from .privacy import DPSGD, sample_rate, uses_per_step


class PrivacyRecord(Protocol):
    """What a run reports of its users' privacy, whoever did the accounting."""

    dp: DPSGD

    def largest(self, final: bool = False) -> Tuple[float, Optional[int]]: ...

    def report(self, final: bool = False) -> Dict[str, Any]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def largest_epsilon(by_user: Mapping[int, float]) -> Tuple[float, Optional[int]]:
    """(the largest epsilon, the first user with it), (0, None) when none is above 0."""
    best: Tuple[float, Optional[int]] = (0.0, None)
    for user in sorted(by_user):
        if by_user[user] > best[0]:
            best = (by_user[user], user)
    return best


@dataclass(frozen=True)
class UseRules:
    """Which uses of the mechanism a user's data sees: a round's local update (``local_steps``
    steps, each reading ``batch_sizes`` minibatches: D; D' in FO; D'' in HF and exact) and an
    evaluation's personalization (``adapt_steps`` steps on minibatches of ``evaluation_batch_size``)."""

    batch_sizes: Tuple[int, ...]
    local_steps: int
    evaluation_batch_size: int
    adapt_steps: int

    @classmethod
    def of(
        cls, step: Step, batch_sizes: Sequence[int], local_steps: int, eval_batch: int, adapt_steps: int
    ) -> "UseRules":
        return cls(tuple(batch_sizes[: uses_per_step(step)]), local_steps, eval_batch, adapt_steps)

    def training(self, num_samples: int) -> List[Tuple[float, int]]:
        return [(sample_rate(b, num_samples), self.local_steps) for b in self.batch_sizes]

    def evaluation(self, num_samples: int) -> List[Tuple[float, int]]:
        return [(sample_rate(self.evaluation_batch_size, num_samples), self.adapt_steps)]


class PrivacyLedger:
    """Every user's uses of the mechanism so far (sample rate -> count) and their epsilon.

    A round's training and an evaluation are counted once per (round, user), however often they
    are computed: their randomness is keyed by (seed, round, user), so a computation done again
    on the same model (a silo's evaluation of a model the server evaluated too) releases the same
    numbers. Two computations with one key on different models would share their noise, which
    the accounting does not allow: every caller keys by the round that made the model. Its state
    is in checkpoints; :meth:`report` is ``summary.json``'s ``privacy``.

    ``earlier`` (user -> sample rate -> count) are uses of a user's data by earlier runs (a data
    owner's account, run/silo_account.py): every epsilon and budget counts them; the state and
    :meth:`this_run` are this run's alone.

    Two figures per user: :meth:`bound`, the RDP accountant's (milliseconds; what a running
    record shows), and :meth:`epsilon`, ``dp_args.accountant``'s (PRV by default: tight, a tenth
    of a second or more, so computed for a final record, a silo's own user and a budget check the
    bound does not already pass)."""

    def __init__(
        self,
        dp: DPSGD,
        rules: UseRules,
        sample_counts: Mapping[int, int],
        earlier: Optional[Mapping[int, Mapping[float, int]]] = None,
    ) -> None:
        self.dp, self.rules = dp, rules
        self.sample_counts = {int(u): int(n) for u, n in sample_counts.items()}
        self.earlier = {
            int(u): kept for u, e in (earlier or {}).items() if (kept := {float(r): int(c) for r, c in e.items() if c})
        }
        self.uses: Dict[int, Dict[float, int]] = {u: dict(e) for u, e in self.earlier.items()}
        # (round, user) pairs, flat, by what used the data: a round's training, the evaluation after it
        self.counted: Dict[str, List[int]] = {"training": [], "evaluation": []}
        self._seen: set = set()
        self._cache: Dict[Tuple[int, str], Tuple[Tuple[Tuple[float, int], ...], float]] = {}
        accounting.prepare(
            [rate for n in self.sample_counts.values() for rate, _ in rules.training(n) + rules.evaluation(n)]
            + [rate for e in self.earlier.values() for rate in e],
            dp.noise_multiplier,
        )

    def _account(self, what: str, round_idx: int, users: Sequence[int]) -> None:
        rule = self.rules.training if what == "training" else self.rules.evaluation
        for user in users:
            key = (what, int(round_idx), int(user))
            if key in self._seen:
                continue
            self._seen.add(key)
            self.counted[what] += [int(round_idx), int(user)]
            by_rate = self.uses.setdefault(int(user), {})
            for rate, count in rule(self.sample_counts[int(user)]):
                by_rate[rate] = by_rate.get(rate, 0) + count

    def _uses_after(self, what: str, round_idx: int, user: int) -> Dict[float, int]:
        """``user``'s uses were ``what`` ("training" or "evaluation") of round ``round_idx`` counted too."""
        uses = dict(self.uses.get(int(user), {}))
        if (what, int(round_idx), int(user)) not in self._seen:
            rule = self.rules.training if what == "training" else self.rules.evaluation
            for rate, count in rule(self.sample_counts[int(user)]):
                uses[rate] = uses.get(rate, 0) + count
        return uses

    def after_training(self, round_idx: int, user: int, what: str = "training") -> float:
        """``user``'s epsilon (the accountant's) were it to train in round ``round_idx`` too
        (``what="evaluation"``: were the evaluation after that round to personalize on its data)."""
        uses = self._uses_after(what, round_idx, user)
        return accounting.epsilon(self.dp.accountant, uses, self.dp.noise_multiplier, self.dp.delta)

    def would_pass(self, round_idx: int, user: int, budget: float, what: str = "training") -> bool:
        """Whether training in round ``round_idx`` (``what="evaluation"``: the evaluation after it)
        would take ``user``'s epsilon past ``budget`` (the accountant's figure; the RDP bound
        answers where it is within)."""
        uses = self._uses_after(what, round_idx, user)
        return not accounting.within(self.dp.accountant, uses, self.dp.noise_multiplier, self.dp.delta, budget)

    def first_past(self, budget: float) -> Optional[Tuple[float, int]]:
        """(epsilon, user) of a user whose epsilon is past ``budget`` (the largest RDP bound first),
        or None: the accountant's figure is computed only for users whose bound is past it."""
        for bound, user in sorted(((self.bound(u), u) for u in self.uses), key=lambda bu: (-bu[0], bu[1])):
            if bound <= budget:
                return None
            tight = self.epsilon(user)
            if tight > budget:
                return tight, user
        return None

    def left_out(self, round_idx: int, users: Sequence[int]) -> None:
        """``users`` were sampled for round ``round_idx`` but left out: the budget was spent."""
        self.counted.setdefault("left_out", [])
        self.counted["left_out"] += [x for u in users for x in (int(round_idx), int(u))]

    def trained(self, round_idx: int, clients: Sequence[int]) -> None:
        """Round ``round_idx``'s local updates of ``clients`` happened (each once)."""
        self._account("training", round_idx, clients)

    def evaluated(self, round_idx: int, users: Sequence[int]) -> None:
        """The evaluation after round ``round_idx`` personalized the model on ``users``' data."""
        self._account("evaluation", round_idx, users)

    def this_run(self, user: int) -> Dict[float, int]:
        """``user``'s uses in this run alone (sample rate -> count): what its account records."""
        uses: Dict[float, int] = {}
        for what, rule in (("training", self.rules.training), ("evaluation", self.rules.evaluation)):
            flat = self.counted[what]
            for i in range(0, len(flat), 2):
                if flat[i + 1] == int(user):
                    for rate, count in rule(self.sample_counts[int(user)]):
                        uses[rate] = uses.get(rate, 0) + count
        return uses

    def copy(self) -> "PrivacyLedger":
        other = PrivacyLedger(self.dp, self.rules, self.sample_counts, self.earlier)
        other.load_state_dict(self.state_dict())
        return other

    def _figure(self, user: int, accountant: str) -> float:
        uses = self.uses.get(int(user), {})
        key = tuple(sorted(uses.items()))
        cached = self._cache.get((int(user), accountant))
        if cached is None or cached[0] != key:
            cached = (key, accountant_epsilon(accountant, uses, self.dp.noise_multiplier, self.dp.delta))
            self._cache[(int(user), accountant)] = cached
        return cached[1]

    def epsilon(self, user: int) -> float:
        """``user``'s epsilon at the run's delta by ``dp_args.accountant`` (0 before any use)."""
        return self._figure(user, self.dp.accountant)

    def bound(self, user: int) -> float:
        """``user``'s epsilon by the RDP accountant: an upper bound of :meth:`epsilon`, in milliseconds."""
        return self._figure(user, accounting.RDP)

    def largest(self, final: bool = False) -> Tuple[float, Optional[int]]:
        """(the largest epsilon, its user), (0, None) before any use; the RDP bounds where not ``final``."""
        figure = self.epsilon if final else self.bound
        return largest_epsilon({user: figure(user) for user in self.uses})

    def report(self, final: bool = False) -> Dict[str, Any]:
        """``summary.json``'s ``privacy``: the mechanism's settings, the largest epsilon, and per user
        its epsilon, its RDP bound, its uses and its sample rate (the largest, where its minibatches
        differ). Not ``final`` (a running record), each epsilon is its RDP bound: ``epsilon_from``
        says which accountant the figures are."""
        figure = self.epsilon if final else self.bound
        per_user = {
            str(user): {
                "epsilon": figure(user),
                "epsilon_rdp": self.bound(user),
                "uses": sum(self.uses[user].values()),
                "sample_rate": max(self.uses[user]) if self.uses[user] else 0.0,
                # where earlier runs used its data too (its account): how many of the uses were theirs
                **({"earlier_uses": sum(self.earlier[user].values())} if user in self.earlier else {}),
            }
            for user in sorted(self.uses)
        }
        accountant = self.dp.accountant if final else accounting.RDP
        return {
            **self.dp.settings(),
            "epsilon_from": accounting.ACCOUNTANTS[accountant],
            "epsilon": largest_epsilon({int(u): e["epsilon"] for u, e in per_user.items()})[0],
            "per_user": per_user,
            "left_out": [
                {"round": flat[i], "user": flat[i + 1]}
                for flat in [self.counted.get("left_out", [])]
                for i in range(0, len(flat), 2)
            ],
        }

    def state_dict(self) -> Dict[str, Any]:
        return {"counted": {k: list(v) for k, v in self.counted.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.uses, self._seen, self._cache = {u: dict(e) for u, e in self.earlier.items()}, set(), {}
        self.counted = {"training": [], "evaluation": []}
        for what, flat in state["counted"].items():
            if what == "left_out":
                self.counted["left_out"] = [int(v) for v in flat]
                continue
            for i in range(0, len(flat), 2):
                self._account(what, flat[i], [flat[i + 1]])


def planned_ledger(
    ledger: PrivacyLedger,
    rounds: Sequence[int],
    sample: Any,
    evaluates: Any,
    evaluated_users: Sequence[int],
) -> PrivacyLedger:
    """``ledger`` once ``rounds`` have run on top of it: each round's clients (``sample(round)``)
    trained, and ``evaluated_users`` personalized where ``evaluates(round)``. Every draw is keyed,
    so this is what the run will spend; a client that drops out of a round spends less."""
    plan = ledger.copy()
    for round_idx in rounds:
        plan.trained(round_idx, sample(round_idx))
        if evaluates(round_idx):
            plan.evaluated(round_idx, evaluated_users)
    return plan


def planned_epsilon(
    ledger: PrivacyLedger,
    rounds: Sequence[int],
    sample: Any,
    evaluates: Any,
    evaluated_users: Sequence[int],
) -> Tuple[float, Optional[int]]:
    """(epsilon, user) of :func:`planned_ledger` for the user with the largest RDP bound (each
    user's own accountant figure would be a call each: seconds for a paper-sized plan)."""
    plan = planned_ledger(ledger, rounds, sample, evaluates, evaluated_users)
    _, user = plan.largest(final=False)
    return (0.0, None) if user is None else (plan.epsilon(user), user)


def silo_report(ledger: PrivacyLedger, user: int, final: bool = False) -> Dict[str, Any]:
    """What a data owner's silo tells of its own user's privacy: its epsilon, its uses and its
    sample rate (the per-user entry of :meth:`PrivacyLedger.report`): the RDP bound with each
    evaluation it sends (inside the round's deadline), the accountant's figure in its own ``final``
    record."""
    report = ledger.report(final=final)
    entry = report["per_user"].get(str(user), {"epsilon": 0.0, "uses": 0, "sample_rate": 0.0})
    figures = {"user": int(user), **{k: entry[k] for k in ("epsilon", "uses", "sample_rate")}}
    if final and "earlier_uses" in entry:  # its own record: how many of the uses were earlier runs' (its account)
        figures["earlier_uses"] = entry["earlier_uses"]
    if final:  # its own record says which accountant and delta the epsilon is (the wire's report is the RDP bound)
        figures.update(epsilon_from=report["epsilon_from"], delta=ledger.dp.delta, max_epsilon=ledger.dp.max_epsilon)
    return figures


class ReportedPrivacy:
    """Data-owner cross-silo: each silo accounts for its own user and reports it; the server keeps
    the latest report of each user (checked for shape by the wire, never above the budget a silo
    refuses to pass) and reports them as :meth:`PrivacyLedger.report` does."""

    def __init__(self, dp: DPSGD) -> None:
        self.dp = dp
        self.reports: Dict[int, Dict[str, Any]] = {}

    def note(self, report: Mapping[str, Any]) -> None:
        user = int(report["user"])
        self.reports[user] = {k: report[k] for k in ("epsilon", "uses", "sample_rate")}

    def largest(self, final: bool = False) -> Tuple[float, Optional[int]]:
        """(the largest epsilon a silo reported, its user); ``final`` changes nothing: a silo sends
        its user's RDP bound with each evaluation (its own record has the accountant's figure)."""
        return largest_epsilon({user: float(r["epsilon"]) for user, r in self.reports.items()})

    def report(self, final: bool = False) -> Dict[str, Any]:
        return {
            **self.dp.settings(),
            # each silo's report with its evaluation: the RDP bound (its own record has the tight figure)
            "epsilon_from": accounting.ACCOUNTANTS[accounting.RDP],
            "epsilon": self.largest()[0],
            "per_user": {str(u): dict(self.reports[u]) for u in sorted(self.reports)},
            "reported_by": "silos (each accounts for its own user)",
        }

    def state_dict(self) -> Dict[str, Any]:
        return {"reports": {str(u): dict(r) for u, r in self.reports.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reports = {int(u): dict(r) for u, r in state["reports"].items()}
