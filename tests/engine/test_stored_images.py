"""Images are stored as read, uint8 (a quarter of float32's bytes), and scaled to [0, 1] where they
are used: every path that reads a user's data (the batched engine's gathers, FedML's loop, DP-SGD's
draws, the evaluation, the measures, an algorithm's own draws) gives the bits of the same data held
as float32."""

import pytest
import torch

from fedml_perfedavg.algorithms.base import initial_global_state
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.types import UserSplit, gather_inputs, model_inputs
from fedml_perfedavg.data.fedml_format import client_tensors, to_fedml_dataset
from fedml_perfedavg.data.loading import FederatedData
from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import DP_SGD, tiny_config


def stored_and_scaled(num_users=6, seed=0):
    """The same users twice: images stored as uint8, and as the float32 numbers they stand for."""
    g = torch.Generator().manual_seed(seed)
    stored = []
    for _ in range(num_users):
        stored.append(
            UserSplit(
                torch.randint(0, 256, (24, 1, 4, 4), generator=g, dtype=torch.uint8),
                torch.randint(0, 3, (24,), generator=g),
                torch.randint(0, 256, (8, 1, 4, 4), generator=g, dtype=torch.uint8),
                torch.randint(0, 3, (8,), generator=g),
            )
        )
    scaled = [UserSplit(u.train_x.float() / 255, u.train_y, u.test_x.float() / 255, u.test_y) for u in stored]
    return FederatedData(stored, 3, (1, 4, 4)), FederatedData(scaled, 3, (1, 4, 4))


def test_a_gather_scales_only_the_rows_it_reads_into_the_buffer_given():
    stored = torch.randint(0, 256, (10, 1, 2, 2), dtype=torch.uint8)
    rows = torch.tensor([7, 0, 7, 3])
    expected = stored.float().div(255)[rows]
    assert torch.equal(gather_inputs(stored, rows), expected)
    buffer = torch.empty(4, 1, 2, 2)
    assert gather_inputs(stored, rows, buffer).data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected)
    floats = torch.rand(10, 3)
    assert torch.equal(gather_inputs(floats, rows), floats[rows]) and model_inputs(floats) is floats
    tokens = torch.randint(0, 50, (10, 5))  # an embedding model's token ids stay integers
    assert model_inputs(tokens) is tokens


@pytest.mark.parametrize(
    "settings",
    [
        {},
        pytest.param({"perfedavg_variant": "exact", "simulation_engine": "fedml"}, marks=pytest.mark.backend),
        {"federated_optimizer": "FedAvgUpdate", "random_iterate": True, "stationarity_every": 2},
        DP_SGD,
    ],
    ids=["hf-batched", "exact-fedml-loop", "fedavg-measures", "dp-sgd"],
)
def test_a_run_on_stored_images_is_the_run_on_their_float_numbers(tmp_path, settings):
    stored, scaled = stored_and_scaled()
    config = tiny_config(checkpoint_every=0, **settings)
    ran = {name: run(config, str(tmp_path / name), data=data) for name, data in (("u8", stored), ("f32", scaled))}
    for key, value in ran["f32"].final_state.items():
        assert torch.equal(ran["u8"].final_state[key], value), key
    history = [
        [{k: v for k, v in row.items() if not k.endswith("_seconds")} for row in r.summary["history"]]
        for r in (ran["u8"], ran["f32"])
    ]
    assert history[0] == history[1] and len(history[0]) >= 3
    assert 0.0 < history[0][-1]["personalized_accuracy"] < 1.0


def test_an_algorithms_own_draws_and_metrics_see_the_scaled_numbers():
    stored, scaled = stored_and_scaled()
    config = tiny_config()
    seen = []

    def algorithm():
        torch.manual_seed(0)
        model = create_model("mlp", (1, 4, 4), 3, [5])
        built = create_algorithm(config.train.federated_optimizer, model, config)

        class OwnDraws(type(built)):  # an algorithm that draws its own minibatches
            def client_batches(self, round_idx, client_id, x, y):
                seen.append(x.dtype)
                return super().client_batches(round_idx, client_id, x, y)

        built.__class__ = OwnDraws
        return built, model

    results = []
    for data in (stored, scaled):
        own, model = algorithm()
        state = initial_global_state(own, model)
        user = data.users[0]
        results.append(own.client_update(0, 0, state, user.train_x, user.train_y).state)
    assert seen == [torch.float32, torch.float32]
    for key in results[1]:
        assert torch.equal(results[0][key], results[1][key]), key


def test_fedmls_own_trainers_read_scaled_batches_and_the_plugin_reads_the_stored_block():
    stored, scaled = stored_and_scaled()
    block = torch.cat([u.train_x for u in stored.users])
    users = [UserSplit(block[24 * i : 24 * (i + 1)], *u[1:]) for i, u in enumerate(stored.users)]  # views of one block
    dataset = to_fedml_dataset(users, 3, batch_size=8)
    x, y = next(iter(dataset[5][2]))  # a FedML trainer's batch: float32 in [0, 1]
    assert x.dtype == torch.float32 and float(x.max()) <= 1.0
    x_all, _ = client_tensors(dataset[5][2])  # the plugin's read: the stored tensors, no copy
    assert x_all.dtype == torch.uint8 and x_all.data_ptr() == users[2].train_x.data_ptr()
    train_global = client_tensors(dataset[2])[0]
    assert train_global.data_ptr() == block.data_ptr() and len(train_global) == 6 * 24  # the block, not a copy
    assert torch.equal(model_inputs(x_all), scaled.users[2].train_x)
