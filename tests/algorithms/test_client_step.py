"""One client's training is chosen once from what the algorithm declares (algorithms/client_step.py):
``client_update`` runs that step, and the batched engine vmaps the same step's function, so a
client trained alone and a client trained among a round's clients get the same bits."""

import pytest
import torch

from fedml_perfedavg.algorithms.client_step import StepKind, choose_client_step
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.engine.plan import Path
from fedml_perfedavg.models import create_model

import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD
from tests.helpers_tiny import tiny_config, tiny_data
from tests.run.test_privacy_run import DP

pytestmark = pytest.mark.fast


def _algorithm(name="PerFedAvg", **overrides):
    torch.manual_seed(0)
    model = create_model("mlp", (1, 4, 4), 3, [5])
    return create_algorithm(name, model, tiny_config(federated_optimizer=name, **overrides)), model.state_dict()


@pytest.mark.parametrize(
    "name, overrides, record, kind, whole",
    [
        ("PerFedAvg", {}, True, StepKind.FIGURES, False),
        ("PerFedAvg", {}, False, StepKind.PLAIN, False),
        ("PerFedAvg", DP, True, StepKind.PRIVATE, False),
        ("PerFedAvg", {**DP, "dp_args.clip": "adaptive"}, True, StepKind.PRIVATE, False),
        ("FedAvgARUBA", {}, True, StepKind.PLAIN, True),
        ("ClippedFedSGD", {"clip_norm": 10.0, "client_momentum": 0.9}, True, StepKind.OWN_STATE, True),
    ],
)
def test_the_step_is_chosen_from_the_declarations(name, overrides, record, kind, whole):
    algorithm, _ = _algorithm(name, **overrides)
    step = choose_client_step(algorithm, record_figures=record)
    assert (step.kind, step.whole_state) == (kind, whole)
    if record:
        assert algorithm.client_step == step  # the algorithm's own, chosen once
        assert algorithm.client_step is algorithm.client_step
    if kind in (StepKind.PRIVATE, StepKind.OWN_STATE):
        with pytest.raises(TypeError, match="is not a pure function of the start and the minibatches"):
            assert step.pure is None  # raises first


def test_a_client_alone_and_vmapped_among_a_rounds_clients_get_the_same_bits():
    """The per-client path (FedML's loops) and the vmap path run one step's function."""
    data = tiny_data()
    trained = {}
    for try_vmap in (False, True):
        algorithm, state = _algorithm()
        if try_vmap:
            engine = BatchedSimulation(algorithm, data.users, state, driver=None, try_hand_batched=False)
            assert engine.plan.path is Path.VMAP and engine.plan.step.kind is StepKind.FIGURES
            assert "client step: its training figures recorded" in engine.plan.describe()
            updates = engine.train_clients(0, [0, 3], state)
        else:
            users = data.users
            updates = [algorithm.client_update(0, c, state, users[c].train_x, users[c].train_y) for c in (0, 3)]
        trained[try_vmap] = [update[1] for update in updates]
        assert [row[0] for row in algorithm.training.of(0, range(6))] == [0, 3]  # both record the figures
    for alone, together in zip(trained[False], trained[True]):
        assert alone.keys() == together.keys()
        for key in alone:
            torch.testing.assert_close(alone[key], together[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "name, model, overrides, kind",
    [
        ("ClippedFedSGD", "mlp", {"clip_norm": 10.0, "client_momentum": 0.9}, StepKind.OWN_STATE),
        ("PerFedAvg", "small_cnn", DP, StepKind.PRIVATE),
    ],
)
def test_the_engine_runs_a_step_that_is_no_pure_function_client_by_client(name, model, overrides, kind):
    """A step with a state of the client's own, or DP-SGD per sample (a model that is no Linear
    chain), runs through client_update on the engine's per-client path (the CI run of d6a066a:
    the engine built a vmapped step for every path, and these raised before the first round)."""
    data = tiny_data()
    torch.manual_seed(0)
    network = create_model(model, (1, 4, 4), 3, [5])
    algorithm = create_algorithm(name, network, tiny_config(federated_optimizer=name, model=model, **overrides))
    state = network.state_dict()
    engine = BatchedSimulation(algorithm, data.users, state, driver=None)
    assert engine.plan.path is Path.PER_CLIENT and engine.plan.step.kind is kind and engine.step is None
    updates = engine.train_clients(0, [1, 4], state)
    assert [samples for samples, _ in updates] == [24, 24]
    assert all(not torch.equal(update[k], state[k]) for _, update in updates for k in algorithm.parameter_names)
