"""The algorithm object's aggregation: bad client updates are rejected, the rest averaged."""

from collections import OrderedDict

import pytest
import torch

from fedml_perfedavg.core.errors import RunStopped
from fedml_perfedavg.core.guards import (
    UpdateCheck,
    nonfinite_clients,
    tensor_is_finite,
    update_distance,
    update_problem,
)

from tests.helpers_tiny import tiny_config


def _algorithm(**overrides):
    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    model = create_model("mlp", (1, 4, 4), 3, (5,))
    return create_algorithm("PerFedAvg", model, tiny_config(**overrides)), model.state_dict()


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_one_check_of_many_updates_names_what_the_per_tensor_checks_name(bad):
    """UpdateCheck (the reference flattened once, an update's distance in one pass) gives the
    distance the per-tensor sum gives, and names the first non-finite tensor: a parameter, a
    floating-point buffer outside the norm's keys, or none where only the reference is broken."""
    torch.manual_seed(0)
    reference = OrderedDict(w=torch.randn(7, 5), b=torch.randn(7), stat=torch.ones(3), count=torch.tensor(4))
    keys = ["w", "b"]
    check = UpdateCheck(reference, None, keys, 1.0)
    moved = OrderedDict(
        (k, v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in reference.items()
    )
    problem, norm = check.examine(moved)
    assert problem is None and norm == pytest.approx(update_distance(moved, reference, keys), rel=1e-12)
    assert check.bound == pytest.approx(float(torch.cat([reference[k].double().flatten() for k in keys]).norm()))
    for name in ("b", "stat"):
        broken = OrderedDict((k, v.clone()) for k, v in moved.items())
        broken[name][2] = bad
        assert check.examine(broken) == (f"{name}: non-finite values", None)
        assert update_problem(broken, reference, norm_keys=keys) == f"{name}: non-finite values"
    far = OrderedDict((k, v * 3) for k, v in moved.items())  # moved by about 2 x ||w||
    problem, norm = check.examine(far)
    assert "exceeds train_args.max_update_ratio=1.0" in problem and norm > check.bound
    broken_reference = OrderedDict((k, v.clone()) for k, v in reference.items())
    broken_reference["w"][0, 0] = bad
    problem, norm = UpdateCheck(broken_reference, 5.0, keys).examine(moved)
    per_tensor = update_distance(moved, broken_reference, keys)  # NaN or inf, as the per-tensor sum gives
    assert str(norm) == str(per_tensor) and (problem is None) == (not per_tensor > 5.0)


def test_rounds_without_acceptable_updates_are_skipped_then_the_run_stops():
    algorithm, before = _algorithm(max_skipped_rounds=2)
    bad = OrderedDict((k, torch.full_like(v, float("inf"))) for k, v in before.items())
    kept = algorithm.aggregate(0, [(1, bad)], before)
    assert all(torch.equal(kept[k], before[k]) for k in before)
    with pytest.raises(RunStopped, match="2 rounds had no acceptable client update"):
        algorithm.aggregate(1, [(1, bad)], before)
    assert algorithm.state_dict()["skipped_rounds"] == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_check_finds_every_nonfinite_value_and_nothing_else(bad):
    extremes = torch.tensor([3.4e38, -3.4e38, -0.0, 1e-45] * 1000)  # finite, their sum overflows
    assert tensor_is_finite(extremes) and tensor_is_finite(torch.empty(0))
    for position in (0, 1717, 3999):
        broken = extremes.clone()
        broken[position] = bad
        assert not tensor_is_finite(broken)
    stacked = {"w": extremes.reshape(1, 4000).repeat(5, 1), "b": torch.zeros(5, 3)}
    stacked["w"][3, 7] = bad
    stacked["b"][1, 2] = bad
    assert nonfinite_clients(stacked) == [1, 3]


def test_the_default_bound_refuses_an_update_that_moves_the_model_by_more_than_its_norm(caplog):
    """One client that uploads 1e30 everywhere, or twice the model, is refused under the defaults
    (train_args.max_update_ratio = 1) and the bound is logged; honest-sized updates pass."""
    algorithm, good = _algorithm()
    assert algorithm.settings.max_update_ratio == 1.0
    norm = float(torch.sqrt(sum((v.double() ** 2).sum() for v in good.values())))
    huge = OrderedDict((k, torch.full_like(v, 1e30)) for k, v in good.items())
    doubled = OrderedDict((k, 3 * v) for k, v in good.items())  # moved by 2 x ||w||
    honest = OrderedDict((k, v * 1.1) for k, v in good.items())  # moved by 0.1 x ||w||
    with caplog.at_level("INFO"):
        averaged = algorithm.aggregate(0, [(1, huge), (1, honest), (1, doubled)], good)
    assert algorithm.rejected == {0: 2}
    assert all(torch.equal(averaged[k], honest[k]) for k in good)
    assert f"train_args.max_update_ratio=1 x max(||w||, 1) ({norm:.4g} in round 0)" in caplog.text
    assert "exceeds train_args.max_update_ratio=1.0 x max(||w||, 1)" in update_problem(
        doubled, good, max_update_ratio=1.0
    )
    off, _ = _algorithm(max_update_ratio=None)
    off.aggregate(0, [(1, doubled)], good)
    assert off.rejected == {}


def test_the_bound_of_a_model_near_zero_is_one():
    zero = OrderedDict(w=torch.zeros(3, 3))
    assert update_problem(OrderedDict(w=torch.full((3, 3), 0.3)), zero, max_update_ratio=1.0) is None  # norm 0.9
    assert "= 1" in update_problem(OrderedDict(w=torch.full((3, 3), 0.4)), zero, max_update_ratio=1.0)  # 1.2


def test_buffers_stay_the_global_models_and_integer_counters_stay_integers():
    from torch import nn

    from fedml_perfedavg.algorithms.registry import create_algorithm

    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    algorithm = create_algorithm("PerFedAvg", model, tiny_config())
    state = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    lying = OrderedDict((k, v.clone()) for k, v in state.items())
    lying["2.running_mean"] += 1e6  # a client's buffers: noise or a lie, never averaged in
    honest = OrderedDict(
        (k, v + 0.01 if v.is_floating_point() and "running" not in k else v.clone()) for k, v in state.items()
    )
    averaged = algorithm.aggregate(0, [(1, lying), (1, honest)], state)
    assert torch.equal(averaged["2.running_mean"], state["2.running_mean"])
    assert averaged["2.num_batches_tracked"].dtype == torch.int64
    assert torch.allclose(averaged["1.weight"], state["1.weight"] + 0.005)


def test_the_average_keeps_integer_buffers_integers():
    from fedml_perfedavg.algorithms.base import average

    a = OrderedDict(w=torch.ones(2), n=torch.tensor(3))
    b = OrderedDict(w=torch.zeros(2), n=torch.tensor(4))
    out = average([(1, a), (1, b)], "uniform")
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4 and torch.equal(out["w"], torch.full((2,), 0.5))
