"""A run records each round's training figures (its clients' local steps' mean loss and accuracy
on their minibatches D) in summary.json's train_history, from the values the local update
computes anyway; an algorithm with maths of its own records none, and says nothing false."""

import pytest
import torch

from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_config, tiny_data


@pytest.mark.parametrize("method", [("PerFedAvg", "hf"), ("PerFedAvg", "exact"), ("FedAvgUpdate", "hf")])
def test_every_round_records_its_clients_training_loss_and_accuracy(tmp_path, method):
    optimizer, variant = method
    config = tiny_config(federated_optimizer=optimizer, perfedavg_variant=variant, checkpoint_every=0, beta=0.3)
    result = run(config, str(tmp_path / "run"), data=tiny_data())
    training = result.summary["train_history"]
    assert [t["round"] for t in training] == list(range(config.train.comm_round))
    assert all(t["train_clients"] == config.train.client_num_per_round for t in training)
    assert all(0.0 < t["train_loss"] < 5.0 and 0.0 <= t["train_accuracy"] <= 1.0 for t in training)
    assert training[-1]["train_loss"] < training[0]["train_loss"]  # it trained


def test_the_first_rounds_figures_are_the_clients_losses_at_the_global_model(tmp_path):
    """Round 0, step 0 of every client starts from the initial model: the record's figures are
    the clients' own at their steps, here recomputed client by client with the algorithm's maths."""
    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    config = tiny_config(checkpoint_every=0, comm_round=1)
    data = tiny_data()
    result = run(config, str(tmp_path / "run"), data=data)
    torch.manual_seed(config.common.random_seed)
    model = create_model(config.model.model, data.input_shape, data.num_classes, config.model.hidden_sizes)
    algorithm = create_algorithm(config.train.federated_optimizer, model, config)
    state = dict(model.state_dict())
    params, _ = algorithm.split_state(state)
    figures = []
    for client in algorithm.sample_clients(0):
        user = data.users[client]
        batches = algorithm.client_batches(0, client, user.train_x, user.train_y)
        figures.append(algorithm.local_update_and_figures(params, batches)[1])
    expected = torch.stack(figures).mean(0)
    (recorded,) = result.summary["train_history"]
    assert recorded["train_loss"] == pytest.approx(float(expected[0]), rel=1e-5)
    assert recorded["train_accuracy"] == pytest.approx(float(expected[1]), rel=1e-5)


def test_an_algorithm_with_maths_of_its_own_records_no_training_figures(tmp_path):
    result = run(
        tiny_config(federated_optimizer="FedAvgARUBA", checkpoint_every=0), str(tmp_path / "run"), data=tiny_data()
    )
    assert result.summary["train_history"] == [] and result.summary["status"] == "finished"
