"""The algorithm object's aggregation: bad client updates are rejected, the rest averaged."""
from collections import OrderedDict

import pytest
import torch

from fedml_perfedavg.core.guards import RunStopped, nonfinite_clients, tensor_is_finite, update_problem

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
