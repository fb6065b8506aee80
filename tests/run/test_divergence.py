"""Guarded training: a client whose update goes non-finite stops the run or is dropped."""

import json

import pytest
import torch

from fedml_perfedavg.core.errors import DivergenceError
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_config, tiny_data


@pytest.mark.parametrize("engine", ["batched", pytest.param("fedml", marks=pytest.mark.backend)])
def test_nan_in_one_clients_data_stops_the_run_naming_round_client_and_variant(tmp_path, engine):
    with pytest.raises(DivergenceError, match=r"round 0, client 4, PerFedAvg \(hf\): non-finite"):
        run(tiny_config(simulation_engine=engine), str(tmp_path), data=tiny_data(nan_user=4))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and "client 4" in summary["error"]


@pytest.mark.parametrize("engine", ["batched", pytest.param("fedml", marks=pytest.mark.backend)])
def test_skip_client_policy_drops_that_update_and_goes_on(tmp_path, engine):
    result = run(
        tiny_config(on_divergence="skip_client", simulation_engine=engine), str(tmp_path), data=tiny_data(nan_user=4)
    )
    assert result.summary["status"] == "finished" and result.summary["rounds"] == 6
    assert result.summary["rejected_updates"] == {str(r): 1 for r in range(6)}  # user 4 is in every round
    assert all(torch.isfinite(v).all() for v in result.final_state.values())
