"""Every shipped YAML (the Table 1 cells, the quick start) runs through FedML's stock main
script plus one import, one short round each: MNIST on the real files, CIFAR-10 on generated
ones. The MPI and cross-silo twins differ from their sp cell only in how they are launched."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from fedml_perfedavg.run.schema import BY_NAME

from tests.helpers import EXAMPLE, REPO

SCRIPT = str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py")
YAMLS = sorted((REPO / "yaml_configs").glob("*.yaml"))
SP_YAMLS = [p for p in YAMLS if not p.stem.endswith(("_mpi", "_silo"))]
SHORT = dict(comm_round=1, client_num_per_round=2, local_steps=1)
SMALL_CIFAR = dict(
    client_num_in_total=10,
    images_per_class=8,
    test_images_per_class=2,
    batch_size=8,
    meta_batch_size=8,
    hessian_batch_size=8,
)


def _edit(config, edits):
    for key, value in edits.items():
        config.setdefault(BY_NAME[key].metadata["section"], {})[key] = value


@pytest.mark.parametrize("path", SP_YAMLS, ids=[p.stem for p in SP_YAMLS])
def test_shipped_yaml_runs_through_fedml_stock_main(path, request, tmp_path, monkeypatch):
    config = yaml.safe_load(path.read_text())
    dataset = config["data_args"]["dataset"]
    data_root = request.getfixturevalue("fake_cifar_root" if dataset == "cifar10" else "mnist_root")
    _edit(
        config,
        dict(
            SHORT,
            data_cache_dir=data_root,
            output_dir=str(tmp_path),
            run_name="run",
            show_progress=False,
            **(SMALL_CIFAR if dataset == "cifar10" else {}),
        ),
    )
    edited = tmp_path / path.name
    edited.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--cf", str(edited)])
    runpy.run_path(SCRIPT, run_name="__main__")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 1 and summary["aggregate_calls"] == 1
    assert summary["config"]["train_args"]["federated_optimizer"] == config["train_args"]["federated_optimizer"]
    assert summary["config"]["model_args"]["model"] == "mlp"
    assert 0.0 <= summary["personalized_accuracy"] <= 1.0


@pytest.mark.fast  # a pure check, though filed beside the runs it guards
@pytest.mark.parametrize("path", [p for p in YAMLS if p not in SP_YAMLS], ids=lambda p: p.stem)
def test_mpi_and_silo_yamls_are_their_sp_cell_launched_differently(path):
    twin = yaml.safe_load(Path(str(path).rsplit("_", 1)[0] + ".yaml").read_text())
    config = yaml.safe_load(path.read_text())
    for section in config:
        if section not in ("common_args", "comm_args"):
            assert config[section] == twin[section], section
    assert {k: v for k, v in config["common_args"].items() if k != "training_type"} == {
        k: v for k, v in twin["common_args"].items() if k != "training_type"
    }
