"""The rounds' training figures by client: what a round's record says, what travels between
processes, and what is refused on the way in."""

import math

import pytest
import torch

from fedml_perfedavg.core.training_record import ROUNDS_KEPT, TrainingRecord, valid_figures


def test_a_rounds_record_is_its_clients_mean_and_is_taken_once():
    record = TrainingRecord()
    record.add(3, [7, 2], torch.tensor([[2.0, 0.25], [1.0, 0.75]]))
    record.note(3, 9, [3.0, 0.5])  # from another process
    assert record.take(3) == {"round": 3, "train_loss": 2.0, "train_accuracy": 0.5, "train_clients": 3}
    assert record.take(3) is None  # taken: nothing is counted twice


def test_a_diverged_client_is_left_out_and_a_loss_without_accuracy_is_kept():
    record = TrainingRecord()
    record.add(0, [0, 1, 2], torch.tensor([[float("nan"), 0.5], [1.0, float("nan")], [3.0, 0.25]]))
    assert record.of(0, [0, 1, 2]) == [[1, 1.0, None], [2, 3.0, 0.25]]
    assert record.take(0) == {"round": 0, "train_loss": 2.0, "train_accuracy": 0.25, "train_clients": 2}
    record.add(1, [0], torch.tensor([[float("inf"), 1.0]]))
    assert record.take(1) is None  # no client with finite figures: no record of the round


def test_a_process_that_never_reports_keeps_only_the_last_rounds():
    record = TrainingRecord()
    for round_idx in range(20):
        record.add(round_idx, [0], torch.tensor([[1.0, 1.0]]))
    assert sorted(record._rounds) == list(range(20 - ROUNDS_KEPT - 1, 20))


@pytest.mark.parametrize(
    "value",
    [[0.5, 0.5], [0, 1], (2.3, None), [0.0, 0.0]],
)
def test_figures_as_they_travel_are_accepted(value):
    assert valid_figures(value)


@pytest.mark.parametrize(
    "value",
    [
        [float("nan"), 0.5],
        [math.inf, 0.5],
        [-1.0, 0.5],
        [0.5, 1.5],
        [0.5, -0.1],
        [True, 0.5],
        [0.5, False],
        ["1.0", 0.5],
        [0.5],
        [0.5, 0.5, 0.5],
        {"loss": 0.5},
        None,
    ],
)
def test_figures_that_are_not_a_loss_and_an_accuracy_are_refused(value):
    assert not valid_figures(value)
