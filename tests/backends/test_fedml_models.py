"""FedML's own models (``fedml.model.create``) through FedML's stock main script plus one import:
Per-FedAvg is model-agnostic. ``resnet56`` has BatchNorm (normalizing with each batch's own
statistics; its running statistics travel unchanged), ``cnn`` has dropout (off: the
meta-gradient needs a deterministic network)."""

import json
import runpy
import sys

import torch
import yaml

from tests.helpers import EXAMPLE

SCRIPT = str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py")


def _stock_main(tmp_path, monkeypatch, run_name, data, model, **train):
    config = yaml.safe_load((EXAMPLE / "fedml_config.yaml").read_text())
    config["data_args"].update(data)
    config["model_args"]["model"] = model
    config["train_args"].update(
        client_num_in_total=4, client_num_per_round=2, comm_round=2, local_steps=2, batch_size=4, **train
    )
    config["validation_args"]["frequency_of_the_test"] = 1
    config["common_args"].update(output_dir=str(tmp_path / "runs"), run_name=run_name)
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--cf", str(path)])
    runpy.run_path(SCRIPT, run_name="__main__")
    run_dir = tmp_path / "runs" / run_name
    return json.loads((run_dir / "summary.json").read_text()), torch.load(run_dir / "model.pt")


def test_fedml_resnet56_with_batchnorm_on_cifar10(fake_cifar_root, tmp_path, monkeypatch, caplog):
    """On the batched engine, client by client: vmapped, a client's result would depend on the
    clients sharing its computation (resnet56 with 4-sample batch statistics amplifies such
    differences), so every backend computes each client alone (tests/backends/
    test_same_model_everywhere.py: the same bits on sp, MPI and cross-silo)."""
    data = dict(dataset="cifar10", data_cache_dir=fake_cifar_root, images_per_class=4, test_images_per_class=2)
    with caplog.at_level("INFO"):
        summary, model = _stock_main(tmp_path, monkeypatch, "resnet", data, "resnet56")
    assert "ResNet has BatchNorm" in caplog.text and "cannot be vmapped" not in caplog.text
    assert "the batched engine" in caplog.text and "clients one by one (vmapped, a client's result would" in caplog.text
    assert summary["status"] == "finished" and summary["aggregate_calls"] == 2
    assert summary["config"]["model_args"]["model"] == "resnet56"
    assert len(summary["per_user_accuracy"]) == 4
    batchnorm = [k for k in model if k.endswith("running_mean")]
    assert len(batchnorm) > 50  # resnet56's BatchNorm layers
    for key in batchnorm:  # never updated nor used: still their initial values
        assert torch.equal(model[key], torch.zeros_like(model[key]))
        assert torch.equal(model[key.replace("running_mean", "running_var")], torch.ones_like(model[key]))
    assert not torch.allclose(model["bn1.weight"], torch.ones_like(model["bn1.weight"]))  # it trained


def test_fedml_cnn_with_dropout_on_mnist(mnist_root, tmp_path, monkeypatch):
    from fedml_perfedavg.fedml_bridge.bootstrap import import_fedml

    fedml = import_fedml()
    summary, model = _stock_main(
        tmp_path,
        monkeypatch,
        "cnn",
        dict(data_cache_dir=mnist_root, images_per_class=20, test_images_per_class=4),
        "cnn",
        perfedavg_variant="exact",
    )
    assert summary["status"] == "finished" and summary["aggregate_calls"] == 2 and summary["rounds"] == 2
    torch.manual_seed(0)
    start = fedml.model.create(type("Args", (), {"model": "cnn", "dataset": "mnist", "random_seed": 0})(), 10)
    assert set(model) == set(start.state_dict())
    assert any(not torch.equal(model[k], v) for k, v in start.state_dict().items())  # it trained
    assert all(0.0 <= a <= 1.0 for a in summary["per_user_accuracy"])
