"""DP-SGD's plan for a run, as the run layer sets it up: how a round and an evaluation use each
user's data (:func:`use_rules`), the budget checked against the run's keyed plan before the first
round (:func:`check_budget`), the server's ledger where it holds the users (:func:`central_ledger`),
and a data owner's account of its data across runs, with its noise key (:func:`own_account`). Which
process keeps which account is the data mode's (:mod:`.data_modes`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..algorithms.base import FederatedAlgorithm
from ..core.accounting import ACCOUNTANTS
from ..core.errors import ConfigError
from ..core.ledger import PrivacyLedger, UseRules, planned_epsilon, planned_ledger
from ..core.types import UserSplit
from .schedule import RoundSchedule
from .schema import Config
from .silo_account import KEY_BYTES, RunAccount, SiloAccount, accounts_root, noise_secret, run_key

logger = logging.getLogger(__name__)


def use_rules(config: Config, algorithm: FederatedAlgorithm) -> UseRules:
    """How DP-SGD uses each user's data in a round and an evaluation (the standard maths' step)."""
    assert algorithm.standard_update is not None  # DP-SGD runs only the standard maths
    step = algorithm.standard_update.step
    return UseRules.of(
        step, config.batch_sizes, config.train.local_steps, config.train.batch_size, config.validation.adapt_steps
    )


def central_ledger(config: Config, algorithm: FederatedAlgorithm, users: List[UserSplit]) -> PrivacyLedger:
    """The accountant of every user's DP-SGD uses, kept by the process that holds the users (the
    simulation's, a shared-mode server), after checking that the run's keyed plan stays within
    ``dp_args.max_epsilon``: every round's clients and every evaluation are known before the first
    round."""
    dp = config.privacy
    assert dp is not None
    rules = use_rules(config, algorithm)
    ledger = PrivacyLedger(dp, rules, {user: len(u.train_y) for user, u in enumerate(users)})
    check_budget(config, algorithm, ledger, range(len(users)), range(len(users)))
    return ledger


def own_ledger(
    config: Config,
    algorithm: FederatedAlgorithm,
    user: int,
    data: UserSplit,
    earlier: Optional[Dict[float, int]] = None,
) -> Tuple[PrivacyLedger, Optional[str]]:
    """A data owner's silo's accountant of its own ``user`` (counting ``earlier`` runs' uses of its
    data), and why the silo cannot take part (its user would pass ``dp_args.max_epsilon``: the silo
    announces it, and the server goes on without it by the rule for any silo it refuses), or None."""
    dp = config.privacy
    assert dp is not None
    rules = use_rules(config, algorithm)
    ledger = PrivacyLedger(dp, rules, {user: len(data.train_y)}, {user: earlier} if earlier else None)
    try:
        check_budget(config, algorithm, ledger, [user], [user])
    except ConfigError as err:
        return ledger, f"user {user} cannot take part: {err}"
    return ledger, None


def check_budget(
    config: Config, algorithm: FederatedAlgorithm, ledger: PrivacyLedger, users: Sequence[int], evaluated: Sequence[int]
) -> None:
    """:class:`ConfigError` where the run's keyed plan takes ``users``' epsilon past
    ``dp_args.max_epsilon``, naming the epsilon and the round; logs the plan's epsilon otherwise."""
    dp = ledger.dp
    if dp.max_epsilon is not None:
        budget = dp.max_epsilon
        schedule = RoundSchedule.from_config(config)
        mine = set(users)

        def sample(round_idx: int) -> List[int]:
            return [c for c in algorithm.sample_clients(round_idx) if c in mine]

        def past(rounds: int) -> Optional[Tuple[float, int]]:  # (epsilon, user) past the budget, or None
            plan = planned_ledger(ledger, range(rounds), sample, schedule.evaluates, evaluated)
            return plan.first_past(budget)

        over = past(config.train.comm_round)
        earlier = sum(sum(e.values()) for e in ledger.earlier.values())
        since = f" (counting {earlier} uses of its data by earlier runs: its account)" if earlier else ""
        if over is not None:
            epsilon, user = over
            low, high = 0, config.train.comm_round  # the first number of rounds that passes the budget
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (middle, high) if past(middle) is None else (low, middle)
            fewer_uses = (
                "a larger dp_args.noise_multiplier, or fewer uses (train_args.local_steps, client_num_per_round, "
                "validation_args.frequency_of_the_test)"
            )
            if low == 0:  # not even one round fits: fewer rounds cannot help
                first, first_user = planned_epsilon(ledger, range(1), sample, schedule.evaluates, evaluated)
                raise ConfigError(
                    f"dp_args.max_epsilon={dp.max_epsilon!r}: no round fits in the budget; round 0 alone reaches "
                    f"epsilon {first:.4g} (user {first_user}) at delta {dp.delta:g}{since}. Allowed: a max_epsilon of "
                    f"at least {first:.4g}, or {fewer_uses}"
                )
            raise ConfigError(
                f"dp_args.max_epsilon={dp.max_epsilon!r}: this run would reach epsilon {epsilon:.4g} (user {user}) "
                f"at delta {dp.delta:g}{since} after train_args.comm_round={config.train.comm_round} rounds; "
                f"the budget is "
                f"passed in round {high - 1}. Allowed: comm_round <= {low}, or {fewer_uses}"
            )
        planned, planned_user = planned_epsilon(
            ledger, range(config.train.comm_round), sample, schedule.evaluates, evaluated
        )
        logger.info(
            "DP-SGD: the run's plan reaches epsilon %.4g (user %s; %s) at delta %g, within dp_args.max_epsilon=%g",
            planned,
            planned_user,
            ACCOUNTANTS[dp.accountant],
            dp.delta,
            dp.max_epsilon,
        )


def this_runs_secret(run_dir: str, rank: int, identity: Dict[str, Any]) -> bytes:
    """A data owner's silo's secret for this run (``identity``): the one its ``progress.pt`` keeps
    (a process of the same run started again draws the same numbers), else new. A new run id, run
    folder or agreed config is another identity, so another secret."""
    from .silo_record import SiloProgress

    return SiloProgress.run_secret_in(run_dir, rank, identity) or os.urandom(KEY_BYTES)


def key_training_draws(algorithm: FederatedAlgorithm, user: int, secret: bytes) -> None:
    """Key ``user``'s minibatch draws by this run's ``secret`` beside (seed, round, user): the
    server, which knows the seed, cannot predict them, and two runs of the same data never send
    identical inputs, so one run's sum taken from another's is noise, not an update."""
    import dataclasses

    settings = algorithm.settings
    algorithm.settings = dataclasses.replace(settings, draw_secrets={**settings.draw_secrets, int(user): secret})


def own_account(
    config: Config,
    algorithm: FederatedAlgorithm,
    run_dir: str,
    rank: int,
    data: UserSplit,
    identity: Dict[str, Any],
) -> Tuple[PrivacyLedger, Optional[str], RunAccount]:
    """A data owner's silo's DP-SGD set-up from its organization's account of its data
    (:mod:`.silo_account`): its ledger counting every earlier run's uses, why it cannot take part
    (the budget) or None, and this run's entry in the account. Its noise and minibatches are keyed,
    beside (seed, round, user), by the data's noise key and this run's secret: the server, which
    knows the seed, cannot draw them, and no two runs share them. The secret is the one this run's
    ``progress.pt`` keeps (a process of the same run started again draws the same numbers), else new."""
    import dataclasses

    dp = config.privacy
    assert dp is not None
    account = SiloAccount.open(accounts_root(config.comm.account_dir), data)
    secret = this_runs_secret(run_dir, rank, identity)
    run = RunAccount(account, run_key(identity, secret), dict(identity), secret, rank - 1)
    earlier = account.earlier_uses(run.key, dp.noise_multiplier)
    keyed = dataclasses.replace(dp, secret=noise_secret(account.noise_key(), secret))
    algorithm.settings = dataclasses.replace(algorithm.settings, privacy=keyed)  # the evaluation's too
    key_training_draws(algorithm, rank - 1, secret)
    logger.info(
        "silo rank %d: its data's DP-SGD account is %s (%d earlier use(s) of the data by %d other run(s))",
        rank,
        account.folder,
        sum(earlier.values()),
        account.runs() - (1 if account.holds(run.key) else 0),
    )
    ledger, problem = own_ledger(config, algorithm, rank - 1, data, earlier)
    return ledger, problem, run
