"""Which rounds are evaluated, measured and checkpointed: the rules, alone."""

from fedml_perfedavg.run.schedule import RoundSchedule


def test_every_frequency_th_round_and_the_last_are_evaluated():
    schedule = RoundSchedule(comm_round=7, frequency_of_the_test=3)
    assert [r for r in range(7) if schedule.evaluates(r)] == [0, 3, 6]
    assert [r for r in range(8) if RoundSchedule(8, 3).evaluates(r)] == [0, 3, 6, 7]


def test_stationarity_is_measured_only_with_an_evaluation_and_never_when_off():
    schedule = RoundSchedule(comm_round=10, frequency_of_the_test=2, stationarity_every=4)
    assert [r for r in range(10) if schedule.measures_stationarity(r)] == [0, 4, 8, 9]
    assert not any(RoundSchedule(10, 2, 0).measures_stationarity(r) for r in range(10))


def test_checkpoints_every_n_rounds_and_after_the_last_never_when_off():
    schedule = RoundSchedule(comm_round=7, frequency_of_the_test=1, checkpoint_every=3)
    assert [r for r in range(7) if schedule.checkpoints(r)] == [2, 5, 6]
    assert not any(RoundSchedule(7, 1, 0, 0).checkpoints(r) for r in range(7))
