"""Any model whose forward is a deterministic function of its parameters trains and is
evaluated, every variant: hand-batched where it can, vmapped where vmap can, per-client (never
calling vmap) otherwise, the log saying which and why."""

import logging

import pytest
import torch
from torch import nn

from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.data.loading import FederatedData
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_config, tiny_data


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: vmap refuses it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        return out if out.detach().sum().item() > -1e9 else -out


class InPlace(nn.Module):
    """In-place activations, as torchvision-style models write them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.relu, self.elu = nn.ReLU(inplace=True), nn.ELU(inplace=True)

    def forward(self, x):
        return self.fc3(self.elu(self.fc2(self.relu(self.fc1(x.flatten(1))))))


def _tokens(num_users=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    users = [
        UserSplit(
            torch.randint(1, 20, (24, 5), generator=g),
            torch.randint(0, 20, (24,), generator=g),
            torch.randint(1, 20, (8, 5), generator=g),
            torch.randint(0, 20, (8,), generator=g),
        )
        for _ in range(num_users)
    ]
    return FederatedData(users, 20, (5,))


@pytest.mark.parametrize("variant", ["fo", "hf", "exact"])
@pytest.mark.parametrize("kind", ["data_dependent", "in_place", "fedml_rnn"])
def test_models_vmap_cannot_batch_or_that_are_unusual_train_and_evaluate(tmp_path, caplog, kind, variant):
    torch.manual_seed(0)
    if kind == "fedml_rnn":
        from fedml.model.nlp.rnn import RNN_OriginalFedAvg

        model, data = RNN_OriginalFedAvg(embedding_dim=4, vocab_size=20, hidden_size=8), _tokens()
    else:
        model, data = (DataDependent() if kind == "data_dependent" else InPlace()), tiny_data()
    config = tiny_config(perfedavg_variant=variant, comm_round=2, checkpoint_every=0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO):
        result = run(config, str(tmp_path / kind), data=data, model=model)
    summary = result.summary
    assert summary["status"] == "finished" and summary["aggregate_calls"] == 2
    assert 0.0 <= summary["personalized_accuracy"] <= 1.0
    changed = any(not torch.equal(v, start[k]) for k, v in result.final_state.items())
    assert changed
    # the module handed in holds the final global model, as after FedML's own FedAvg
    assert all(torch.equal(v.cpu(), model.state_dict()[k]) for k, v in result.final_state.items())
    if kind == "data_dependent":
        assert "DataDependent: torch.func.vmap cannot batch its gradients" in caplog.text
        assert "the per-client path" in caplog.text
    else:
        assert "cannot batch" not in caplog.text
    if kind == "fedml_rnn" and variant == "exact":
        assert "no forward-mode derivative" in caplog.text and "reverse-over-reverse" in caplog.text


def test_fedml_model_create_seeds_the_model_without_reseeding_the_callers_rng():
    from argparse import Namespace

    import fedml

    args = Namespace(model="mlp", dataset="mnist", random_seed=0, hidden_sizes=[5])
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = fedml.model.create(args, 10)
    assert torch.equal(torch.rand(3), expected)  # the caller's stream goes on as if nothing happened
    second = fedml.model.create(args, 10)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in first.state_dict().items())  # same model each time
