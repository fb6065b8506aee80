"""A data owner's silo's own rules (fedml_perfedavg/silo/rules.py) as lists of events: what the
server asks, in order, and what the silo decides. Each list replays a lie a dishonest server told in
real processes (issue 75, "Privacy, second pass"; issue 76's unmask bookkeeping) and the honest run
beside it. The silo records what it did (``outcome``, its ledger) as the FedML-facing silo does."""

import pytest
import torch

from fedml_perfedavg.core.client_maths import Step
from fedml_perfedavg.core.ledger import PrivacyLedger, UseRules
from fedml_perfedavg.core.privacy import DPSGD
from fedml_perfedavg.silo.outcome import SiloOutcome, StoredAnswer, state_digest
from fedml_perfedavg.silo.rules import EVALUATE, REFUSE, STORED, TRAIN, DataOwnerRules
from fedml_perfedavg.run.schedule import RoundSchedule

pytestmark = pytest.mark.fast

ROUNDS = 10


def model(value: float = 1.0):
    return {"w": torch.full((3,), value)}


def every_second_round(round_idx: int) -> bool:
    return RoundSchedule(ROUNDS, 2, 0, 0).evaluates(round_idx)


def silo(ledger=None, scheduled=lambda r: [1, 2, 3], evaluates=every_second_round):
    """Silo rank 2 holding user 1, in a run of ROUNDS rounds evaluated every second round."""
    return DataOwnerRules(2, 1, SiloOutcome(1), ROUNDS, scheduled, evaluates, ledger)


def play(rules, events):
    """Each event (("train" | "evaluate", round, model)) decided, and done where the silo would:
    trained and evaluated rounds go into its record (and its ledger), as client.py does."""
    actions = []
    for kind, round_idx, received in events:
        decision = rules.training(round_idx, received) if kind == "train" else rules.evaluation(round_idx, received)
        actions.append(decision.action)
        if decision.action == TRAIN:
            if rules.ledger is not None:
                rules.ledger.trained(round_idx, [rules.user])
            answer = StoredAnswer(round_idx, state_digest(received), {"w": received["w"] + 1}, 30)
            rules.outcome.trained(round_idx, answer)
        elif decision.action == EVALUATE:
            if rules.ledger is not None:
                rules.ledger.evaluated(round_idx, [rules.user])
            rules.outcome.evaluated({"round": round_idx, "user": rules.user, "correct": 7, "total": 10}, received)
    return actions


def ledger(max_epsilon=None, noise=1.0, earlier=None):
    dp = DPSGD(noise_multiplier=noise, max_grad_norm=1.0, delta=1e-5, max_epsilon=max_epsilon)
    rules = UseRules.of(Step.HF, (8, 8, 4), local_steps=3, eval_batch=8, adapt_steps=1)
    return PrivacyLedger(dp, rules, {1: 40}, earlier)


# -- training ----------------------------------------------------------------------------------------


def test_a_round_is_trained_once_in_order_and_a_resumed_server_gets_the_stored_answer():
    rules = silo()
    actions = play(
        rules,
        [
            ("train", 0, model()),
            ("train", 0, model()),  # a resumed server, the same model: the stored answer
            ("train", 0, model(1.0 + 1e-7)),  # the same round on another model
            ("train", 4, model()),
            ("train", 3, model()),  # backwards
        ],
    )
    assert actions == [TRAIN, STORED, REFUSE, TRAIN, REFUSE]
    assert "it has trained round 4; rounds go forwards" in rules.training(3, model()).reason
    assert "trained round 4 already, on another model" in rules.training(4, model(2.0)).reason


def test_a_round_the_schedule_does_not_sample_this_silo_in_is_refused():
    decision = silo(scheduled=lambda r: [1, 3, 4]).training(5, model())
    assert (
        decision.refused
        and "does not sample this silo in round 5; it samples silo rank(s) [1, 3, 4]" in decision.reason
    )


def test_training_past_the_silos_own_budget_is_refused():
    rules = silo(ledger(max_epsilon=7.0))  # 4.33 after one round, 6.70 after three, 7.62 after four
    actions = play(rules, [("train", r, model()) for r in range(ROUNDS)])
    first_refused = actions.index(REFUSE)
    assert actions == [TRAIN] * first_refused + [REFUSE] * (ROUNDS - first_refused) and 0 < first_refused < ROUNDS
    assert first_refused == 3 and rules.ledger.epsilon(1) <= 7.0  # the refused rounds used nothing
    assert "past this silo's dp_args.max_epsilon=7" in rules.training(first_refused, model()).reason


def test_an_earlier_run_of_the_same_data_counts_against_the_budget():
    """Issue 75, rule 4: a second run (another --run_id, --overwrite) restarted the account at 0
    uses. Its data's account now hands the silo the earlier runs' uses: two rounds of an earlier
    run leave one round of this run's budget where a fresh account left three."""
    first = silo(ledger())
    play(first, [("train", 0, model()), ("train", 1, model())])
    earlier = {1: first.ledger.this_run(1)}
    rules = silo(ledger(max_epsilon=7.0, earlier=earlier))
    actions = play(rules, [("train", r, model()) for r in range(ROUNDS)])
    assert actions == [TRAIN] + [REFUSE] * (ROUNDS - 1)
    assert rules.ledger.this_run(1) == {0.2: 6, 0.1: 3} and rules.ledger.epsilon(1) <= 7.0  # (8, 8, 4) of 40
    assert rules.ledger.report()["per_user"]["1"]["earlier_uses"] == 18


# -- evaluation is a use like training (issue 75, rule 1) -------------------------------------------


def test_four_hundred_evaluation_requests_with_fresh_round_indices_get_only_the_scheduled_ones():
    """The lie: 400 EVALUATE requests, each with a fresh round index; every silo answered all (its
    record ended at epsilon 11.70 over 401 uses, max_epsilon 5). Now only the rounds the run's
    schedule evaluates are answered, each once: 5 of the 10 rounds, and nothing past the run."""
    rules = silo(ledger())
    events = [("evaluate", r, model(r)) for r in range(400)]
    actions = play(rules, events)
    assert [r for r, a in enumerate(actions) if a == EVALUATE] == [0, 2, 4, 6, 8, 9]
    assert actions.count(REFUSE) == 394
    assert rules.ledger.counted["evaluation"] == [0, 1, 2, 1, 4, 1, 6, 1, 8, 1, 9, 1]
    assert "does not evaluate after round 3" in rules.evaluation(3, model()).reason
    assert "this run has rounds 0..9" in rules.evaluation(10, model()).reason


def test_the_same_rounds_evaluation_on_a_moved_model_is_refused_and_on_the_same_model_gets_the_stored_counts():
    """The lie: the same round's EVALUATE twice, the model moved by 1e-6: the same DP noise on two
    models (losses equal to 4.3e-6). Now the second is refused; a resumed server asking again with
    the same model gets the counts already sent, with no new personalization."""
    rules = silo(ledger())
    actions = play(rules, [("evaluate", 4, model()), ("evaluate", 4, model(1.0 + 1e-6)), ("evaluate", 4, model())])
    assert actions == [EVALUATE, REFUSE, STORED]
    assert rules.evaluation(4, model()).stored == rules.outcome.evaluations[-1]
    assert "never used on two models" in rules.evaluation(4, model(2.0)).reason
    assert rules.ledger.counted["evaluation"] == [4, 1]
    assert play(rules, [("evaluate", 2, model())]) == [REFUSE]  # backwards


def test_an_evaluation_that_would_pass_the_budget_is_refused_before_any_use():
    rules = silo(ledger(max_epsilon=6.0, noise=0.7))  # 4.55 after one evaluation, 5.60 after two, 6.36 after three
    actions = play(rules, [("evaluate", r, model(r)) for r in (0, 2, 4, 6, 8, 9)])
    assert REFUSE in actions and actions[0] == EVALUATE
    assert actions == [EVALUATE, EVALUATE] + [REFUSE] * 4 and rules.ledger.epsilon(1) <= 6.0
    refused_at = [0, 2, 4, 6, 8, 9][actions.index(REFUSE)]
    reason = rules.evaluation(refused_at, model(refused_at)).reason
    assert "the evaluation's personalization would take user 1's epsilon" in reason and "max_epsilon=6" in reason


def test_a_final_model_in_the_middle_of_a_data_owner_run_is_refused():
    """The lie: a model stamped round = comm_round mid-run; the silo ran its final DP personalization,
    sent figures with no account, wrote "finished" and left. Data-owner mode has no final model."""
    rules = silo(ledger())
    play(rules, [("train", 0, model()), ("evaluate", 0, model(2.0))])
    decision = rules.final_model(ROUNDS)
    assert decision.refused and "there is no final model" in decision.reason
    assert rules.ledger.counted["evaluation"] == [0, 1]


# -- one survivor list per round, recorded only when shares leave (issue 76, item 1) ---------------


def test_a_declined_unmasking_is_not_recorded_so_a_resumed_server_can_run_the_round_again():
    """Organization 2 lost: survivors [1, 4] are fewer than min_summed_silos, the silos decline. After
    the server's resume the round comes again with another list, and the silos unmask for it."""
    outcome = SiloOutcome(1)
    rules = DataOwnerRules(4, 3, outcome, ROUNDS)
    assert not rules.unmasking(10, [1, 4]).refused  # checked; the silo then declined: nothing kept
    assert outcome.unmasked is None
    assert not rules.unmasking(10, [1, 3, 4]).refused  # the resumed server's round
    outcome.unmasked_for(10, [1, 3, 4])  # the shares leave
    decision = rules.unmasking(10, [1, 4])
    assert decision.refused and "already unmasked for the survivors [1, 3, 4]" in decision.reason
    assert not rules.unmasking(11, [1, 4]).refused  # another round: another list


def test_a_short_secure_round_is_declined_naming_the_organizations_it_is_without():
    """Issue 76: the healthy organizations were told "the round has 2 silo(s)", not which one was
    missing; a silo's decline now names the ranks the keyed schedule samples and the server left out."""
    from types import SimpleNamespace

    from fedml_perfedavg.silo.secure import SecureSiloRound
    from fedml_perfedavg.secagg.primitives import SecAggError
    from fedml_perfedavg.secagg.rounds import SiloRules

    setup = SimpleNamespace(
        secure_rules=SiloRules(threshold=2, max_colluding=0, min_summed=3), scheduled=lambda r: [1, 3, 4]
    )
    terms = {"threshold": 2, "silos": [1, 4], "weight": 0.5, "counts": None}
    with pytest.raises(SecAggError) as refused:
        SecureSiloRound.start(4, 10, terms, setup, model(), model(), None, None)
    assert "the round has 2 silo(s)" in str(refused.value)
    assert "the keyed schedule samples silo rank(s) [1, 3, 4], and rank(s) [3] are not in it" in str(refused.value)


# -- a lost organization's place (issue 76, item 2) ---------------------------------------------------


def test_a_silo_past_the_sample_trains_only_in_a_lost_ones_place_within_the_reserves():
    """The keyed order of the round is [3, 1, 4, 2, 5] (ranks), three a round: the sample is [1, 3, 4].
    With one reserve, rank 2 trains in a secure round that lists it in a lost silo's place; rank 5,
    further in the order, never; and no silo past the sample trains in a round that names none."""
    order = lambda r: [3, 1, 4, 2, 5]  # noqa: E731

    def reserve(rank, reserves=1):
        return DataOwnerRules(
            rank, rank - 1, SiloOutcome(rank - 1), ROUNDS, lambda r: [1, 3, 4], None, None, order, reserves
        )

    assert reserve(2).training(0, model(), [1, 2, 3]).action == TRAIN  # rank 4 lost: rank 2 takes its place
    refused = reserve(2).training(0, model(), None)
    assert refused.refused and "no secure round lists it in a lost silo's place (secagg_args.reserve_silos=1)" in (
        refused.reason
    )
    too_far = reserve(5).training(0, model(), [1, 3, 5])
    assert too_far.refused and "keyed order's first 3 + secagg_args.reserve_silos=1" in too_far.reason
    assert reserve(5, reserves=2).training(0, model(), [1, 3, 5]).action == TRAIN
    assert reserve(2).training(0, model(), [1, 2, 3, 4]).refused  # four in a round of three
    assert reserve(2, reserves=0).training(0, model(), [1, 2, 3]).refused  # no reserves: the sample only


def test_a_secure_round_with_a_lost_silos_place_taken_within_the_reserves_passes_the_silos_schedule_check():
    """The keyed order [3, 1, 4, 2] (ranks), three a round: silo 2 (the reserve) in rank 4's place
    passes the schedule check and reaches the next one (here: no trainer); [1, 3, 5] does not."""
    from types import SimpleNamespace

    from fedml_perfedavg.silo.secure import SecureSiloRound
    from fedml_perfedavg.secagg.primitives import SecAggError
    from fedml_perfedavg.secagg.rounds import SiloRules

    def setup(reserves):
        rules = SiloRules(threshold=2, max_colluding=0, min_summed=3)
        order = lambda r: [3, 1, 4, 2, 5]  # noqa: E731
        return SimpleNamespace(
            secure_rules=rules,
            scheduled=lambda r: [1, 3, 4],
            keyed_order=order,
            reserve_silos=reserves,
            sample_weighted=False,
            user_counts={},
        )

    terms = {"threshold": 2, "silos": [1, 2, 3], "weight": 1 / 3, "counts": None}
    with pytest.raises(SecAggError, match="needs the plugin's ClientTrainer"):  # past the schedule's check
        SecureSiloRound.start(2, 0, terms, setup(1), model(), model(), None, None)
    with pytest.raises(SecAggError, match=r"are not of the keyed schedule, which samples \[1, 3, 4\]"):
        SecureSiloRound.start(2, 0, terms, setup(0), model(), model(), None, None)
    with pytest.raises(SecAggError, match=r"up to secagg_args.reserve_silos=1 of \[3, 1, 4, 2\]"):
        SecureSiloRound.start(1, 0, {**terms, "silos": [1, 3, 5]}, setup(1), model(), model(), None, None)
