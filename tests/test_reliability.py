"""Guarded training, checked client updates, checkpoint/resume and determinism."""
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedml_perfedavg.config import SCHEMA, ConfigError, resolve
from fedml_perfedavg.data import FederatedData
from fedml_perfedavg.engine import BatchedSimulation
from fedml_perfedavg.evaluation import UserSplit
from fedml_perfedavg.guards import DivergenceError, RunStopped, update_problem
from fedml_perfedavg.partition import partition_indices, plan_users
from fedml_perfedavg.runner import run


def _data(num_users=6, seed=0, nan_user=None):
    g = torch.Generator().manual_seed(seed)
    users = []
    for i in range(num_users):
        x = torch.rand(24, 1, 4, 4, generator=g)
        if i == nan_user:
            x[3, 0, 0, 0] = float("nan")
        users.append(UserSplit(x, torch.randint(0, 3, (24,), generator=g), torch.rand(8, 1, 4, 4, generator=g),
                               torch.randint(0, 3, (8,), generator=g)))
    return FederatedData(users, 3, (1, 4, 4))


def _config(**overrides):
    base = dict(client_num_in_total=6, client_num_per_round=6, comm_round=6, local_steps=2, batch_size=8,
                meta_batch_size=8, hessian_batch_size=8, beta=0.1, alpha=0.05, show_progress=False,
                frequency_of_the_test=2, checkpoint_every=2, hidden_sizes=[5])
    base.update(overrides)
    return resolve({}, base)


@pytest.mark.parametrize("engine", ["batched", "fedml"])
def test_nan_in_one_clients_data_stops_the_run_naming_round_client_and_variant(tmp_path, engine):
    with pytest.raises(DivergenceError, match=r"round 0, client 4, PerFedAvg \(hf\): non-finite"):
        run(_config(simulation_engine=engine), str(tmp_path), data=_data(nan_user=4))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and "client 4" in summary["error"]


@pytest.mark.parametrize("engine", ["batched", "fedml"])
def test_skip_client_policy_drops_that_update_and_goes_on(tmp_path, engine):
    result = run(_config(on_divergence="skip_client", simulation_engine=engine), str(tmp_path),
                 data=_data(nan_user=4))
    assert result.summary["status"] == "finished" and result.summary["rounds"] == 6
    assert result.summary["rejected_updates"] == {str(r): 1 for r in range(6)}  # user 4 is in every round
    assert all(torch.isfinite(v).all() for v in result.aggregator.get_model_params().values())


def _aggregator(**overrides):
    from fedml_perfedavg.registry import algorithm_factory
    from fedml_perfedavg.models import create_model

    config = _config(**overrides)
    model = create_model("mlp", (1, 4, 4), 3, (5,))
    return algorithm_factory("PerFedAvg")(model, config, config.to_fedml_args())[1]


def test_aggregator_rejects_bad_updates_and_averages_the_rest():
    aggregator = _aggregator(max_update_norm=5.0)
    good = aggregator.get_model_params()
    shifted = OrderedDict((k, v + 0.01) for k, v in good.items())
    nan = OrderedDict((k, v.clone()) for k, v in good.items())
    nan["net.1.bias"][0] = float("nan")
    wrong_shape = OrderedDict((k, v.clone()) for k, v in good.items())
    wrong_shape["net.1.weight"] = torch.zeros(2, 2)
    far = OrderedDict((k, v + 10.0) for k, v in good.items())
    missing = OrderedDict(list(good.items())[:-1])
    updates = [(10, shifted), (10, nan), (10, wrong_shape), (10, far), (10, missing), (10, good)]
    accepted, _ = aggregator.on_before_aggregation(updates)
    assert len(accepted) == 2 and aggregator.rejected == {0: 4}
    averaged = aggregator.aggregate(accepted)
    assert all(torch.allclose(averaged[k], good[k] + 0.005) for k in good)
    assert "non-finite" in update_problem(nan, good)
    assert "shape" in update_problem(wrong_shape, good)
    assert "max_update_norm=5.0" in update_problem(far, good, 5.0)
    assert "missing ['net.3.bias']" in update_problem(missing, good)


def test_rounds_without_acceptable_updates_are_skipped_then_the_run_stops():
    aggregator = _aggregator(max_skipped_rounds=2)
    before = aggregator.get_model_params()
    bad = OrderedDict((k, torch.full_like(v, float("inf"))) for k, v in before.items())
    accepted, _ = aggregator.on_before_aggregation([(1, bad)])
    assert accepted == [] and all(torch.equal(aggregator.aggregate(accepted)[k], before[k]) for k in before)
    with pytest.raises(RunStopped, match="2 rounds had no acceptable client update"):
        aggregator.on_before_aggregation([(1, bad)])


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, monkeypatch):
    data = _data()
    full = run(_config(), str(tmp_path / "full"), data=data)
    original = BatchedSimulation.train_round

    def crash_at_round_3(self, round_idx):
        if round_idx == 3:
            raise KeyboardInterrupt("simulated kill")
        return original(self, round_idx)

    monkeypatch.setattr(BatchedSimulation, "train_round", crash_at_round_3)
    with pytest.raises(KeyboardInterrupt):
        run(_config(), str(tmp_path / "resumed"), data=data)
    assert (tmp_path / "resumed" / "checkpoint.pt").exists()
    assert not list((tmp_path / "resumed").glob("*.tmp"))
    monkeypatch.setattr(BatchedSimulation, "train_round", original)
    resumed = run(_config(), str(tmp_path / "resumed"), data=data, resume=True)
    a, b = full.aggregator.get_model_params(), resumed.aggregator.get_model_params()
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda h: [{k: v for k, v in e.items() if k != "wall_seconds"} for e in h]  # noqa: E731
    assert strip(full.summary["history"]) == strip(resumed.summary["history"])
    assert resumed.summary["per_user_accuracy"] == full.summary["per_user_accuracy"]


def test_same_config_and_seed_give_bit_identical_results(tmp_path):
    a = run(_config(), str(tmp_path / "a"), data=_data())
    b = run(_config(), str(tmp_path / "b"), data=_data())
    pa, pb = a.aggregator.get_model_params(), b.aggregator.get_model_params()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    c = run(_config(random_seed=1), str(tmp_path / "c"), data=_data())
    assert not all(torch.equal(pa[k], c.aggregator.get_model_params()[k]) for k in pa)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), half=st.integers(1, 10), a=st.integers(1, 10),
       partition=st.sampled_from(["paper", "paper_diff_hetero"]))
def test_partition_properties_for_any_seed(seed, half, a, partition):
    a *= 2
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(10), 5 * a * half))
    plans = plan_users(2 * half, a, partition, seed)
    users = partition_indices(labels, plans, seed)
    flat = np.concatenate(users)
    assert len(flat) == len(np.unique(flat))  # every sample used at most once
    for idx, plan in zip(users, plans):
        assert {c: int((labels[idx] == c).sum()) for c in plan.class_counts} == plan.class_counts
        assert set(labels[idx].tolist()) == set(plan.class_counts)


NUMERIC_OR_CHOICE = [k for k in SCHEMA if k.kind in (int, float, bool) or k.choices]


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(NUMERIC_OR_CHOICE),
       value=st.one_of(st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(-10 ** 6, 10 ** 6), st.booleans(), st.none(), st.lists(st.integers(), max_size=3)))
def test_random_config_values_are_accepted_or_rejected_with_a_clear_message(key, value):
    try:
        resolve({}, {key.name: value})
    except ConfigError as err:
        assert key.name in str(err) or "client_num" in str(err)
