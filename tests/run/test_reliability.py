"""Guarded training, checked client updates, checkpoint/resume and determinism."""
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedml_perfedavg.run.config import ConfigError, resolve
from fedml_perfedavg.run.config import settings as config_settings
from fedml_perfedavg.data.loading import FederatedData
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.core.guards import DivergenceError, RunStopped, update_problem
from fedml_perfedavg.data.partition import partition_indices, plan_users
from fedml_perfedavg.run.runner import run


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
    assert all(torch.isfinite(v).all() for v in result.final_state.values())


def _algorithm(**overrides):
    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    model = create_model("mlp", (1, 4, 4), 3, (5,))
    return create_algorithm("PerFedAvg", model, _config(**overrides)), model.state_dict()


def test_aggregation_rejects_bad_updates_and_averages_the_rest():
    algorithm, good = _algorithm(max_update_norm=5.0)
    shifted = OrderedDict((k, v + 0.01) for k, v in good.items())
    nan = OrderedDict((k, v.clone()) for k, v in good.items())
    nan["net.1.bias"][0] = float("nan")
    wrong_shape = OrderedDict((k, v.clone()) for k, v in good.items())
    wrong_shape["net.1.weight"] = torch.zeros(2, 2)
    far = OrderedDict((k, v + 10.0) for k, v in good.items())
    missing = OrderedDict(list(good.items())[:-1])
    updates = [(10, shifted), (10, nan), (10, wrong_shape), (10, far), (10, missing), (10, good)]
    averaged = algorithm.aggregate(0, updates, good)
    assert algorithm.rejected == {0: 4}
    assert all(torch.allclose(averaged[k], good[k] + 0.005) for k in good)
    assert "non-finite" in update_problem(nan, good)
    assert "shape" in update_problem(wrong_shape, good)
    assert "max_update_norm=5.0" in update_problem(far, good, 5.0)
    assert "missing ['net.3.bias']" in update_problem(missing, good)


def test_rounds_without_acceptable_updates_are_skipped_then_the_run_stops():
    algorithm, before = _algorithm(max_skipped_rounds=2)
    bad = OrderedDict((k, torch.full_like(v, float("inf"))) for k, v in before.items())
    kept = algorithm.aggregate(0, [(1, bad)], before)
    assert all(torch.equal(kept[k], before[k]) for k in before)
    with pytest.raises(RunStopped, match="2 rounds had no acceptable client update"):
        algorithm.aggregate(1, [(1, bad)], before)
    assert algorithm.state_dict()["skipped_rounds"] == 2


def test_a_damaged_checkpoint_falls_back_to_the_previous_one_or_names_the_files(tmp_path, caplog):
    from fedml_perfedavg.run import checkpoint

    model = {"w": torch.ones(2)}
    checkpoint.save(str(tmp_path), 2, model, {"algorithm": {}})
    checkpoint.save(str(tmp_path), 4, model, {"algorithm": {}})
    (tmp_path / "checkpoint.pt").write_bytes((tmp_path / "checkpoint.pt").read_bytes()[:100])  # truncated
    with caplog.at_level("WARNING"):
        assert checkpoint.load(str(tmp_path))["next_round"] == 2
    assert "is damaged; resuming from the previous one" in caplog.text
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no readable checkpoint: .*checkpoint.pt .*checkpoint.prev.pt"):
        checkpoint.load(str(tmp_path))


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
    a, b = full.final_state, resumed.final_state
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda h: [{k: v for k, v in e.items() if k != "wall_seconds"} for e in h]  # noqa: E731
    assert strip(full.summary["history"]) == strip(resumed.summary["history"])
    assert resumed.summary["per_user_accuracy"] == full.summary["per_user_accuracy"]


def test_same_config_and_seed_give_bit_identical_results(tmp_path):
    a = run(_config(), str(tmp_path / "a"), data=_data())
    b = run(_config(), str(tmp_path / "b"), data=_data())
    pa, pb = a.final_state, b.final_state
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    c = run(_config(random_seed=1), str(tmp_path / "c"), data=_data())
    assert not all(torch.equal(pa[k], c.final_state[k]) for k in pa)


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


NUMERIC_OR_CHOICE = [f for f in config_settings() if f.metadata["kind"] in (int, float, bool) or f.metadata["choices"]]


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(NUMERIC_OR_CHOICE),
       value=st.one_of(st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(-10 ** 6, 10 ** 6), st.booleans(), st.none(), st.lists(st.integers(), max_size=3)))
def test_random_config_values_are_accepted_or_rejected_with_a_clear_message(key, value):
    try:
        config = resolve({}, {key.name: value})
    except ConfigError as err:
        assert key.name in str(err) or "client_num" in str(err) or "batch_size" in str(err)
    else:
        assert getattr(config, key.name) == value or (value is None and key.default is None) or \
            float(getattr(config, key.name)) == float(value)


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "client_num_in_total": st.integers(-2, 120), "client_num_per_round": st.integers(-1, 60),
    "images_per_class": st.one_of(st.none(), st.integers(-2, 2000)), "batch_size": st.integers(-1, 1200),
    "hessian_batch_size": st.one_of(st.none(), st.integers(0, 600)), "new_user_fraction": st.floats(-0.5, 1.5),
    "partition_method": st.sampled_from(["paper", "paper_diff_hetero", "hetero"]),
    "dataset": st.sampled_from(["mnist", "cifar10", "femnist"]), "backend": st.sampled_from(["sp", "MPI", "GRPC"]),
    "training_type": st.sampled_from(["simulation", "cross_silo"]), "min_clients_per_round": st.integers(0, 12),
    "federated_optimizer": st.sampled_from(["PerFedAvg", "FedAvgUpdate", "FedAvg", "PerFedAv"]),
    "beta": st.floats(-1, 1), "learning_rate": st.floats(0, 1)}))
def test_whole_configs_are_valid_run_setups_or_one_clean_error(values):
    """Drawn whole configs: either every rule holds (the split fits the dataset, batches fit the
    smallest user) or the error names a key."""
    from fedml_perfedavg.data.loading import DATASETS
    from fedml_perfedavg.data.partition import plan_users

    try:
        config = resolve({}, dict(values))
    except ConfigError as err:
        assert "=" in str(err)  # section.key=value
        return
    assert 1 <= config.client_num_per_round <= config.client_num_in_total
    if config.partition_method in ("paper", "paper_diff_hetero"):
        spec = DATASETS[config.dataset]
        plans = plan_users(config.client_num_in_total, config.images_per_class or spec.images_per_class,
                           config.partition_method, config.random_seed)
        assert max(config.batch_sizes) <= min(p.total for p in plans)
        for cls, have in enumerate(spec.train_class_counts):
            assert sum(p.class_counts.get(cls, 0) for p in plans) <= have
