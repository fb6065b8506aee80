"""What each evaluation records beyond accuracy: training time, the stationarity measure and
the paper's randomly-stepped averaged iterate."""

import pytest
import torch

from fedml_perfedavg.algorithms.base import average
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.sampling import random_iterate_step
from fedml_perfedavg.core.stationarity import stationarity
from fedml_perfedavg.run.measures import client_iterate
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_config, tiny_data


@pytest.mark.parametrize("engine", ["batched", pytest.param("fedml", marks=pytest.mark.backend)])
def test_each_evaluation_records_training_time_stationarity_and_the_random_iterate(tmp_path, engine):
    config = tiny_config(
        stationarity_every=2, random_iterate=True, local_steps=3, simulation_engine=engine, checkpoint_every=0
    )
    data = tiny_data()
    result = run(config, str(tmp_path), data=data)
    history = result.summary["history"]
    assert [h["round"] for h in history] == [0, 2, 4, 5]
    train = [h["train_seconds"] for h in history]
    assert all(0 < t <= h["wall_seconds"] for t, h in zip(train, history)) and train == sorted(train)
    # evaluation time is left out: the wall clock grows faster than the training clock
    assert history[-1]["wall_seconds"] - history[-1]["train_seconds"] > history[0]["wall_seconds"] - train[0]
    algorithm = result.algorithm
    params, _ = algorithm.split_state(result.final_state)
    assert history[-1]["stationarity"] == pytest.approx(
        stationarity(algorithm.loss_fn, params, data.users, config.train.alpha), rel=1e-6
    )
    for h in history:
        assert h["random_iterate_step"] == random_iterate_step(config.common.random_seed, h["round"], 3)
        assert 0 <= h["random_iterate_personalized_accuracy"] <= 1 and h["random_iterate_stationarity"] > 0


def test_the_random_iterate_is_the_average_of_the_clients_truncated_updates(tmp_path):
    # Round 0 starts from the initial model; recompute its iterates by hand and compare.
    data = tiny_data()
    config = tiny_config(random_iterate=True, local_steps=4, comm_round=1, checkpoint_every=0, stationarity_every=2)
    step = random_iterate_step(config.common.random_seed, 0, 4)
    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    torch.manual_seed(config.common.random_seed)
    model = create_model("mlp", (1, 4, 4), 3, (5,))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = run(config, str(tmp_path), data=data, model=model)
    algorithm = create_algorithm("PerFedAvg", create_model("mlp", (1, 4, 4), 3, (5,)), config)
    iterates = [
        (1.0, client_iterate(algorithm, 0, c, start, data.users[c].train_x, data.users[c].train_y, step))
        for c in algorithm.sample_clients(0)
    ]
    averaged = average(iterates, "uniform")
    expected = algorithm.evaluate(0, averaged, data.users).personalized_accuracy
    recorded = result.summary["history"][0]
    assert recorded["random_iterate_step"] == step
    assert recorded["random_iterate_personalized_accuracy"] == pytest.approx(expected)
    params, _ = algorithm.split_state(averaged)
    assert recorded["random_iterate_stationarity"] == pytest.approx(
        stationarity(algorithm.loss_fn, params, data.users, config.train.alpha), rel=1e-6
    )
    # Independent of client_iterate's own code: the iterate after `step` steps, continued with the
    # remaining steps' minibatches, is exactly the client's full update (a wrong start point or
    # wrong minibatches in the iterate would break this), and after all tau steps it is the update.
    from fedml_perfedavg.core.client_maths import LocalBatches

    for c in algorithm.sample_clients(0):
        x, y = data.users[c].train_x, data.users[c].train_y
        update = algorithm.client_update(0, c, start, x, y).state
        iterate = dict(client_iterate(algorithm, 0, c, start, x, y, step))
        rest = LocalBatches(*(t[step:] for t in algorithm.client_batches(0, c, x, y)))
        params, _ = algorithm.split_state(iterate)
        with torch.no_grad():
            continued = algorithm.local_update(params, rest) if step < 4 else params
        assert all(torch.equal(continued[k], update[k]) for k in continued)
        full = client_iterate(algorithm, 0, c, start, x, y, 4)
        assert all(torch.equal(full[k], update[k]) for k in full)


def test_random_iterate_needs_simulation():
    with pytest.raises(ConfigError, match="validation_args.random_iterate=True: only in simulation"):
        tiny_config(random_iterate=True, training_type="cross_silo", backend="GRPC")


def test_stationarity_is_measured_on_its_own_schedule_and_the_last_round(tmp_path):
    result = run(tiny_config(stationarity_every=4, checkpoint_every=0), str(tmp_path), data=tiny_data())
    measured = [h["round"] for h in result.summary["history"] if "stationarity" in h]
    assert measured == [0, 4, 5]
    with pytest.raises(
        ConfigError,
        match=r"validation_args.stationarity_every=3: must be a multiple of "
        r"validation_args.frequency_of_the_test \(2\)",
    ):
        tiny_config(stationarity_every=3)
