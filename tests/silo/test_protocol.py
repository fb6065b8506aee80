"""A silo's protocol (fedml_perfedavg/silo/protocol.py) as lists of events: what the server sends,
what the silo's own work returns, and the actions the silo takes, with no process, port or model.
Every state and each invalid transition, as Flower's secaggplus_mod_test.py does for its client;
the rules it asks are tests/silo/test_rules.py's."""

from types import SimpleNamespace

import pytest
import torch

from fedml_perfedavg.silo.server.policy import SiloPolicy
from fedml_perfedavg.secagg.primitives import SecAggError
from fedml_perfedavg.silo import events as ev
from fedml_perfedavg.silo.outcome import SiloOutcome
from fedml_perfedavg.silo.protocol import SiloProtocol, SiloState

pytestmark = pytest.mark.fast

ROUNDS = 4
POLICY = SiloPolicy(connect_timeout=30.0, round_timeout=60.0, min_clients=1, round_timeout_factor=10.0)
ADVERT, SHARES_OUT, MASKED, SIGNED, UNMASKING = 106, 107, 108, 111, 109


def model(value: float = 1.0):
    return {"w": torch.full((3,), value)}


class Party:
    """A stand-in for a round's secure-aggregation party: answers each stage, or refuses one."""

    def __init__(self, round_idx, refuses=None):
        self.round_idx, self.refuses, self.asked = round_idx, refuses, []

    def opening(self):
        return ADVERT, {"advert": "signed"}

    def answer(self, kind, params):
        self.asked.append(kind)
        if kind == self.refuses:
            raise SecAggError("a ciphertext does not decrypt")
        return {103: SHARES_OUT, 104: MASKED, 110: SIGNED, 105: UNMASKING}[kind], {"from": kind}, None


def silo(own_user=None, secure=False, scheduled=None, evaluates=None, start_secure=None, outcome=None):
    """Silo rank 2 of a run of ROUNDS rounds at time 0 (shared mode unless ``own_user``)."""
    setup = SimpleNamespace(
        scheduled=scheduled,
        evaluates=evaluates,
        privacy=None,
        figures_after=None,
        secure=secure,
        secure_threshold=2 if secure else None,
        outcome=outcome,
    )
    parties = []

    def start(round_idx, terms, received, trained):
        parties.append(Party(round_idx))
        return parties[-1]

    def start_evaluation(round_idx, terms, evaluated, counts):
        parties.append(Party(round_idx))
        parties[-1].evaluation, parties[-1].figures = True, dict(counts)
        return parties[-1]

    protocol = SiloProtocol(
        2,
        ROUNDS,
        POLICY,
        setup,
        own_user=own_user,
        figures_with_updates=own_user is None,
        start_secure=start_secure or start,
        now=0.0,
        start_secure_evaluation=start_evaluation,
    )
    protocol.parties = parties
    return protocol


def play(protocol, events):
    """The actions each event calls for, one list per event."""
    return [protocol.handle(event) for event in events]


def kinds(actions):
    return [type(a).__name__ for a in actions]


def online(protocol, now=0.0):
    assert play(protocol, [ev.Ready(now)]) == [[ev.Announce(now + 30.0)]]
    assert protocol.handle(ev.Answered(now, ev.TAKEN)) == []
    return protocol


# -- a round, start to end ----------------------------------------------------------------------------


def test_a_shared_mode_silo_trains_each_model_it_is_sent_and_says_goodbye_after_the_final_one():
    protocol = online(silo())
    assert protocol.state is SiloState.ANNOUNCING
    sent = model()
    [retry, train] = protocol.handle(ev.ModelArrived(1.0, 0, 7, sent))
    assert (
        retry == ev.RetryFor(30.0)
        and train.model is sent
        and (train.round_idx, train.user, train.figures) == (0, 7, True)
    )
    assert protocol.state is SiloState.LISTENING
    counts = {"round": 0, "user": 7, "correct": 3, "total": 10}
    trained = model(2.0)
    [update] = protocol.handle(ev.Trained(2.0, 0, trained, 40, counts))
    assert update.weights is trained and (update.round_idx, update.samples, update.counts) == (0, 40, counts)
    assert protocol.outcome.trained_round == 0 and protocol.outcome.answer is None  # shared mode stores none
    [_, final] = protocol.handle(ev.ModelArrived(3.0, ROUNDS, 7, sent))
    assert isinstance(final, ev.Evaluate) and (final.round_idx, final.user, final.model, final.final) == (
        ROUNDS,
        7,
        sent,
        True,
    )
    goodbye = {"round": ROUNDS, "user": 7, "correct": 5, "total": 10}
    assert protocol.handle(ev.Evaluated(4.0, ROUNDS, goodbye)) == [ev.SendGoodbye(goodbye), ev.Finish()]
    assert protocol.state is SiloState.DONE


def test_a_data_owner_trains_only_its_own_user_only_when_scheduled_and_a_resumed_server_gets_the_stored_answer():
    protocol = online(silo(own_user=1, scheduled=lambda r: [2, 3] if r != 1 else [3, 4]))
    [retry, train] = protocol.handle(ev.ModelArrived(1.0, 0, 1, model()))
    assert (train.round_idx, train.user, train.figures) == (0, 1, False)
    [update] = protocol.handle(ev.Trained(2.0, 0, model(2.0), 40))
    assert isinstance(update, ev.SendUpdate) and update.counts is None
    # the server resumed and sends round 0 again on the same model: the stored answer, no training
    again = protocol.handle(ev.ModelArrived(3.0, 0, 1, model()))
    assert kinds(again) == ["RetryFor", "SendUpdate"] and again[1].samples == 40
    assert torch.equal(again[1].weights["w"], model(2.0)["w"])
    # round 1's schedule does not sample rank 2: declined, naming why, and nothing trained
    [_, decline] = protocol.handle(ev.ModelArrived(4.0, 1, 1, model(4.0)))
    assert isinstance(decline, ev.SendDecline) and decline.round_idx == 1
    assert decline.reason.startswith("silo rank 2: the keyed schedule") and "[3, 4]" in decline.reason
    # another user's data: the silo fails (it holds user 1's only)
    [_, fail] = protocol.handle(ev.ModelArrived(5.0, 2, 5, model()))
    assert isinstance(fail, ev.Fail) and "asked it to train user 5; it holds user 1's data only" in fail.reason
    # a final model in data-owner mode is refused
    [_, refused] = protocol.handle(ev.ModelArrived(6.0, ROUNDS, 1, model()))
    assert isinstance(refused, ev.SendDecline) and "there is no final model" in refused.reason


def test_a_data_owner_evaluates_the_scheduled_rounds_records_before_sending_and_refuses_the_rest():
    protocol = online(silo(own_user=1, evaluates=lambda r: r in (1, 3)))
    sent = model()
    [_, evaluate] = protocol.handle(ev.EvaluationAsked(1.0, 1, sent, "s"))
    assert isinstance(evaluate, ev.Evaluate) and (
        evaluate.round_idx,
        evaluate.user,
        evaluate.model,
        evaluate.final,
    ) == (1, 1, sent, False)
    counts = {"round": 1, "user": 1, "correct": 7, "total": 10}
    assert protocol.handle(ev.Evaluated(2.0, 1, counts)) == [ev.SendEvaluation(1, counts)]
    assert protocol.outcome.evaluations == [counts] and protocol.outcome.model_round == 1
    # again on the same model (a resumed server): the stored counts, nothing computed
    assert protocol.handle(ev.EvaluationAsked(3.0, 1, model())) == [ev.RetryFor(30.0), ev.SendEvaluation(1, counts)]
    [_, decline] = protocol.handle(ev.EvaluationAsked(4.0, 2, model()))
    assert isinstance(decline, ev.SendDecline) and "does not evaluate after round 2" in decline.reason
    [_, fail] = online(silo()).handle(ev.EvaluationAsked(1.0, 1, model()))
    assert isinstance(fail, ev.Fail) and "an evaluation request in shared mode" in fail.reason


# -- secure aggregation ----------------------------------------------------------------------------------


def secure_round(protocol, round_idx=0, now=1.0):
    protocol.handle(ev.ModelArrived(now, round_idx, 1, model(), terms={"threshold": 2}))
    return protocol.handle(ev.Trained(now + 1, round_idx, model(2.0), 40))


def test_a_secure_round_answers_each_stage_and_records_its_survivors_only_as_the_shares_leave():
    protocol = online(silo(own_user=1, secure=True))
    assert secure_round(protocol) == [ev.SendSecure(ADVERT, 0, {"advert": "signed"})]
    stages = [(ev.KEYS, 103, {}), (ev.SHARES, 104, {}), (ev.SURVIVORS, 110, {"survivors": [1, 2, 4]})]
    for stage, kind, params in stages:
        [answer] = protocol.handle(ev.SecureStage(3.0, stage, kind, 0, params))
        assert isinstance(answer, ev.SendSecure) and answer.params == {"from": kind}
        assert protocol.outcome.unmasked is None  # signed, not yet revealed
    [answer] = protocol.handle(ev.SecureStage(4.0, ev.UNMASK, 105, 0, {"survivors": [4, 2, 1]}))
    assert answer.kind == UNMASKING and protocol.outcome.unmasked == (0, (1, 2, 4))
    assert protocol.parties[0].asked == [103, 104, 110, 105]


def test_a_second_survivor_list_for_a_round_is_declined_and_ends_the_silos_part_in_it():
    outcome = SiloOutcome(1)
    outcome.unmasked_for(0, [1, 2, 4])  # a restarted silo: its record says it unmasked round 0 for these
    protocol = online(silo(own_user=1, secure=True, outcome=outcome))
    outcome.trained_round = None  # (the round is trained again here; the list is what is checked)
    secure_round(protocol)
    [decline] = protocol.handle(ev.SecureStage(3.0, ev.SURVIVORS, 110, 0, {"survivors": [1, 2]}))
    assert isinstance(decline, ev.SendDecline) and "already unmasked for the survivors [1, 2, 4]" in decline.reason
    assert protocol.secure is None and 110 not in protocol.parties[0].asked
    assert protocol.handle(ev.SecureStage(4.0, ev.UNMASK, 105, 0, {"survivors": [1, 2]})) == []  # no longer in it


def test_a_stage_the_party_refuses_or_of_another_round_or_a_round_that_cannot_start():
    protocol = online(silo(own_user=1, secure=True))
    secure_round(protocol)
    protocol.secure.refuses = 104
    assert protocol.handle(ev.SecureStage(3.0, ev.KEYS, 103, 5, {})) == []  # a round it is not in: ignored
    protocol.handle(ev.SecureStage(3.0, ev.KEYS, 103, 0, {}))
    [decline] = protocol.handle(ev.SecureStage(3.0, ev.SHARES, 104, 0, {}))
    assert decline == ev.SendDecline(0, "silo rank 2: a ciphertext does not decrypt") and protocol.secure is None

    def refuse(*args):
        raise SecAggError("the server's threshold 3 is not this run's (2)")

    refusing = online(silo(own_user=1, secure=True, start_secure=refuse))
    assert secure_round(refusing) == [ev.SendDecline(0, "silo rank 2: the server's threshold 3 is not this run's (2)")]
    assert refusing.outcome.trained_round == 0  # the training happened (and is counted) before the terms failed


def test_a_secure_evaluation_sends_its_figures_only_inside_the_sum_and_keeps_its_own_survivor_list():
    """Issue 75, rule 2: under secure aggregation a data owner's evaluation figures leave it only in
    the evaluation's secure sum (its counts stay in its own record), the survivor list it unmasks
    for is the evaluation's own (a round's list does not stand in for it, nor the other way), and a
    request without terms, which would have the counts sent alone, is declined."""
    outcome = SiloOutcome(1)
    outcome.unmasked_for(1, [1, 2], evaluation=False)  # round 1's own sum, over other silos
    protocol = online(silo(own_user=1, secure=True, evaluates=lambda r: True, outcome=outcome))
    sent = model()
    [_, evaluate] = protocol.handle(ev.EvaluationAsked(1.0, 1, sent, "s", {"threshold": 3}))
    assert isinstance(evaluate, ev.Evaluate) and evaluate.round_idx == 1
    counts = {"round": 1, "user": 1, "correct": 7, "correct_before": 5, "total": 10, "loss": 0.5}
    assert protocol.handle(ev.Evaluated(2.0, 1, counts)) == [ev.SendSecure(ADVERT, 1, {"advert": "signed"})]
    party = protocol.parties[-1]
    assert party.evaluation and party.figures == counts and protocol.outcome.evaluations == [counts]
    stages = [(ev.KEYS, 103, {}), (ev.SHARES, 104, {}), (ev.SURVIVORS, 110, {"survivors": [1, 2, 4]})]
    for stage, kind, params in stages:
        [answer] = protocol.handle(ev.SecureStage(3.0, stage, kind, 1, params))
        assert isinstance(answer, ev.SendSecure) and answer.round_idx == 1
    [answer] = protocol.handle(ev.SecureStage(4.0, ev.UNMASK, 105, 1, {"survivors": [4, 2, 1]}))
    assert answer.kind == UNMASKING
    assert protocol.outcome.unmasked_evaluation == (1, (1, 2, 4)) and protocol.outcome.unmasked == (1, (1, 2))
    # a resumed server asks again (the same model: the stored counts) and shows another list: declined
    protocol.handle(ev.EvaluationAsked(5.0, 1, sent, "s", {"threshold": 3}))
    [decline] = protocol.handle(ev.SecureStage(6.0, ev.SURVIVORS, 110, 1, {"survivors": [1, 2]}))
    assert isinstance(decline, ev.SendDecline)
    assert "the evaluation after round 1 was already unmasked for the survivors [1, 2, 4]" in decline.reason
    assert "figures by subtraction" in decline.reason
    [_, declined] = protocol.handle(ev.EvaluationAsked(7.0, 2, sent, "s"))  # no terms: the counts would go alone
    assert isinstance(declined, ev.SendDecline) and "sums evaluations securely" in declined.reason
    assert not [a for a in protocol.handle(ev.EvaluationAsked(8.0, 3, sent)) if isinstance(a, ev.SendEvaluation)]


# -- losing and finding the server ---------------------------------------------------------------------


def test_silence_past_the_idle_limit_rejoins_and_an_unanswered_announcement_ends_the_silo():
    protocol = online(silo())
    protocol.handle(ev.ModelArrived(1.0, 0, 7, model()))
    protocol.handle(ev.Trained(2.0, 0, model(), 40))
    limit = POLICY.client_idle_limit  # 150 s before any gap is measured; heard last at 1.0
    for now in range(3, int(limit) + 2):  # ticks a second apart (never frozen)
        assert protocol.handle(ev.Tick(float(now))) == [], now
    assert protocol.handle(ev.Tick(limit + 1.5)) == [ev.Announce(limit + 1.5 + 30.0)]
    assert protocol.state is SiloState.REJOINING
    [stop, fail] = protocol.handle(ev.Unanswered(limit + 32.0, ConnectionError("refused")))
    assert stop == ev.StopReceiving() and protocol.state is SiloState.DONE
    assert "nothing from the server for" in fail.reason and "did not take the silo's announcement either" in fail.reason
    assert fail.reason.endswith("is the server gone?")


def test_a_frozen_silo_an_undelivered_upload_and_a_left_out_status_each_rejoin_and_the_server_takes_it_back():
    protocol = online(silo())
    protocol.handle(ev.StatusCheck(1.0))
    assert protocol.state is SiloState.LISTENING
    assert protocol.handle(ev.Tick(7.0)) == [ev.Announce(37.0)]  # 6 s with no tick: frozen or suspended
    assert protocol.state is SiloState.REJOINING and protocol.handle(ev.Answered(7.5, ev.TAKEN)) == []
    protocol.handle(ev.StatusCheck(8.0))  # the server answers: back in the run
    assert protocol.state is SiloState.LISTENING
    assert protocol.handle(ev.NotDelivered(9.0, "its update for round 0", "refused")) == [ev.Announce(39.0)]
    protocol.handle(ev.Answered(9.5, ev.TAKEN))
    assert protocol.handle(ev.StatusCheck(10.0, left_out=True)) == [ev.Announce(40.0)]
    # taken back but never sent anything: gone after connect_timeout
    assert protocol.handle(ev.Answered(10.5, ev.TAKEN)) == [] and protocol.state is SiloState.REJOINING
    ticks = [protocol.handle(ev.Tick(10.0 + 0.5 * i)) for i in range(1, 62)]
    assert all(t == [] for t in ticks[:-1]) and kinds(ticks[-1]) == ["StopReceiving", "Fail"]
    assert "took the silo's announcement but sent nothing for 30.5 s" in ticks[-1][1].reason


def test_a_restarted_silo_answers_nothing_meant_for_its_earlier_process_until_it_is_taken_back():
    """Refused as a twin (its killed process still holds the seat), a silo started again may get the
    model the server sent that process; it must neither train on it (its user's data, its DP
    budget) nor take it as the server's answer, which stopped its announcements (5025f72)."""
    protocol = silo(own_user=1)
    protocol.handle(ev.Ready(0.0))
    assert protocol.handle(ev.Answered(0.1, ev.TWIN, "still seated")) == []
    assert protocol.handle(ev.ModelArrived(1.0, 0, 1, model())) == []
    assert protocol.handle(ev.StatusCheck(1.5)) == []
    assert protocol.state is SiloState.ANNOUNCING and protocol.last_heard == 0.1
    assert protocol.handle(ev.Tick(5.0)) == []
    assert protocol.handle(ev.Tick(5.1)) == [ev.Announce(35.1)]  # every 5 s
    assert protocol.handle(ev.Answered(5.2, ev.TAKEN)) == []
    assert kinds(protocol.handle(ev.ModelArrived(6.0, 0, 1, model()))) == ["RetryFor", "Train"]
    twin = silo()
    twin.handle(ev.Answered(0.1, ev.TWIN))
    assert twin.handle(ev.FinishArrived(1.0)) == [ev.Finish()]  # the run's end reaches it whoever it was for


def test_told_the_run_is_over_or_refused_at_its_announcement():
    """Issue 76: an organization that came back after the run finished exited 3 ("stopped early");
    told the run finished, it ends as the run did. Told the run ended early, it keeps the reason."""
    finished = silo(own_user=1)
    finished.handle(ev.Ready(0.0))
    assert finished.handle(ev.Answered(0.1, ev.RUN_FINISHED)) == [ev.Finish()]
    assert finished.state is SiloState.DONE and finished.outcome.ended_early is None
    early = silo(own_user=1)
    early.handle(ev.Ready(0.0))
    assert early.handle(ev.Answered(0.1, ev.RUN_OVER, "too few silos")) == [ev.Finish()]
    assert early.outcome.ended_early == "too few silos"
    for answer, words in ((ev.DISAGREEMENT, "train_args.alpha: 0.01 here, 0.02 there"), (ev.NOT_THIS_RUN, "")):
        refused = silo()
        refused.handle(ev.Ready(0.0))
        [fail] = refused.handle(ev.Answered(0.1, answer, words, "other-run (the run id)"))
        assert isinstance(fail, ev.Fail)
        assert words in fail.reason if words else "cannot take part as it was started" in fail.reason
    unreachable = silo()
    unreachable.handle(ev.Ready(0.0))
    error = ConnectionError("rank 0 at 127.0.0.1:1 is not reachable")
    assert unreachable.handle(ev.Unanswered(30.0, error)) == [ev.Fail(str(error), error)]


def test_the_servers_finish_ends_the_silo_and_a_refusal_is_its_failure():
    ended = online(silo(own_user=1))
    assert ended.handle(ev.FinishArrived(1.0, "the server stopped: too few silos")) == [ev.Finish()]
    assert ended.state is SiloState.DONE and ended.outcome.ended_early == "the server stopped: too few silos"
    refused = online(silo())
    assert refused.handle(ev.FinishArrived(1.0, "its data does not fit", refused=True)) == [
        ev.Finish(),
        ev.Fail("silo rank 2: its data does not fit"),
    ]


# -- invalid transitions -----------------------------------------------------------------------------------


def test_results_the_silo_did_not_ask_for_and_unknown_events_are_errors():
    protocol = online(silo(own_user=1))
    with pytest.raises(RuntimeError, match="did not ask for"):
        protocol.handle(ev.Trained(1.0, 0, model(), 40))
    protocol.handle(ev.ModelArrived(1.0, 0, 1, model()))
    with pytest.raises(RuntimeError, match="did not ask for"):
        protocol.handle(ev.Trained(2.0, 1, model(), 40))  # another round's
    with pytest.raises(RuntimeError, match="did not ask for"):
        protocol.handle(ev.Evaluated(2.0, 0, {}))  # it asked for a training
    with pytest.raises(ValueError, match="not an answer"):
        protocol.handle(ev.Answered(2.0, "maybe"))
    with pytest.raises(TypeError, match="not an event"):
        protocol.handle(object())
