"""What a FedML user's script meets with the plugin imported (FedML's own step-by-step main in a
subprocess): algorithm names in any case, and a name nobody runs stopped in ``fedml.init``."""
import json
import os
import subprocess
import sys

from tests.helpers import EXAMPLE, REPO, example_yaml, needs_mnist

SCRIPT = str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py")


def _main(tmp_path, path):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, SCRIPT, "--cf", path], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)})


@needs_mnist
def test_plugin_names_match_in_any_case_and_unknown_ones_stop_in_fedml_init(mnist_root, tmp_path):
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "lower", tmp_path / "runs",
                        federated_optimizer="perfedavg")
    out = _main(tmp_path, path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    summary = json.loads((tmp_path / "runs" / "lower" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["config"]["train_args"]["federated_optimizer"] == "PerFedAvg"

    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "typo", tmp_path / "runs",
                        federated_optimizer="PerFedAvgg")
    out = _main(tmp_path, path)
    assert out.returncode != 0
    assert ("ConfigError: train_args.federated_optimizer='PerFedAvgg': neither a plugin algorithm "
            "(['PerFedAvg', 'FedAvgUpdate', 'FedAvgARUBA']) nor one of FedML's own") in out.stderr
    assert "did you mean 'PerFedAvg'?" in out.stderr
    assert "in init" in out.stderr and "load(" not in out.stderr  # raised in fedml.init, before data loads
    assert not (tmp_path / "runs" / "typo").exists()
