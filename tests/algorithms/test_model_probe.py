"""The start-up probe of what a model allows runs on a batch like the run's: BatchNorm is batched
(it was sent to the per-client path, blamed on vmap, for a one-sample probe), and a model that
cannot train on the data at all stops the run at start with its own reason."""

import pytest
import torch
from torch import nn

from fedml_perfedavg.algorithms.model_probe import ModelMismatch
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_config, tiny_data


def _batchnorm():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("variant", ["hf", "exact"])
def test_batchnorm_is_probed_on_a_batch_of_the_runs_size_and_the_real_cause_named(variant):
    """vmap batches it (the one-sample probe said it could not); but vmap's batched kernels give a
    client other bits than alone, so clients train one by one: every backend computes a client alike."""
    model = _batchnorm()
    algorithm = create_algorithm("PerFedAvg", model, tiny_config(perfedavg_variant=variant))
    x, y = torch.rand(8, 1, 4, 4), torch.randint(0, 3, (8,))
    [note] = algorithm.probe_model(model.state_dict(), x, y)
    assert algorithm.paths.vmappable and algorithm.paths.forward_ad and not algorithm.paths.groups_exactly
    assert "vmap's batched kernels give a client other bits than training it alone" in note
    assert "cannot batch" not in note


def test_a_linear_chain_keeps_its_hand_batched_path():
    from fedml_perfedavg.models import create_model

    model = create_model("mlp", (1, 4, 4), 3, (5,))
    algorithm = create_algorithm("PerFedAvg", model, tiny_config())
    assert algorithm.probe_model(model.state_dict(), torch.rand(8, 1, 4, 4), torch.randint(0, 3, (8,))) == []
    assert algorithm.paths.groups_exactly


def test_a_model_that_cannot_take_the_samples_is_named_with_its_own_error():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 3))  # 3 channels; the data has 1
    algorithm = create_algorithm("PerFedAvg", conv, tiny_config())
    with pytest.raises(
        ModelMismatch,
        match=r"a batch of 8 samples of shape \(1, 4, 4\) \(torch.float32\): "
        r"RuntimeError: .*expected input\[8, 1, 4, 4\] to have 3 channels",
    ):
        algorithm.probe_model(conv.state_dict(), torch.rand(8, 1, 4, 4), torch.randint(0, 3, (8,)))


def test_such_a_run_stops_at_start_naming_the_model_and_the_dataset(tmp_path):
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(16, 3))
    with pytest.raises(
        ConfigError,
        match=r"the model \(Sequential; your own module, not model_args.model\) does not fit "
        r"data_args.dataset='mnist': it cannot compute a loss",
    ):
        run(tiny_config(), str(tmp_path / "run"), data=tiny_data(), model=conv)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_batchnorm_model_trains_client_by_client_and_says_why(tmp_path, caplog):
    with caplog.at_level("INFO"):
        result = run(tiny_config(comm_round=2), str(tmp_path / "run"), data=tiny_data(), model=_batchnorm())
    assert result.summary["status"] == "finished"
    assert "vmap cannot batch" not in caplog.text
    assert "clients one by one (vmapped, a client's result would depend on which clients share" in caplog.text
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert saved["2.num_batches_tracked"].dtype == torch.int64  # it was stored as float32
