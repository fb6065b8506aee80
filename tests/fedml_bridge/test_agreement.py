"""What server and silos must agree on: a disagreement names the key and both values; data that
does not fit the model is named; an announcement fits the wire's schema."""

import pytest
import torch
from torch import nn

from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.net import wire
from fedml_perfedavg.silo.server.agreement import (
    ADDRESSES,
    ARCHITECTURE,
    address_table,
    addresses_seen,
    data_problem,
    disagreement,
    fingerprint,
    hello,
)
from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.config import resolve


def _config(**overrides):
    return resolve({}, {"training_type": "cross_silo", "backend": "GRPC", "insecure": True, **overrides})


def _state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


MODEL = create_model("mlp", (1, 28, 28), 10, [80, 60])


def test_identical_configs_agree_and_1_equals_1_0():
    server = fingerprint(_config(), _state(MODEL))
    assert disagreement(server, fingerprint(_config(), _state(MODEL)), 2) is None
    assert disagreement({"train_args.alpha": 1}, {"train_args.alpha": 1.0}, 2) is None
    assert disagreement({"x": True}, {"x": 1}, 2) is not None


@pytest.mark.parametrize(
    "changes,key,mine,theirs",
    [
        ({"alpha": 0.05}, "train_args.alpha", "0.01", "0.05"),
        ({"perfedavg_variant": "fo"}, "train_args.perfedavg_variant", "'hf'", "'fo'"),
        ({"random_seed": 3}, "common_args.random_seed", "0", "3"),
        ({"meta_batch_size": 20}, "train_args.meta_batch_size", "40", "20"),
        ({"silo_data": "own"}, "comm_args.silo_data", "'shared'", "'own'"),
        ({"min_summed_silos": 4}, "secagg_args.min_summed_silos", "3", "4"),
        ({"max_colluding_silos": 1}, "secagg_args.max_colluding_silos", "0", "1"),
    ],
)
def test_a_disagreement_names_the_key_and_both_values(changes, key, mine, theirs):
    server = fingerprint(_config(), _state(MODEL))
    silo = fingerprint(_config(**changes), _state(MODEL))
    assert disagreement(server, silo, 2) == (
        f"silo rank 2 disagrees with the server on {key}: the server has {mine}, the silo has {theirs}"
    )


def test_another_architecture_is_a_disagreement():
    other = create_model("mlp", (1, 28, 28), 10, [80, 40])
    problem = disagreement(fingerprint(_config(), _state(MODEL)), fingerprint(_config(), _state(other)), 3)
    assert problem.startswith(f"silo rank 3 disagrees with the server on {ARCHITECTURE} (a hash)")


TABLE = {0: ("198.18.1.1", 8890), 1: ("198.18.1.2", 8891), 2: ("198.18.2.2", 8892)}


def test_the_address_rows_a_silo_uses_must_be_the_servers():
    """Issue 55 item 5: organization 2's file gives its own port as 8899; the server sends to 8892
    (it was 'nothing listens there: it has ended' and a silo that hung). Rows the silo does not use
    (another organization's) are not compared; an IPv4 address compares as the address file reads it."""
    server = {**fingerprint(_config(), _state(MODEL)), ADDRESSES: address_table(TABLE)}
    same = {**fingerprint(_config(), _state(MODEL)), ADDRESSES: addresses_seen(TABLE, 2)}
    assert disagreement(server, same, 2) is None
    assert disagreement(server, {**same, ADDRESSES: addresses_seen({**TABLE, 1: ("10.0.0.9", 1)}, 2)}, 2) is None
    moved = {**same, ADDRESSES: addresses_seen({**TABLE, 2: ("198.18.2.2", 8899)}, 2)}
    assert disagreement(server, moved, 2) == (
        f"silo rank 2's address file ({ADDRESSES}) differs from the server's: rank 2 is '198.18.2.2:8899' "
        f"there and 198.18.2.2:8892 here; every party must use the same file (docs/deployment.md)"
    )
    elsewhere = {**same, ADDRESSES: addresses_seen({**TABLE, 0: ("198.18.9.9", 8890)}, 2)}
    assert "rank 0 is '198.18.9.9:8890' there and 198.18.1.1:8890 here" in disagreement(server, elsewhere, 2)
    assert "rank 0 is '(no row)' there" in disagreement(server, {**same, ADDRESSES: None}, 2)
    announced = hello(same, None, None)
    assert wire.SCHEMA[wire.CLIENT_STATUS][wire.HELLO][0](announced)  # the wire takes it


def _user(shape=(1, 28, 28), classes=(0, 4), dtype=torch.float32):
    x = torch.zeros((4, *shape), dtype=dtype)
    y = torch.tensor([classes[0], classes[1], classes[0], classes[1]])
    return UserSplit(x, y, x[:2], y[:2])


def test_an_announcement_fits_the_wire_and_data_that_fits_the_model_passes():
    announced = hello(fingerprint(_config(), _state(MODEL)), 0, _user())
    assert announced["train"] == 4 and announced["test"] == 2 and announced["classes"] == [0, 4]
    assert wire.SCHEMA[wire.CLIENT_STATUS][wire.HELLO][0](announced)
    assert wire.SCHEMA[wire.CLIENT_STATUS][wire.HELLO][0](hello({"a": 1}, None, None))
    assert data_problem(MODEL, announced, 1) is None


@pytest.mark.parametrize(
    "user,words",
    [
        (
            _user(shape=(3, 32, 32)),
            "silo rank 1's data (samples of shape (3, 32, 32), float32; labels up to 4) does not fit "
            "the model: RuntimeError",
        ),
        (_user(classes=(0, 12)), "it has 10 outputs, so labels must be 0..9"),
        (_user(shape=(4000, 4000)), "a sample of 16000000 values is larger than any model here takes"),
    ],
)
def test_data_that_does_not_fit_the_model_is_named(user, words):
    announced = hello({}, 0, user)
    assert words in data_problem(MODEL, announced, 1)


def test_the_probe_does_not_touch_the_servers_model():
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.BatchNorm1d(10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert data_problem(model, hello({}, 0, _user()), 1) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training
