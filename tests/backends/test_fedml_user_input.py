"""What a FedML user's script meets with the plugin imported (FedML's own step-by-step main in a
subprocess): algorithm names in any case, and a name nobody runs stopped in ``fedml.init``."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import EXAMPLE, REPO, example_yaml, needs_mnist

SCRIPT = str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py")
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


def _main(tmp_path, path):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, SCRIPT, "--cf", path],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )


@needs_mnist
def test_plugin_names_match_in_any_case_and_unknown_ones_stop_in_fedml_init(mnist_root, tmp_path):
    path = example_yaml(
        tmp_path, "fedml_config.yaml", mnist_root, "lower", tmp_path / "runs", federated_optimizer="perfedavg"
    )
    out = _main(tmp_path, path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    summary = json.loads((tmp_path / "runs" / "lower" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["config"]["train_args"]["federated_optimizer"] == "PerFedAvg"

    path = example_yaml(
        tmp_path, "fedml_config.yaml", mnist_root, "typo", tmp_path / "runs", federated_optimizer="PerFedAvgg"
    )
    out = _main(tmp_path, path)
    assert out.returncode != 0
    assert (
        "ConfigError: train_args.federated_optimizer='PerFedAvgg': neither a plugin algorithm "
        "(['PerFedAvg', 'FedAvgUpdate', 'FedAvgARUBA']) nor one of FedML's own"
    ) in out.stderr
    assert "did you mean 'PerFedAvg'?" in out.stderr
    assert "in init" in out.stderr and "load(" not in out.stderr  # raised in fedml.init, before data loads
    assert not (tmp_path / "runs" / "typo").exists()


def _wait_for(path, text, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline and process.poll() is None, (process.poll(), text)
        time.sleep(0.05)


@needs_mnist
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT])
def test_fedml_main_script_stopped_by_a_signal_keeps_its_record(mnist_root, tmp_path, how):
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "stopped", tmp_path / "runs", comm_round=5000)
    home = tmp_path / "home"
    home.mkdir()
    process = subprocess.Popen(
        [sys.executable, SCRIPT, "--cf", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )
    run_dir = tmp_path / "runs" / "stopped"
    _wait_for(run_dir / "run.log", "round 3: personalized accuracy", process)
    process.send_signal(how)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == -how, out[-4000:]  # the process ends by the signal it was sent, as without the plugin
    # one line says where the record is, where a traceback of wherever the signal landed once followed
    assert f"fedml-perfedavg: interrupted; what was measured so far is in {run_dir}/summary.json" in out, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds"] >= 4, out[-3000:]
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(model) == {"linear.weight", "linear.bias"}


@needs_mnist
def test_fedml_cross_silo_server_stopped_by_sigterm_keeps_its_record_and_stops_its_silos(mnist_root, tmp_path):
    from fedml_perfedavg.net.addresses import write_ipconfig

    address_file = write_ipconfig(str(tmp_path / "ip.csv"), 3)
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "silo",
        tmp_path / "runs",
        comm_round=5000,
        grpc_ipconfig_path=address_file,
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                SCRIPT,
                "--cf",
                path,
                "--rank",
                str(r),
                "--role",
                "server" if r == 0 else "client",
                "--run_id",
                "9",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for r in range(3)
    ]
    try:
        run_dir = tmp_path / "runs" / "silo"
        _wait_for(run_dir / "run.log", "round 3: personalized accuracy", processes[0])
        processes[0].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        outs = []
        for rank, process in enumerate(processes):
            try:
                outs.append(process.communicate(timeout=max(1.0, stopped + 60 - time.monotonic()))[0])
            except subprocess.TimeoutExpired:  # say why: each process's last lines and the server's log
                for p in processes:
                    p.kill()
                tails = [
                    f"--- rank {r}:\n" + "\n".join(p.communicate()[0].splitlines()[-15:])
                    for r, p in enumerate(processes)
                ]
                log = (run_dir / "run.log").read_text().splitlines()[-30:] if (run_dir / "run.log").exists() else []
                pytest.fail(
                    f"rank {rank} still ran 60 s after the server's SIGTERM\n"
                    + "\n".join(tails + ["--- the server's run.log:", *log])
                )
        took = time.monotonic() - stopped
    finally:
        for p in processes:
            p.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and (run_dir / "model.pt").exists(), outs[0][-3000:]
    for out in outs[1:]:
        assert "the server ended the run early" in out
    assert took < 20


@needs_mnist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (.[mpi])")
def test_fedml_mpi_job_stopped_by_sigterm_keeps_its_record(mnist_root, tmp_path):
    path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "runs", comm_round=5000)
    home = tmp_path / "home"
    home.mkdir()
    process = subprocess.Popen(
        [MPIRUN, "-n", "3", sys.executable, SCRIPT, "--cf", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)},
    )
    run_dir = tmp_path / "runs" / "mpi"
    _wait_for(run_dir / "run.log", "round 3: personalized accuracy", process)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds"] >= 4, out[-3000:]
    assert torch.load(run_dir / "model.pt", weights_only=True)


def _leaf_mnist(root, users=4, train=48, test=12):
    """FedML's MNIST in LEAF's JSON layout (what FedML's MNIST.zip holds), small and random."""
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("test", test)):
        folder = root / "MNIST" / split
        folder.mkdir(parents=True)
        data = {
            f"w{u}": {
                "x": torch.rand(count, 784, generator=g).round(decimals=3).tolist(),
                "y": torch.randint(0, 10, (count,), generator=g).tolist(),
            }
            for u in range(users)
        }
        (folder / "part.json").write_text(
            json.dumps({"users": list(data), "num_samples": [count] * users, "user_data": data})
        )


@needs_mnist
def test_fedml_own_mnist_split_runs_offline_from_its_files_or_stops_naming_them(mnist_root, tmp_path):
    from tests.helpers import NETWORK_GUARD, offline

    edits = dict(
        partition_method="hetero", partition_alpha=0.5, client_num_in_total=4, client_num_per_round=2, batch_size=10
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)}
    path = example_yaml(tmp_path, "fedml_config.yaml", str(empty), "missing", tmp_path / "runs", **edits)
    out = subprocess.run(
        offline([sys.executable, "-c", NETWORK_GUARD, "--script", SCRIPT, "--cf", path]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode != 0 and "NETWORK_ATTEMPTS [(" not in out.stdout, (out.stdout + out.stderr)[-3000:]
    assert f"reads LEAF's JSON files from {empty}/MNIST/train/*.json and {empty}/MNIST/test/*.json" in out.stderr
    assert "set data_args.download: true" in out.stderr
    assert not (empty / "MNIST.zip").exists()

    leaf = tmp_path / "leaf"
    _leaf_mnist(leaf)
    path = example_yaml(tmp_path, "fedml_config.yaml", str(leaf), "leaf", tmp_path / "runs", **edits)
    out = subprocess.run(
        offline([sys.executable, "-c", NETWORK_GUARD, "--script", SCRIPT, "--cf", path]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0 and "NETWORK_ATTEMPTS []" in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    summary = json.loads((tmp_path / "runs" / "leaf" / "summary.json").read_text())
    assert summary["status"] == "finished" and len(summary["per_user_accuracy"]) == 4
    assert out.stderr.count("data_args.partition_method='hetero' is not used: FedML's MNIST loader") == 1
    assert "partition_alpha=0.5 is not used: FedML's MNIST loader" in out.stderr
    assert "the paper's split" not in out.stderr.split("partition_alpha=0.5")[1][:80]


def test_import_fedml_before_the_plugin_works(tmp_path):
    """isort's order (``import fedml`` first): the installed .pth hook makes torchvision importable
    beside the CPU torch before FedML imports it; starting Python imports nothing heavy."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; assert 'torch' not in sys.modules; import fedml; "
            "import fedml_perfedavg; print('imported', fedml.__version__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported 0.9.6" in out.stdout


@needs_mnist
@pytest.mark.parametrize("optimizer", ["PerFedAvg", "FedAvg"])
@pytest.mark.parametrize("backend", ["TRPC", "MQTT_S3"])
def test_cross_silo_backends_the_plugin_cannot_secure_are_refused_in_fedml_init(
    mnist_root, tmp_path, optimizer, backend
):
    """FedML's TRPC listened in plaintext on every interface with the plugin imported; now a plugin
    run refuses every cross-silo backend but the plugin's secured gRPC, and so does FedML's own
    FedAvg where its YAML asks for the plugin's fixes (common_args.plugin_fixes; without it FedML's
    own algorithms run as FedML has them: issue 77)."""
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "insecure",
        tmp_path / "runs",
        backend=backend,
        federated_optimizer=optimizer,
        **({"plugin_fixes": True} if optimizer == "FedAvg" else {}),
    )
    out = subprocess.run(
        [sys.executable, SCRIPT, "--cf", path, "--rank", "0", "--role", "server"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    assert out.returncode != 0
    assert f"ConfigError: comm_args.backend='{backend}': refused for cross-silo by fedml-perfedavg" in out.stderr
    assert "Use backend: GRPC" in out.stderr and "in init" in out.stderr


@needs_mnist
def test_hierarchical_cross_silo_is_refused_in_fedml_init_and_by_launch_silo(mnist_root, tmp_path):
    """FedML's hierarchical scenario exited 0 having trained nothing; launch-silo ran horizontal."""
    path = example_yaml(
        tmp_path, "fedml_config_silo.yaml", mnist_root, "hier", tmp_path / "runs", scenario="hierarchical"
    )
    out = subprocess.run(
        [sys.executable, SCRIPT, "--cf", path, "--rank", "0", "--role", "server"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    said = "common_args.scenario='hierarchical': the plugin's algorithms run FedML's horizontal cross-silo only"
    assert out.returncode != 0 and said in out.stderr and "in init" in out.stderr
    launched = subprocess.run(
        [sys.executable, "-m", "fedml_perfedavg", "launch-silo", "--cf", path, "--run-dir", str(tmp_path / "l")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert launched.returncode == 2 and said in launched.stderr and not (tmp_path / "l").exists()


@needs_mnist
@pytest.mark.parametrize("edit", [{"data_cache_dir": "nowhere"}, {"partition_method": "hetero"}])
def test_a_fedml_main_refused_at_start_leaves_no_run_directory(mnist_root, tmp_path, edit):
    """Missing MNIST files, or FedML's LEAF files for its own split: the script fails before any
    round, and its run directory (FedML's files, run.log) goes with it."""
    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "refused", tmp_path / "runs", **edit)
    out = _main(tmp_path, path)
    assert out.returncode != 0 and ("not found" in out.stderr or "LEAF" in out.stderr), out.stderr[-2000:]
    assert not (tmp_path / "runs" / "refused").exists()


@needs_mnist
def test_fedml_main_script_runs_dp_sgd_from_its_yaml_and_records_every_users_epsilon(mnist_root, tmp_path):
    import yaml

    path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "private", tmp_path / "runs")
    config = yaml.safe_load(open(path))
    config["dp_args"] = {
        "enable_dp": True,
        "dp_solution_type": "dpsgd",  # FedML's own DP would raise "dp solution is not defined"
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "delta": 1e-5,
    }
    open(path, "w").write(yaml.safe_dump(config))
    out = _main(tmp_path, path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    summary = json.loads((tmp_path / "runs" / "private" / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["accountant"] == privacy["epsilon_from"] == "opacus.prv" and privacy["noise_multiplier"] == 1.0
    assert len(privacy["per_user"]) == 50 and privacy["epsilon"] > 0  # every user is evaluated, so every one spends
    assert "epsilon" in out.stderr
