"""What an algorithm class declares is checked when the class is defined (an engine reads the
declarations, never guesses), and an algorithm's own per-user figures (``metric_names``) join
every evaluation, its record and its checkpoint."""

import math

import pytest
import torch

from fedml_perfedavg.algorithms import FederatedAlgorithm
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.evaluation import EvaluationResult
from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.reporting import RunRecorder

import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD
from tests.helpers_tiny import tiny_config, tiny_data


def test_a_local_training_of_its_own_must_declare_that_it_returns_the_whole_state():
    with pytest.raises(TypeError, match="defines local_training: declare returns_whole_state = True"):

        class Hidden(FederatedAlgorithm):  # noqa: F841
            def local_training(self, state, batches):
                return state


def test_a_client_state_must_be_declared():
    with pytest.raises(TypeError, match="declare keeps_client_state = True"):

        class Forgetful(FederatedAlgorithm):  # noqa: F841
            def local_training_with_state(self, state, batches, client_state):
                return state, client_state


@pytest.mark.parametrize(
    "names,why",
    [
        (("accuracy",), "not: \\['accuracy'\\]"),  # the protocol's own
        (("personalized_accuracy",), "not: \\['personalized_accuracy'\\]"),  # the record's
        (("random_iterate_norm",), "not: \\['random_iterate_norm'\\]"),
        (("two words",), "not: \\['two words'\\]"),
        (("norm", "norm"), "distinct identifiers"),
        (["norm"], "give a tuple of names"),
    ],
)
def test_metric_names_are_distinct_identifiers_no_record_uses_already(names, why):
    with pytest.raises(TypeError, match=why):

        class Named(FederatedAlgorithm):  # noqa: F841
            metric_names = names

            def user_metrics(self, round_idx, global_state, user, user_id):
                return {}


def test_metric_names_and_user_metrics_go_together():
    with pytest.raises(TypeError, match="metric_names and user_metrics go together"):

        class Unnamed(FederatedAlgorithm):  # noqa: F841
            def user_metrics(self, round_idx, global_state, user, user_id):
                return {"norm": 1.0}

    with pytest.raises(TypeError, match="metric_names and user_metrics go together"):

        class Silent(FederatedAlgorithm):  # noqa: F841
            metric_names = ("norm",)


def _trained_clipped(**overrides):
    config = tiny_config(federated_optimizer="ClippedFedSGD", clip_norm=10.0, client_momentum=0.9, **overrides)
    model = create_model("mlp", (1, 4, 4), 3, [5])
    algorithm = create_algorithm("ClippedFedSGD", model, config)
    data = tiny_data()
    state = model.state_dict()
    for client in (0, 2):
        user = data.users[client]
        algorithm.client_update(0, client, state, user.train_x, user.train_y)
    return algorithm, state, data.users


def test_an_evaluation_carries_the_algorithms_own_figures_of_each_user():
    algorithm, state, users = _trained_clipped()
    result = algorithm.evaluate(1, state, users)
    norms = result.per_user["momentum_norm"]
    momentum = algorithm.client_states.get(2)
    expected = math.sqrt(sum(float((v * v).sum()) for v in momentum.values()))
    assert norms[2] == pytest.approx(expected) and norms[1] == 0.0 and norms[0] > 0
    assert result.own_names == ["momentum_norm"]
    assert result.metrics()["momentum_norm"] == pytest.approx(sum(norms) / len(norms))
    some = algorithm.evaluate(1, state, [users[2]], user_ids=[2], batched=False)
    assert some.per_user["momentum_norm"] == [norms[2]]  # keyed by the user's id, not its position
    assert result.subset([2, 0]).per_user["momentum_norm"] == [norms[2], norms[0]]


def test_a_figure_that_is_not_a_finite_number_or_misnamed_stops_the_evaluation(monkeypatch):
    algorithm, state, users = _trained_clipped()
    cls = type(algorithm)
    monkeypatch.setattr(cls, "user_metrics", lambda self, r, s, u, i: {"momentum_norm": float("nan")})
    with pytest.raises(ValueError, match="ClippedFedSGD.user_metrics' momentum_norm of user 0 is nan"):
        algorithm.evaluate(1, state, users)
    monkeypatch.setattr(cls, "user_metrics", lambda self, r, s, u, i: {"norm": 1.0})
    with pytest.raises(ValueError, match="gave \\['norm'\\] for user 0; its metric_names are \\['momentum_norm'\\]"):
        algorithm.evaluate(1, state, users)


def test_the_own_figures_are_in_the_summary_and_survive_a_checkpoint(tmp_path):
    algorithm, state, users = _trained_clipped()
    result = algorithm.evaluate(1, state, users)
    recorder = RunRecorder(str(tmp_path), 3, {}, show_progress=False, num_users=len(users))
    recorder.record_evaluation(1, result)
    summary = recorder.summary()
    assert summary["per_user_metrics"] == {"momentum_norm": result.per_user["momentum_norm"]}
    assert summary["own_metrics"]["momentum_norm"] == pytest.approx(sum(result.per_user["momentum_norm"]) / 6)
    assert summary["history"][-1]["momentum_norm"] == summary["own_metrics"]["momentum_norm"]
    again = RunRecorder(str(tmp_path), 3, {}, show_progress=False, num_users=len(users))
    again.load_state_dict(torch.load(_saved(recorder, tmp_path)))
    assert again.last == result and again.summary()["per_user_metrics"] == summary["per_user_metrics"]


def _saved(recorder, tmp_path):
    path = tmp_path / "recorder.pt"
    torch.save(recorder.state_dict(), path)
    return path


def test_a_checkpoint_from_before_named_metrics_still_loads():
    old = {"per_user_accuracy": [0.5, 1.0], "per_user_accuracy_before": [0.25, 0.5], "per_user_loss": [1.0, 0.5]}
    result = EvaluationResult.from_record({**old, "user_ids": None})
    assert result == EvaluationResult.of([0.5, 1.0], [0.25, 0.5], [1.0, 0.5])
    assert result.own_names == [] and result.per_user_loss == [1.0, 0.5]


def test_dp_sgd_refuses_figures_it_does_not_account_for():
    from fedml_perfedavg.algorithms.base import AlgorithmSettings
    from fedml_perfedavg.algorithms.fedavg_update import FedAvgUpdate

    class Counted(FedAvgUpdate):  # the standard maths, which DP-SGD reaches, and a figure it does not
        name = "Counted"
        metric_names = ("steps",)

        def user_metrics(self, round_idx, global_state, user, user_id):
            return {"steps": 0.0}

    dp = {
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "dpsgd",
        "dp_args.noise_multiplier": 1.1,
        "dp_args.max_grad_norm": 1.0,
        "dp_args.delta": 1e-5,
    }
    settings = AlgorithmSettings.from_config(tiny_config(**dp))
    assert settings.privacy is not None
    FedAvgUpdate(create_model("mlp", (1, 4, 4), 3, [5]), settings)  # without own figures it runs
    with pytest.raises(
        ConfigError, match="its own per-user figures \\['steps'\\] would be released with no DP-SGD account"
    ):
        Counted(create_model("mlp", (1, 4, 4), 3, [5]), settings)
