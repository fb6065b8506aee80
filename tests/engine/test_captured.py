"""``device_args.capture_rounds``: a round's local training over kept buffers, as one CUDA graph on
a GPU. CI has none, so these run the same steps uncaptured (the inputs copied into the kept
buffers, the function called on them, the outputs copied out) and hold them to the eager
engine's bits; benchmarks/cuda_graph_round.py holds the captured graph to them on a GPU."""

import copy

import pytest
import torch

from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.engine.captured import CapturedTraining
from fedml_perfedavg.engine.grid import GridSimulation, why_not_together
from fedml_perfedavg.run.config import ConfigError, resolve

from tests.engine.test_batched import CASES, Driver, _setup
from tests.helpers_tiny import DP_SGD


def _engine(optimizer, variant, seed=0, capture=False, **overrides):
    config, users, model = _setup(optimizer, variant, seed=seed, random_seed=seed, **overrides)
    algorithm = create_algorithm(optimizer, model, config)
    start = copy.deepcopy(model.state_dict())
    return BatchedSimulation(algorithm, users, start, Driver(algorithm), capture_rounds=capture), config


def _figures(engine, rounds):
    return [engine.algorithm.training.take(r) for r in range(rounds)]


@pytest.mark.parametrize("optimizer,variant", CASES)
def test_captured_rounds_run_the_eager_steps_and_give_their_bits(optimizer, variant, caplog):
    eager, config = _engine(optimizer, variant)
    with caplog.at_level("WARNING"):
        captured, _ = _engine(optimizer, variant, capture=True)
    assert captured.captured is not None and captured.captured.captures is False
    assert "CUDA graphs need a CUDA device; on cpu the same steps run uncaptured" in caplog.text
    before = {k: v.clone() for k, v in captured.state.items()}
    want, got = eager.run(0, config.train.comm_round), captured.run(0, config.train.comm_round)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert any(not torch.equal(got[k], before[k]) for k in got)  # it trained
    # each round's training figures, from the graph's outputs, as the eager rounds record them
    assert _figures(captured, config.train.comm_round) == _figures(eager, config.train.comm_round)
    assert len(captured.captured._replays) == 1  # one input shape: one graph, replayed every round


def test_the_guard_and_screen_read_the_captured_outputs():
    # a diverging client is dropped by the divergence guard after the graph, as on the eager path
    eager, config = _engine("PerFedAvg", "hf", beta=1e6, on_divergence="skip_client", max_skipped_rounds=5)
    captured, _ = _engine("PerFedAvg", "hf", capture=True, beta=1e6, on_divergence="skip_client", max_skipped_rounds=5)
    want, got = eager.run(0, 2), captured.run(0, 2)
    assert captured.algorithm.screen.skipped_rounds == eager.algorithm.screen.skipped_rounds > 0
    for k in want:
        assert torch.equal(got[k], want[k])


def test_the_outputs_are_copied_out_of_the_kept_buffers():
    calls = []

    def training(start, index):
        calls.append(index[0].clone())
        return {"w": start["w"] * index[0].sum()}, index[0].double().view(-1, 1)

    run = CapturedTraining(training, torch.device("cpu"))
    first, first_figures = run({"w": torch.ones(2)}, [torch.tensor([1, 2])])
    second, _ = run({"w": torch.full((2,), 2.0)}, [torch.tensor([3, 4])])
    assert first["w"].tolist() == [3.0, 3.0] and second["w"].tolist() == [14.0, 14.0]
    assert first_figures.view(-1).tolist() == [1.0, 2.0]
    assert [c.tolist() for c in calls] == [[1, 2], [3, 4]]  # each call saw its own inputs
    run({"w": torch.ones(3)}, [torch.tensor([1, 2])])  # another shape: kept buffers of its own
    assert len(run._replays) == 2


def test_a_capture_that_fails_is_said_and_the_same_steps_run_uncaptured(caplog):
    run = CapturedTraining(lambda start, index: ({"w": start["w"] + index[0]}, None), torch.device("cpu"))
    run.captures = True  # a CUDA graph asked of a device that has none: the capture raises
    with caplog.at_level("WARNING"):
        got, _ = run({"w": torch.zeros(2)}, [torch.tensor([1.0, 2.0])])
    assert got["w"].tolist() == [1.0, 2.0] and run.graphs == 0
    assert "could not be captured as a CUDA graph" in caplog.text and "it runs uncaptured" in caplog.text


def test_grid_mode_captures_every_run_s_clients_together_with_the_same_bits():
    def grid(capture):
        engines = [_engine("PerFedAvg", "hf", seed=s, capture=capture)[0] for s in (0, 1, 2)]
        return GridSimulation(engines), engines

    (eager, eager_runs), (captured, captured_runs) = grid(False), grid(True)
    assert eager.captured is None and captured.captured is not None
    eager.run(0, 3)
    captured.run(0, 3)
    for want, got in zip(eager_runs, captured_runs):
        for k in want.state:
            assert torch.equal(got.state[k], want.state[k])
        assert _figures(got, 3) == _figures(want, 3)
    mixed = [_engine("PerFedAvg", "hf", seed=0)[0], _engine("PerFedAvg", "hf", seed=1, capture=True)[0]]
    assert why_not_together(mixed) == "run 1 and run 0 differ in device_args.capture_rounds"


@pytest.mark.parametrize(
    "overrides,reason",
    [
        ({"try_hand_batched": False}, "only the hand-batched path is captured"),
        (DP_SGD, "only the hand-batched path is captured (DP-SGD"),
    ],
    ids=["vmap", "dp-sgd"],
)
def test_a_run_that_cannot_be_captured_says_why_and_runs_eagerly(overrides, reason, caplog):
    overrides = dict(overrides)
    hand_batched = overrides.pop("try_hand_batched", True)
    config, users, model = _setup("PerFedAvg", "hf", **overrides)
    algorithm = create_algorithm("PerFedAvg", model, config)
    with caplog.at_level("WARNING"):
        engine = BatchedSimulation(
            algorithm, users, model.state_dict(), Driver(algorithm), try_hand_batched=hand_batched, capture_rounds=True
        )
    assert engine.captured is None
    assert f"device_args.capture_rounds=True captures nothing here: {reason}" in caplog.text


def test_the_config_refuses_capture_where_no_batched_engine_runs_or_a_compiled_step_does():
    assert resolve({}, {"capture_rounds": True}).device.capture_rounds is True
    with pytest.raises(ConfigError, match="device_args.capture_rounds=True: only the batched engine captures"):
        resolve({}, {"capture_rounds": True, "simulation_engine": "fedml"})
    with pytest.raises(ConfigError, match="not with device_args.compile_local_update=True"):
        resolve({}, {"capture_rounds": True, "compile_local_update": True})
