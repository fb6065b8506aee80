"""The cross-silo server's protocol with no process, port or clock: events in, actions out."""

import sys

import pytest
import torch
from torch import nn

from fedml_perfedavg.silo.server.modes import OwnDataRounds, SharedDataRounds
from fedml_perfedavg.core.errors import ConfigError, SiloFailure
from fedml_perfedavg.net import wire
from fedml_perfedavg.silo.server.agreement import ServerSetup
from fedml_perfedavg.silo.server.events import (
    EVALUATION,
    FINAL,
    NOTICE,
    ROUND,
    EndRun,
    Evaluation,
    Fail,
    Finish,
    Goodbye,
    Hello,
    Listening,
    Record,
    Refuse,
    Send,
    SiloDeclined,
    SiloFailed,
    Stopped,
    Tick,
    Undelivered,
    Update,
)
from fedml_perfedavg.silo.server.phases import Phase
from fedml_perfedavg.silo.server.policy import SiloPolicy
from fedml_perfedavg.silo.server.protocol import SiloServerProtocol

FINGERPRINT = {"train_args.learning_rate": 0.001}
TRAIN, TEST = {1: 30, 2: 50, 3: 70}, {1: 10, 2: 20, 3: 30}


class Plan:
    """Every round samples ``users``; every round is evaluated."""

    def __init__(self, users):
        self.users = users

    def sample_clients(self, round_idx):
        return list(self.users)

    def evaluates(self, round_idx):
        return True


class Model:
    """A global model of one tensor; the average of the updates, as the aggregator would."""

    def __init__(self):
        self.state = {"w": torch.zeros(2)}
        self.aggregated = []

    def params(self):
        return dict(self.state)

    def aggregate(self, round_idx, updates, senders=None):
        self.aggregated.append((round_idx, sorted(updates)))
        self.state = {"w": sum(m["w"] for _, m in updates.values()) / len(updates)} if updates else self.state
        return self.state


def hello(rank, own=True, **change):
    announced = {
        "fingerprint": dict(FINGERPRINT),
        "user": rank - 1 if own else None,
        "train": TRAIN[rank] if own else None,
        "test": TEST[rank] if own else None,
        "input_shape": [4] if own else None,
        "input_dtype": "float32" if own else None,
        "classes": [0, 1, 2] if own else None,
        "problem": None,
    }
    announced.update(change)
    return announced


def counts(rank, round_idx, correct=5):
    return {
        "round": round_idx,
        "user": rank - 1,
        "correct": correct,
        "correct_before": 3,
        "total": TEST[rank],
        "loss": 0.5,
    }


def protocol(silos=(1, 2), own=True, rounds=2, min_clients=1, users=None, timeout=30.0, metric_names=()):
    setup = ServerSetup(
        mode=OwnDataRounds() if own else SharedDataRounds(),
        silos=list(silos),
        fingerprint=dict(FINGERPRINT),
        user_counts={r - 1: (TRAIN[r], TEST[r]) for r in silos},
        model=nn.Sequential(nn.Linear(4, 3)),
        metric_names=metric_names,
    )
    policy = SiloPolicy(connect_timeout=60.0, round_timeout=timeout, min_clients=min_clients)
    users = [r - 1 for r in silos] if users is None else users
    model = Model()
    return SiloServerProtocol(setup, policy, Plan(users), model, rounds, len(silos)), model


def sends(actions, purpose=None):
    return [m for a in actions if isinstance(a, Send) and (purpose is None or a.purpose == purpose) for m in a.messages]


def records(actions, method):
    return [a.args for a in actions if isinstance(a, Record) and a.method == method]


def online(p, silos=(1, 2), own=True, now=1.0):
    assert p.handle(Listening(0.0)) == []
    actions = []
    for rank in silos:
        actions += p.handle(Hello(now, rank, hello(rank, own), f"s{rank}"))
    return actions


def update(rank, round_idx, value, now=2.0, declared=None, training=None):
    model = {"w": torch.full((2,), value)}
    return Update(now, rank, round_idx, TRAIN[rank] if declared is None else declared, model, training=training)


def test_a_data_owner_run_from_announcements_to_the_end_with_no_process():
    p, model = protocol()
    actions = online(p)
    models = sends(actions, ROUND)
    assert [(m.kind, m.silo, m.user, m.round) for m in models] == [
        (wire.INIT_CONFIG, 1, 0, 0),
        (wire.INIT_CONFIG, 2, 1, 0),
    ]
    assert p.phase is Phase.TRAINING
    assert p.handle(update(1, 0, 1.0)) == []  # silo 2's update is still awaited
    actions = p.handle(update(2, 0, 3.0))
    (finished,) = records(actions, "round_finished")
    assert finished[0] == 0 and torch.equal(finished[1]["w"], torch.full((2,), 2.0))
    evaluate = sends(actions, EVALUATION)
    assert [(m.kind, m.silo, m.user, m.round) for m in evaluate] == [(wire.EVALUATE, 1, 0, 0), (wire.EVALUATE, 2, 1, 0)]
    assert p.handle(Evaluation(3.0, 1, counts(1, 0))) == []
    actions = p.handle(Evaluation(3.0, 2, counts(2, 0)))
    ((round_idx, by_user, missing, started),) = records(actions, "record_federated_evaluation")
    assert (round_idx, sorted(by_user), missing, started) == (0, [0, 1], [], 2.0)
    assert [(m.kind, m.round) for m in sends(actions, ROUND)] == [(wire.SYNC_MODEL, 1), (wire.SYNC_MODEL, 1)]
    p.handle(update(1, 1, 0.0, now=4.0))
    p.handle(update(2, 1, 0.0, now=4.0))
    p.handle(Evaluation(5.0, 1, counts(1, 1)))
    actions = p.handle(Evaluation(5.0, 2, counts(2, 1)))
    end = [a for a in actions if isinstance(a, EndRun)]
    assert len(end) == 1 and end[0].reason is None and end[0].live == (1, 2)
    assert isinstance(actions[-1], Finish) and p.phase is Phase.DONE
    assert model.aggregated == [(0, [0, 1]), (1, [0, 1])]
    assert p.handle(Tick(1000.0)) == []  # nothing is left to time out


def test_the_log_says_which_round_starts_after_a_resume_and_how_each_round_closed(caplog):
    """Issue 76: a resumed server said "round 0 starts" right after "resuming at round 6", and
    nothing between evaluations; now the start names its round, and each round's close its silos,
    its time and how their updates were combined."""
    import logging

    setup = ServerSetup(
        mode=OwnDataRounds(),
        silos=[1, 2],
        fingerprint=dict(FINGERPRINT),
        model=nn.Sequential(nn.Linear(4, 3)),
        privacy="DP-SGD: noise multiplier 1, clip 1 (fixed), epsilon by prv at delta 1e-05",
    )
    policy = SiloPolicy(connect_timeout=60.0, round_timeout=30.0, min_clients=1)
    p = SiloServerProtocol(setup, policy, Plan([0, 1]), Model(), 8, 2, start_round=6)
    with caplog.at_level(logging.INFO, logger="fedml_perfedavg.silo.server"):
        online(p)
        p.handle(update(1, 6, 1.0, now=2.0))
        p.handle(update(2, 6, 3.0, now=3.5))
    assert "silos [1, 2] online; round 6 starts (DP-SGD: noise multiplier 1" in caplog.text
    assert "round 0 starts" not in caplog.text
    assert (
        "round 6 closed after 2.50 s: the updates of silo rank(s) [1, 2] averaged in the clear (of [1, 2] sampled); "
        "each update under DP-SGD" in caplog.text
    )


def test_a_silo_that_misses_the_round_deadline_is_given_up_on_and_the_round_goes_on():
    p, model = protocol(timeout=30.0)
    online(p)
    p.handle(update(1, 0, 1.0, now=5.0))
    assert p.handle(Tick(30.9)) == []  # not yet: the round opened at 1.0
    actions = p.handle(Tick(31.0))
    ((round_idx, lost, why),) = records(actions, "record_lost_silos")
    assert (round_idx, lost) == (0, [2]) and "sent no update within 30.0 s" in why
    assert "acted on 30.0 s after the phase opened" in why  # the deadline applied, as the record keeps it
    late = protocol(timeout=30.0)[0]  # a server that could act only later says so
    online(late)
    assert "acted on 44.0 s after" in records(late.handle(Tick(45.0)), "record_lost_silos")[0][2]
    assert model.aggregated == [(0, [0])]
    assert [m.silo for m in sends(actions, EVALUATION)] == [1]  # the silo given up on is not asked


def test_too_few_silos_left_ends_the_run_telling_every_silo_why():
    p, _ = protocol(min_clients=2)
    online(p)
    p.handle(update(1, 0, 1.0))
    actions = p.handle(Tick(100.0))
    assert isinstance(actions[-1], Fail) and isinstance(actions[-1].error, SiloFailure)
    assert "min_clients_per_round=2" in str(actions[-1].error)
    (end,) = [a for a in actions if isinstance(a, EndRun)]
    assert end.live == (1, 2) and "the server stopped the run" in end.reason and end.stop_listening
    assert p.phase is Phase.DONE
    assert p.handle(Stopped(101.0, "interrupted")) == []  # told once


def test_a_silo_the_models_cannot_reach_is_given_up_on_at_once():
    p, _ = protocol()
    online(p)
    actions = p.handle(Undelivered(1.5, ROUND, {2: "rank 2 at 127.0.0.1:1 did not take a message"}))
    assert records(actions, "record_lost_silos")[0][1] == [2]
    assert records(actions, "round_finished") == []  # silo 1 still owes its update
    assert records(p.handle(update(1, 0, 1.0)), "round_finished")[0][0] == 0


def test_a_silo_that_declines_its_round_is_given_up_on_at_once_told_and_named():
    p, model = protocol(timeout=30.0)
    online(p)
    actions = p.handle(SiloDeclined(2.0, 2, "silo rank 2: the model is not round 0's"))
    ((round_idx, lost, why),) = records(actions, "record_lost_silos")
    assert (round_idx, lost) == (0, [2]) and why == "declined round 0: silo rank 2: the model is not round 0's"
    (told,) = sends(actions, NOTICE)  # told it was left out: it announces itself again for a later round
    assert told.silo == 2 and told.kind == wire.CHECK_STATUS and told.left_out
    assert records(actions, "round_finished") == []  # silo 1 still owes its update, not the deadline
    assert records(p.handle(update(1, 0, 1.0, now=3.0)), "round_finished")[0][0] == 0
    assert model.aggregated == [(0, [0])]
    # a decline of a round it is no longer awaited in, or outside a round, changes nothing
    assert records(p.handle(SiloDeclined(3.5, 2, "again")), "record_lost_silos") == []


def test_a_silo_that_declines_an_evaluation_is_missing_from_it_at_once_and_stays_in_the_run():
    """A data owner's own rules may refuse an evaluation (not of the schedule, done already, its
    budget spent: silo/rules.py); the evaluation closes without its user now, not at the deadline."""
    p, model = protocol(timeout=30.0)
    online(p)
    p.handle(update(1, 0, 1.0))
    p.handle(update(2, 0, 3.0))
    assert p.phase is Phase.EVALUATING
    assert p.handle(Evaluation(3.0, 1, counts(1, 0))) == []
    actions = p.handle(SiloDeclined(3.5, 2, "silo rank 2: the evaluation would pass its max_epsilon"))
    ((round_idx, by_user, missing, _),) = records(actions, "record_federated_evaluation")
    assert (round_idx, sorted(by_user), missing) == (0, [0], [1])
    assert records(actions, "record_lost_silos") == []  # it stays: round 1 goes to both silos
    assert [(m.silo, m.round) for m in sends(actions, ROUND)] == [(1, 1), (2, 1)]


def test_a_declining_silo_the_round_cannot_do_without_ends_the_run_with_its_reason():
    p, _ = protocol(min_clients=2)
    online(p)
    actions = p.handle(SiloDeclined(2.0, 1, "silo rank 1: its DP budget is spent"))
    assert isinstance(actions[-1], Fail) and "declined round 0: silo rank 1: its DP budget is spent" in str(
        actions[-1].error
    )
    assert p.phase is Phase.DONE


def test_a_false_sample_count_is_refused_and_its_update_rejected():
    p, model = protocol()
    online(p)
    actions = p.handle(update(1, 0, 1.0, declared=2**31 - 1))
    (refused,) = [a for a in actions if isinstance(a, Refuse)]
    assert refused.silo == 1 and refused.kind == "sample-count" and "30 training samples" in refused.text
    assert records(actions, "record_rejected_update") == [(0,)]
    p.handle(update(2, 0, 3.0))
    assert model.aggregated == [(0, [1])]  # only silo 2's update is averaged


def test_an_accepted_updates_training_figures_go_to_the_record_before_its_round_closes():
    p, model = protocol()
    online(p)
    refused = p.handle(update(1, 0, 1.0, declared=2**31 - 1, training=[9.0, 0.0]))
    assert records(refused, "record_training") == []  # a refused update's figures are not kept
    actions = p.handle(update(2, 0, 3.0, training=[0.5, 0.75]))
    kinds = [a.method for a in actions if isinstance(a, Record)]
    assert records(actions, "record_training") == [(0, 1, [0.5, 0.75])]  # round 0, user 1 (silo rank 2)
    assert kinds.index("record_training") < kinds.index("round_finished")


def test_a_silo_must_report_exactly_the_algorithms_own_figures():
    """An algorithm's own per-user figures (metric_names) travel with a silo's counts; figures
    under other names, or none, are refused and the user is left out, never half-recorded."""
    p, _ = protocol(silos=(1, 2, 3), metric_names=("momentum_norm",))
    online(p, silos=(1, 2, 3))
    for rank in (1, 2, 3):
        p.handle(update(rank, 0, 1.0))
    p.handle(Evaluation(3.0, 1, {**counts(1, 0), "own": {"momentum_norm": 0.25}}))
    refused = p.handle(Evaluation(3.0, 2, counts(2, 0)))
    actions = p.handle(Evaluation(3.0, 3, {**counts(3, 0), "own": {"momentum": 1.0}}))
    texts = [a.text for a in refused + actions if isinstance(a, Refuse)]
    assert len(texts) == 2 and all("the run's algorithm reports ['momentum_norm']" in t for t in texts), texts
    assert "silo rank 2 reported the figures [] of its own" in texts[0]
    ((_, by_user, missing, _),) = records(actions, "record_federated_evaluation")
    assert by_user[0]["own"] == {"momentum_norm": 0.25} and sorted(by_user) == [0] and missing == [1, 2]


def test_an_announcement_that_disagrees_is_refused_naming_the_key_and_both_values():
    p, _ = protocol(silos=(1, 2, 3))
    p.handle(Listening(0.0))
    actions = p.handle(Hello(1.0, 3, hello(3, fingerprint={"train_args.learning_rate": 0.5}), "s3"))
    (told,) = sends(actions, NOTICE)
    assert told.kind == wire.FINISH and told.refused and "train_args.learning_rate" in told.reason
    assert "0.001" in told.reason and "0.5" in told.reason
    p.handle(Hello(1.0, 1, hello(1), "s1"))
    actions = p.handle(Hello(1.0, 2, hello(2), "s2"))
    assert p.phase is Phase.TRAINING and [m.silo for m in sends(actions, ROUND)] == [1, 2]


def test_a_silo_given_up_on_that_announces_itself_again_takes_part_from_the_next_round():
    p, _ = protocol(rounds=3)
    online(p)
    p.handle(update(1, 0, 1.0))
    p.handle(Tick(100.0))  # silo 2 given up on
    actions = p.handle(Hello(101.0, 2, hello(2), "s2-new"))
    assert records(actions, "record_rejoined_silo")[0][1] == 2
    assert [m.kind for m in sends(actions, NOTICE)] == [wire.CHECK_STATUS]
    actions = p.handle(Evaluation(102.0, 1, counts(1, 0)))  # silo 2 was not asked: it was out
    assert [m.silo for m in sends(actions, ROUND)] == [1, 2]


def test_shared_mode_ends_with_the_final_model_and_the_silos_goodbyes():
    p, _ = protocol(own=False, rounds=1)
    online(p, own=False)
    p.handle(update(1, 0, 1.0))
    actions = p.handle(update(2, 0, 1.0))
    assert records(actions, "record_federated_evaluation") == []  # the silos evaluate with their updates
    final = sends(actions, FINAL)
    assert [(m.kind, m.round) for m in final] == [(wire.SYNC_MODEL, 1), (wire.SYNC_MODEL, 1)]
    assert p.phase is Phase.FINISHING
    assert p.handle(Goodbye(3.0, 1, None)) == []
    actions = p.handle(Goodbye(3.0, 2, None))
    assert isinstance(actions[-1], Finish) and p.phase is Phase.DONE


def test_shared_mode_needs_a_silo_for_each_sampled_user():
    with pytest.raises(ConfigError, match="client_num_per_round=.*must equal the number of silos"):
        setup = ServerSetup(mode=SharedDataRounds(), silos=[1, 2], fingerprint={})
        SiloServerProtocol(setup, SiloPolicy(1.0, 1.0, 1), Plan([0]), Model(), 1, 3)


def test_an_error_while_aggregating_ends_the_run_and_tells_the_silos():
    p, model = protocol()
    online(p)

    def broken(round_idx, updates, senders):
        raise RuntimeError("2 rounds had no acceptable client update")

    model.aggregate = broken
    p.handle(update(1, 0, 1.0))
    actions = p.handle(update(2, 0, 1.0))
    (end,) = [a for a in actions if isinstance(a, EndRun)]
    assert "no acceptable client update" in end.reason and isinstance(actions[-1], Fail)


def test_the_protocol_imports_no_fedml_grpc_or_socket_and_reads_no_clock():
    import fedml_perfedavg.silo.server.protocol as module

    source = open(module.__file__).read() + open(sys.modules["fedml_perfedavg.silo.server.rounds"].__file__).read()
    for word in ("import time", "import socket", "import grpc", "import fedml", "threading"):
        assert word not in source


def test_a_flood_of_announcements_from_one_session_is_acknowledged_once_per_interval_and_counted():
    p, _ = protocol()
    online(p)
    acknowledged, refused = 0, 0
    for i in range(100):  # 100 valid announcements in 10 s from a silo already taking part
        actions = p.handle(Hello(2.0 + i * 0.1, 1, hello(1), "s1"))
        acknowledged += len(sends(actions, NOTICE))
        refused += len([a for a in actions if isinstance(a, Refuse) and a.kind == "repeated-announcement"])
    assert acknowledged == 2 and refused == 98  # at 2.0 and at 7.0 (ANNOUNCE_INTERVAL_SECONDS = 5)
    actions = p.handle(Hello(12.5, 1, hello(1), "s1-restarted"))  # a new process is answered at once
    assert [m.kind for m in sends(actions, NOTICE)] == [wire.CHECK_STATUS]
    assert p.phase is Phase.TRAINING and records(p.handle(Tick(31.0)), "record_lost_silos")[0][1] == [1, 2]


def test_a_report_of_undelivered_sends_that_comes_after_the_round_ended_changes_nothing():
    """Sends run in the background, so their failure may be reported once the protocol moved on
    (a send that took its model just past the deadline counts as not delivered, and the silo
    answered): a stale report must not give the silo up in the round after."""
    p, _ = protocol(rounds=3)
    online(p)
    sent_in = p.stage
    assert sent_in == (0, "training")
    p.handle(update(1, 0, 1.0))
    p.handle(update(2, 0, 1.0))
    p.handle(Evaluation(3.0, 1, counts(1, 0)))
    p.handle(Evaluation(3.0, 2, counts(2, 0)))
    assert p.stage == (1, "training") and 2 in p.rounds.round.assigned
    assert p.handle(Undelivered(3.5, ROUND, {2: "rank 2 did not take a message"}, sent_in)) == []
    assert 2 in p.rounds.round.assigned
    current = p.handle(Undelivered(3.5, ROUND, {2: "rank 2 did not take a message"}, p.stage))
    assert records(current, "record_lost_silos")[0][1] == [2]  # a report of this round is acted on


class RoundPlan(Plan):
    """Round r samples ``by_round[r]`` (the last entry for the rounds after)."""

    def __init__(self, by_round):
        self.by_round = by_round

    def sample_clients(self, round_idx):
        return list(self.by_round[min(round_idx, len(self.by_round) - 1)])


def _three_silos(plan):
    """A data-owner server of three silos, four rounds, sampling by ``plan``."""
    setup = ServerSetup(
        mode=OwnDataRounds(),
        silos=[1, 2, 3],
        fingerprint=dict(FINGERPRINT),
        user_counts={r - 1: (TRAIN[r], TEST[r]) for r in (1, 2, 3)},
        model=nn.Sequential(nn.Linear(4, 3)),
    )
    policy = SiloPolicy(connect_timeout=60.0, round_timeout=30.0, min_clients=1)
    return SiloServerProtocol(setup, policy, plan, Model(), 4, 3)


def test_a_plan_whose_rounds_sample_only_refused_silos_is_refused_at_start():
    """Issue 55 item 8: silo 3 is refused at start (its user's DP budget, here announced as a
    problem); round 2 samples user 2 alone, whose silo that is: the run is stopped before round 0,
    naming round 2 and the silos, not after rounds 0 and 1 have run."""
    p = _three_silos(RoundPlan([[0, 2], [1, 2], [2]]))
    assert p.handle(Listening(0.0)) == []
    p.handle(Hello(1.0, 1, hello(1), "s1"))
    p.handle(Hello(1.0, 2, hello(2), "s2"))
    actions = p.handle(Hello(1.0, 3, hello(3, problem="user 2 cannot take part: dp_args.max_epsilon=5.0"), "s3"))
    [fail] = [a for a in actions if isinstance(a, Fail)]
    assert str(fail.error).startswith("silo rank(s) [3] were refused at start (the reasons above)")
    assert "samples silo rank(s) [3] for round 2, of which 0 can take part ([]), fewer than " in str(fail.error)
    assert "comm_args.min_clients_per_round=1" in str(fail.error)
    assert not sends(actions, ROUND)  # no round was opened


def test_a_plan_whose_every_round_keeps_enough_silos_runs_without_the_refused_one():
    p = _three_silos(RoundPlan([[0, 2], [1, 2]]))
    assert p.handle(Listening(0.0)) == []
    p.handle(Hello(1.0, 1, hello(1), "s1"))
    p.handle(Hello(1.0, 2, hello(2), "s2"))
    actions = p.handle(Hello(1.0, 3, hello(3, problem="user 2 cannot take part"), "s3"))
    assert not [a for a in actions if isinstance(a, Fail)]
    assert [m.silo for m in sends(actions, ROUND)] == [1]  # round 0: silo 1 (silo 3 is out)


def test_a_silo_stopped_after_it_answered_its_round_leaves_its_update_in_the_round():
    """A data owner's operator stops its silo (Ctrl-C) after it sent its update, before the round
    closed: the server gives it up at once, and the round closes with both updates. It ended the
    run with a KeyError (the update's sender no longer known) in a suite run of 2026-12-04."""
    p, model = protocol(min_clients=1)
    online(p)
    assert p.handle(update(2, 0, 3.0)) == []
    p.handle(SiloFailed(2.5, 2, "silo rank 2's process was stopped (SIGINT or SIGTERM)", stopped=True))
    actions = p.handle(update(1, 0, 1.0, now=3.0))
    (finished,) = records(actions, "round_finished")
    assert finished[0] == 0 and torch.equal(finished[1]["w"], torch.full((2,), 2.0))
    assert model.aggregated == [(0, [0, 1])] and not [a for a in actions if isinstance(a, Fail)]
