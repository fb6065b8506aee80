"""Grid mode: several runs' clients train as one computation, each run getting exactly what it
gets alone."""

import copy

import pytest
import torch

from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.engine.grid import GridSimulation, why_not_together

from tests.engine.test_batched import CASES, Driver, _setup


def _engine(optimizer, variant, seed, **overrides):
    config, users, model = _setup(optimizer, variant, seed=seed, random_seed=seed, **overrides)
    algorithm = create_algorithm(optimizer, model, config)
    driver = Driver(algorithm)
    return BatchedSimulation(algorithm, users, copy.deepcopy(model.state_dict()), driver), config


@pytest.mark.parametrize("optimizer,variant", CASES)
def test_three_seeds_together_equal_three_separate_runs_float64(optimizer, variant):
    alone, together = [], []
    for seed in (0, 1, 2):
        engine, config = _engine(optimizer, variant, seed)
        alone.append(engine.run(0, config.train.comm_round))
        together.append(_engine(optimizer, variant, seed)[0])
    GridSimulation(together).run(0, config.train.comm_round)
    for separate, joint in zip(alone, together):
        assert len(joint.driver.states) == config.train.comm_round  # each run's own driver saw every round
        for k in separate:
            torch.testing.assert_close(joint.state[k], separate[k], rtol=1e-12, atol=1e-13)
    assert not torch.allclose(alone[0]["net.1.weight"], alone[1]["net.1.weight"])  # the seeds differ


def test_runs_that_cannot_share_a_computation_are_refused_with_the_reason():
    hf, _ = _engine("PerFedAvg", "hf", 0)
    fo, _ = _engine("PerFedAvg", "fo", 1)
    assert "other client maths" in why_not_together([hf, fo])
    vmapped, _ = _engine("FedAvgARUBA", "hf", 2)
    assert "not on the hand-batched path" in why_not_together([vmapped])
    with pytest.raises(ValueError, match="cannot train as one computation: run 1 has other client maths"):
        GridSimulation([hf, fo])
