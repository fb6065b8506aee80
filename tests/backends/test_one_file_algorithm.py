"""Issue 42: an algorithm is one file. ``tests/algorithms/clipped_fedsgd.py`` declares its maths
and a setting of its own, and registers itself; a FedML user's one-line entry points, with that
file imported, run it on sp, MPI and cross-silo, with no other module touched."""

import json
import sys

import pytest
import torch

from fedml_perfedavg.fedml_bridge.cross_silo.addresses import write_ipconfig

from tests.backends.test_fedml_entry_points import MPIRUN, _run
from tests.helpers import example_yaml, needs_mnist
from tests.helpers_tiny import tiny_config

CLIP = 0.02  # far below an MNIST gradient's norm: every step moves the model by beta * CLIP exactly
BETA = 0.05
EDITS = dict(federated_optimizer="ClippedFedSGD", clip_norm=CLIP, learning_rate=BETA, local_steps=2)
ENTRY = {
    "sp": "fedml.run_simulation()",
    "MPI": "fedml.run_simulation(backend='MPI')",
    "server": "fedml.run_cross_silo_server()",
    "client": "fedml.run_cross_silo_client()",
}


def _one_line(call):
    return f'-c "import fedml_perfedavg, fedml, tests.algorithms.clipped_fedsgd; {ENTRY[call]}"'


@needs_mnist
def test_an_algorithm_in_one_file_runs_on_sp_mpi_and_cross_silo(mnist_root, tmp_path):
    runs = {}
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "sp", tmp_path / "sp", **EDITS)
    _run(["sh", "-c", f"{sys.executable} {_one_line('sp')} --cf {path}"], tmp_path)
    runs["sp"] = tmp_path / "sp" / "sp"
    if MPIRUN is not None:
        path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "mpi", **EDITS)
        _run([MPIRUN, "-n", "3", "sh", "-c", f"{sys.executable} {_one_line('MPI')} --cf {path}"], tmp_path)
        runs["mpi"] = tmp_path / "mpi" / "mpi"
    address_file = write_ipconfig(str(tmp_path / "ipconfig.csv"), 3)
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "silo",
        tmp_path / "silo",
        grpc_ipconfig_path=address_file,
        **EDITS,
    )
    script = " & ".join(
        f"{sys.executable} {_one_line('server' if r == 0 else 'client')} --cf {path} --rank {r} "
        f"--role {'server' if r == 0 else 'client'} --run_id 7"
        for r in range(3)
    )
    _run(["sh", "-c", script + " & wait"], tmp_path)
    runs["silo"] = tmp_path / "silo" / "silo"

    reference = torch.load(runs["sp"] / "model.pt")
    for backend, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["aggregate_calls"] == 3, backend
        train_args = summary["config"]["train_args"]
        assert train_args["federated_optimizer"] == "ClippedFedSGD" and train_args["clip_norm"] == CLIP, backend
        model = torch.load(run_dir / "model.pt")
        for k in reference:
            torch.testing.assert_close(model[k], reference[k], rtol=1e-5, atol=1e-6, msg=backend)


def test_its_setting_joins_the_config_the_docs_table_and_the_fingerprint():
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.fedml_bridge.cross_silo.agreement import disagreement, fingerprint
    from fedml_perfedavg.run.config import ConfigError, resolve
    from fedml_perfedavg.run.reference import markdown_table

    config = resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.5}})
    assert config.clip_norm == 0.5 and config.sections()["train_args"]["clip_norm"] == 0.5
    with pytest.raises(ConfigError, match=r"train_args.clip_norm=0.0: must be > 0"):
        resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.0}})
    assert "| train_args | `clip_norm` | `1.0` | > 0 | ClippedFedSGD: each local step's" in markdown_table()
    state = {"w": torch.zeros(2)}
    other = resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.25}})
    why = disagreement(fingerprint(config, state), fingerprint(other, state), 2)
    assert why is not None and "train_args.clip_norm" in why


def test_its_setting_is_what_its_clients_read(tmp_path):
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.models import create_model
    from fedml_perfedavg.run.runner import run

    from tests.helpers_tiny import tiny_data

    moved = {}
    for clip in (CLIP, 10 * CLIP):
        config = tiny_config(
            federated_optimizer="ClippedFedSGD", clip_norm=clip, beta=BETA, local_steps=2, comm_round=3
        )
        result = run(config, str(tmp_path / str(clip)), data=tiny_data())
        torch.manual_seed(0)  # the run's own initial model (runner: seeded by random_seed)
        start = create_model("mlp", (1, 4, 4), 3, list(config.hidden_sizes)).state_dict()
        moved[clip] = float(torch.sqrt(sum(((result.final_state[k] - start[k]) ** 2).sum() for k in start)))
    # 3 rounds of 2 steps, each moving a client's model by beta * clip_norm at most (tiny data's
    # gradients are larger than clip_norm): the average of the clients' moves cannot go further.
    assert 0 < moved[CLIP] <= 6 * BETA * CLIP * (1 + 1e-5)
    assert moved[10 * CLIP] > 3 * moved[CLIP]
