"""FedML's other entry points, as a user would call them: ``fedml.run_simulation(backend=...)``
and ``fedml.run_cross_silo_server()`` / ``run_cross_silo_client()`` with ``PerFedAvg``; and a
user's own trainer/aggregator pair handed to ``FedMLRunner`` (FedML's ``FedAvg``), which must
really run on sp, MPI and cross-silo rather than be silently replaced by FedML's classes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedml_perfedavg.net.addresses import write_ipconfig

from tests.helpers import REPO, example_yaml, needs_mnist, offline

MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
OWN_PAIR = str(Path(__file__).with_name("own_pair_main.py"))


def _run(command, tmp_path, timeout=300):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    out = subprocess.run(
        offline(command),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out


def _silo_command(script_args, path):
    """Server first; the silos once it listens (FedML's own gRPC client gives up at once on an
    unreachable server, so its silos must not start before it)."""
    server = f"{sys.executable} {script_args} --cf {path} --rank 0 --role server --run_id 7"
    silos = " & ".join(
        f"{sys.executable} {script_args} --cf {path} --rank {r} --role client --run_id 7" for r in (1, 2)
    )
    return [
        "sh",
        "-c",
        f"{server} > server.log 2>&1 & until grep -q 'rank 0 listening on' server.log; do "
        f"sleep 0.2; done; {silos} & wait; cat server.log",
    ]


ONE_LINE = {
    "sp": "fedml.run_simulation()",
    "MPI": "fedml.run_simulation(backend='MPI')",
    "server": "fedml.run_cross_silo_server()",
    "client": "fedml.run_cross_silo_client()",
}


def _one_line(call):
    return f'-c "import fedml_perfedavg, fedml; {ONE_LINE[call]}"'


@needs_mnist
def test_fedml_one_line_entry_points_run_perfedavg(mnist_root, tmp_path):
    runs = {}
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "sp", tmp_path / "sp")
    _run(["sh", "-c", f"{sys.executable} {_one_line('sp')} --cf {path}"], tmp_path)
    runs["sp"] = tmp_path / "sp" / "sp"
    if MPIRUN is not None:
        path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "mpi")
        _run([MPIRUN, "-n", "3", "sh", "-c", f"{sys.executable} {_one_line('MPI')} --cf {path}"], tmp_path)
        runs["mpi"] = tmp_path / "mpi" / "mpi"
    address_file = write_ipconfig(str(tmp_path / "ipconfig.csv"), 3)
    path = example_yaml(
        tmp_path, "fedml_config_silo.yaml", mnist_root, "silo", tmp_path / "silo", grpc_ipconfig_path=address_file
    )
    script = (
        " & ".join(
            f"{sys.executable} {_one_line('server' if r == 0 else 'client')} --cf {path} --rank {r} "
            f"--role {'server' if r == 0 else 'client'} --run_id 7"
            for r in range(3)
        )
        + " & wait"
    )
    _run(["sh", "-c", script], tmp_path)
    runs["silo"] = tmp_path / "silo" / "silo"

    reference = torch.load(runs["sp"] / "model.pt")
    for backend, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["aggregate_calls"] == 3, backend
        assert summary["config"]["train_args"]["federated_optimizer"] == "PerFedAvg"
        assert [h["round"] for h in summary["history"]] == [0, 1, 2], backend
        model = torch.load(run_dir / "model.pt")
        for k in reference:
            torch.testing.assert_close(model[k], reference[k], rtol=1e-5, atol=1e-6, msg=backend)


def _own_pair_results(output_dir, ranks):
    return [json.loads((Path(output_dir) / f"own_pair_rank{r}.json").read_text()) for r in range(ranks)]


# FedML's own FedAvg with the user's pair: FedML's simulators drop a handed pair; the plugin runs it
# where its fixes are asked for (common_args.plugin_fixes; issue 77: nothing changes otherwise)
OWN_PAIR_EDITS = dict(federated_optimizer="FedAvg", epochs=1, client_optimizer="sgd", plugin_fixes=True)


@needs_mnist
def test_own_trainer_and_aggregator_run_on_sp_mpi_and_cross_silo(mnist_root, tmp_path):
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "sp", tmp_path / "sp", **OWN_PAIR_EDITS)
    _run([sys.executable, OWN_PAIR, "--cf", path], tmp_path)
    [sp] = _own_pair_results(tmp_path / "sp", 1)
    assert sp["runner"] == "SPSimulation"
    assert sp["calls"]["train"] == 3 * 2 and sp["calls"]["aggregate"] == 3 and sp["calls"]["test_all"] == 3
    assert sp["shift"] == pytest.approx([3.0] * len(sp["shift"]))  # +1 per round, averaged: really its train()

    distributed = {}
    if MPIRUN is not None:
        path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "mpi", **OWN_PAIR_EDITS)
        _run([MPIRUN, "-n", "3", sys.executable, OWN_PAIR, "--cf", path], tmp_path)
        distributed["mpi"] = _own_pair_results(tmp_path / "mpi", 3)
    address_file = write_ipconfig(str(tmp_path / "ipconfig.csv"), 3)
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "silo",
        tmp_path / "silo",
        grpc_ipconfig_path=address_file,
        **OWN_PAIR_EDITS,
    )
    _run(_silo_command(OWN_PAIR, path), tmp_path, timeout=180)
    distributed["silo"] = _own_pair_results(tmp_path / "silo", 3)

    for backend, (server, *clients) in distributed.items():
        assert server["calls"]["aggregate"] == 3 and server["calls"]["before_aggregation"] == 3, backend
        assert server["shift"] == pytest.approx([3.0] * len(server["shift"])), backend
        assert sum(c["calls"]["train"] for c in clients) == 3 * 2, backend


@needs_mnist
def test_fedml_init_reads_the_yaml_once_and_the_variant_arrives_typed(mnist_root, tmp_path):
    """The plugin reads ``--cf`` once; FedML's ``Arguments`` and the run's config are built from
    that one read, and ``perfedavg_variant`` reaches the local step as a ``Step``."""
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "once", tmp_path / "runs", perfedavg_variant="exact")
    code = f"""
import sys
opened = []
sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and args[0] == {path!r} else None)
import fedml_perfedavg, fedml
from fedml_perfedavg.core.client_maths import Step
from fedml_perfedavg.run.runner import context_of
args = fedml.init()
config = context_of(args).config
from fedml_perfedavg.algorithms.base import AlgorithmSettings
from fedml_perfedavg.algorithms.perfedavg import PerFedAvgSettings
own = AlgorithmSettings.from_config(config, PerFedAvgSettings).own
typed = config.setting("perfedavg_variant") is Step.EXACT and own.perfedavg_variant is Step.EXACT
sys.__stdout__.write(f"READS {{len(opened)}} {{args.perfedavg_variant}} {{typed}}\\n")
"""
    out = _run([sys.executable, "-c", code, "--cf", path], tmp_path)
    assert "READS 1 exact True" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]


@needs_mnist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun (PyPI mpich) not installed")
@pytest.mark.parametrize("entry", ["cli", "run_simulation"])
def test_a_single_process_config_under_mpirun_is_refused_at_once_naming_backend(mnist_root, tmp_path, entry):
    """Issue 45: mpirun -n 3 over a config saying backend sp ran 3 copies of the whole job into one
    run folder (2 "finished", 1 failed, exit status 0, no warning)."""
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "sp", tmp_path / "runs")
    if entry == "cli":
        command = f"{sys.executable} -m fedml_perfedavg --cf {path} --run-dir {tmp_path / 'runs' / 'x'}"
    else:
        command = f"{sys.executable} {_one_line('MPI')} --cf {path}"
    home = tmp_path / "home"
    home.mkdir()
    out = subprocess.run(
        offline([MPIRUN, "-n", "3", "sh", "-c", command]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )
    printed = out.stdout + out.stderr
    assert out.returncode != 0, printed[-3000:]
    # Each rank refuses; mpirun ends the others once the first has exited, so one that is slower to
    # start (FedML's import) may be ended before it says so: at least one says why, none runs.
    refusals = printed.count("comm_args.backend='sp', but this process is one of 3 that mpirun started")
    assert 1 <= refusals <= 3, printed[-3000:]
    assert not any(p.name == "summary.json" for p in (tmp_path / "runs").rglob("*")), printed[-2000:]


@needs_mnist
@pytest.mark.parametrize("optimizer", ["LSA", "SA"])
def test_fedmls_own_secure_aggregation_is_refused_at_start_pointing_to_the_plugins(mnist_root, tmp_path, optimizer):
    """Issue 45: on the plugin's transport LSA crashed every rank ("message type 9 is not part of the
    cross-silo protocol") and SA died on FedML's missing module. Now, where FedML's own algorithms
    are asked onto it (common_args.plugin_fixes), both stop at start, saying why."""
    address_file = write_ipconfig(str(tmp_path / "ipconfig.csv"), 3)
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "silo",
        tmp_path / "runs",
        grpc_ipconfig_path=address_file,
        federated_optimizer=optimizer,
        plugin_fixes=True,  # the plugin's transport for FedML's own algorithms (without it, FedML's own run as is)
    )
    home = tmp_path / "home"
    home.mkdir()
    out = subprocess.run(
        offline(["sh", "-c", f"{sys.executable} {_one_line('server')} --cf {path} --rank 0 --role server"]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )
    printed = out.stdout + out.stderr
    assert out.returncode != 0, printed[-3000:]
    assert f"train_args.federated_optimizer={optimizer!r}: FedML's" in printed, printed[-3000:]
    assert "secagg_args: {enable_secagg: true}" in printed and "message type 9" not in printed
