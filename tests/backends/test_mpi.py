"""FedML's MPI simulation runs the plugin unchanged and gives the single-process model."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import run

from tests.helpers import (
    HF_YAML,
    NETWORK_GUARD,
    REPO,
    assert_same_bits,
    needs_mnist,
    single_process_at,
    unshare_works,
)

MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
needs_mpi = pytest.mark.skipif(MPIRUN is None, reason="mpirun (PyPI mpich) not installed")
SETTINGS = {
    "client_num_per_round": 2,
    "comm_round": 3,
    "frequency_of_the_test": 1,
    "show_progress": False,
    "beta": 0.05,
}


def _mpi_run(mnist_root, run_dir, optimizer="PerFedAvg", variant="hf", extra=(), ranks=3):
    sets = [
        f"{k}={v}"
        for k, v in {
            **SETTINGS,
            "backend": "MPI",
            "data_cache_dir": mnist_root,
            "federated_optimizer": optimizer,
            "perfedavg_variant": variant,
        }.items()
    ]
    command = [
        MPIRUN,
        "-n",
        str(ranks),
        sys.executable,
        "-c",
        NETWORK_GUARD,
        "--cf",
        HF_YAML,
        "--run-dir",
        str(run_dir),
        *[a for s in sets for a in ("--set", s)],
        *extra,
    ]
    if unshare_works():
        command = ["unshare", "-n"] + command
    # one torch thread a rank, the single-process reference's count in the tests that compare bits
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(run_dir.parent / "home"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("NETWORK_ATTEMPTS") == ranks  # every rank ran the guard; any attempt fails its exit code
    return out


@needs_mnist
@needs_mpi
@pytest.mark.parametrize("optimizer,variant", [("PerFedAvg", "hf"), ("FedAvgUpdate", "hf"), ("FedAvgARUBA", "hf")])
def test_mpi_three_ranks_equals_single_process(mnist_root, tmp_path, optimizer, variant):
    _mpi_run(mnist_root, tmp_path / "mpi", optimizer, variant)
    summary = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3
    assert summary["aggregate_calls"] == 3  # the plugin's aggregator averaged every round
    assert [h["round"] for h in summary["history"]] == [0, 1, 2]
    sp = single_process_at(
        1,  # the ranks' threads (_mpi_run)
        resolve(
            load_yaml(HF_YAML),
            {
                **SETTINGS,
                "data_cache_dir": mnist_root,
                "federated_optimizer": optimizer,
                "perfedavg_variant": variant,
                "simulation_engine": "fedml",
            },
        ),
        tmp_path / "sp",
    )
    assert_same_bits(torch.load(tmp_path / "mpi" / "model.pt"), sp.final_state)
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]


@needs_mnist
@needs_mpi
def test_a_failing_client_rank_ends_the_mpi_job_instead_of_hanging(mnist_root, tmp_path):
    sets = [
        "backend=MPI",
        f"data_cache_dir={mnist_root}",
        "client_num_per_round=2",
        "comm_round=3",
        "beta=1e30",
        "show_progress=false",
    ]  # every client's update goes non-finite; on_divergence: stop
    out = subprocess.run(
        [
            MPIRUN,
            "-n",
            "3",
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "--cf",
            HF_YAML,
            "--run-dir",
            str(tmp_path),
            *[a for s in sets for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    printed = out.stdout + out.stderr
    assert out.returncode != 0, printed[-4000:]
    assert "failed in round 0 training clients [" in printed, printed[-4000:]
    assert "aborting the MPI job: round 0, client" in printed
    assert "non-finite parameters after local training" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())  # the record says how the run ended
    assert summary["status"] == "aborted"
    assert summary["error"].startswith("MPI rank ") and "round 0, client" in summary["error"]
    assert "failed in round 0 training clients [" in summary["error"]  # the rank and its clients


SAFEGUARDS = {
    "ldp+flipping+byzantine+clipping": {
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "ldp",
        "dp_args.mechanism_type": "laplace",
        "dp_args.epsilon": 2.0,
        "dp_args.delta": 0.0,
        "dp_args.sensitivity": 0.001,
        "attack_args.enable_attack": True,
        "attack_args.attack_type": "byzantine",
        "attack_args.attack_mode": "random",
        "attack_args.byzantine_client_num": 1,
        "defense_args.enable_defense": True,
        "defense_args.defense_type": "norm_diff_clipping",
        "defense_args.norm_bound": 0.5,
    },
    "cdp+flipping+median, 4 clients on 2 workers": {
        "client_num_per_round": 4,
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "cdp",
        "dp_args.mechanism_type": "gaussian",
        "dp_args.epsilon": 0.5,
        "dp_args.delta": 1e-5,
        "dp_args.sensitivity": 0.001,
        "attack_args.enable_attack": True,
        "attack_args.attack_type": "label_flipping",
        "attack_args.original_class_list": "[0,1,2,3,4]",
        "attack_args.target_class_list": "[5,6,7,8,9]",
        "attack_args.ratio_of_poisoned_client": 0.5,
        "defense_args.enable_defense": True,
        "defense_args.defense_type": "wise_median",
    },
    # adaptive clipping: each user's bounds go out with its assignment and come back with its update
    "the plugin's DP-SGD with adaptive clipping, 4 clients on 2 workers": {
        "client_num_per_round": 4,
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "dpsgd",
        "dp_args.noise_multiplier": 1.0,
        "dp_args.max_grad_norm": 1.0,
        "dp_args.delta": 1e-5,
        "dp_args.clip": "adaptive",
    },
}


@needs_mnist
@needs_mpi
@pytest.mark.parametrize("combination", list(SAFEGUARDS))
def test_fedmls_dp_attacks_and_defenses_give_the_single_process_model_under_mpi(mnist_root, tmp_path, combination):
    sets = SAFEGUARDS[combination]
    _mpi_run(mnist_root, tmp_path / "mpi", extra=[a for k, v in sets.items() for a in ("--set", f"{k}={v}")])
    summary = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3
    from fedml_perfedavg.run.config import parse_overrides

    overrides = {**SETTINGS, "data_cache_dir": mnist_root, **parse_overrides([f"{k}={v}" for k, v in sets.items()])}
    batched = run(resolve(load_yaml(HF_YAML), overrides), str(tmp_path / "batched"))
    plain = run(resolve(load_yaml(HF_YAML), {**SETTINGS, "data_cache_dir": mnist_root}), str(tmp_path / "plain"))
    mpi_model = torch.load(tmp_path / "mpi" / "model.pt")
    for k in mpi_model:
        torch.testing.assert_close(mpi_model[k], batched.final_state[k], rtol=1e-5, atol=1e-6)
    assert max(float((mpi_model[k] - plain.final_state[k]).abs().max()) for k in mpi_model) > 1e-3
    assert summary.get("privacy") == batched.summary.get("privacy")  # DP-SGD: every user's epsilon too
    assert ("privacy" in summary) == (sets["dp_args.dp_solution_type"] == "dpsgd")
    bounds = batched.summary.get("dp_clip_bounds", {})
    assert (len(bounds) > 4) == (sets.get("dp_args.clip") == "adaptive")  # users trained in more than one round
    assert summary.get("dp_clip_bounds", {}).keys() == bounds.keys()
    for user, own in bounds.items():
        assert summary["dp_clip_bounds"][user] == pytest.approx(own, rel=1e-6)


@needs_mnist
@needs_mpi
@pytest.mark.parametrize("clients,ranks,optimizer", [(10, 3, "PerFedAvg"), (20, 5, "PerFedAvg"), (4, 3, "FedAvgARUBA")])
def test_more_clients_than_workers_train_in_shares_and_give_the_single_process_model(
    mnist_root, tmp_path, clients, ranks, optimizer
):
    out = _mpi_run(
        mnist_root,
        tmp_path / "mpi",
        optimizer,
        ranks=ranks,
        extra=["--set", f"client_num_per_round={clients}", "--set", "comm_round=2"],
    )
    summary = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 2 and summary["aggregate_calls"] == 2
    assert f"{ranks - 1} worker ranks, each training a share of the round's {clients} clients" in out.stderr
    batched = run(
        resolve(
            load_yaml(HF_YAML),
            {
                **SETTINGS,
                "comm_round": 2,
                "client_num_per_round": clients,
                "data_cache_dir": mnist_root,
                "federated_optimizer": optimizer,
            },
        ),
        str(tmp_path / "batched"),
    )
    mpi_model = torch.load(tmp_path / "mpi" / "model.pt")
    for k in mpi_model:
        torch.testing.assert_close(mpi_model[k], batched.final_state[k], rtol=1e-5, atol=1e-6)
    assert summary["per_user_accuracy"] == pytest.approx(batched.summary["per_user_accuracy"], abs=1e-6)


@pytest.mark.fast
def test_shares_are_balanced_contiguous_and_in_the_rounds_order():
    from fedml_perfedavg.fedml_bridge.mpi import balanced_shares, parse_assignment

    assert balanced_shares([3, 5, 8, 9, 11, 20, 21], 3) == [[3, 5, 8], [9, 11], [20, 21]]
    assert balanced_shares([1, 2], 2) == [[1], [2]]
    assert [len(s) for s in balanced_shares(list(range(20)), 4)] == [5, 5, 5, 5]
    assert parse_assignment("7") == 7 and parse_assignment("[3, 5]") == [3, 5]
    with pytest.raises(ValueError, match="neither a client index"):
        parse_assignment('"__import__(os)"')


def test_a_waiting_rank_hands_on_every_message_in_order_and_spends_no_cpu_polling():  # imports FedML's MPI manager
    """FedML's loop polled its queue every 0.1 ms: 16% of a core for an idle rank."""
    import queue
    import threading
    import time

    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager

    from fedml_perfedavg.fedml_bridge.mpi import waiting, waiting_receive_loop

    # FedML's own class keeps FedML's loop (issue 77: unless common_args.plugin_fixes); a plugin manager's
    # transport waits (mpi.waiting, called by its managers), this object's alone
    assert MpiCommunicationManager.handle_receive_message is not waiting_receive_loop
    holder = type("Holder", (), {})()
    holder.com_manager = type("Com", (), {"q_receiver": None})()
    waiting(holder)
    assert holder.com_manager.handle_receive_message.func is waiting_receive_loop
    seen = []

    class Manager:
        q_receiver: "queue.Queue[str]" = queue.Queue()
        _stop_running = False

        def _notify_connection_ready(self):
            seen.append("ready")

        def notify(self, message):
            seen.append(message)
            self._stop_running = message == "last"

    manager = Manager()

    def later():
        time.sleep(1.0)
        for message in ("model", "update", "last"):
            manager.q_receiver.put(message)

    threading.Thread(target=later, daemon=True).start()
    spent = time.thread_time()
    waiting_receive_loop(manager)
    assert seen == ["ready", "model", "update", "last"]
    assert time.thread_time() - spent < 0.03  # FedML's loop: about 0.16 s in that second


@pytest.mark.fast
def test_each_rank_takes_the_gpu_of_its_local_rank_when_using_gpu(monkeypatch):
    import argparse

    from fedml_perfedavg.core.errors import ConfigError
    from fedml_perfedavg.fedml_bridge.mpi import rank_device

    args = argparse.Namespace(using_gpu=True, gpu_mapping_file=None, process_id=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for name in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert rank_device(args, "cpu") == torch.device("cuda", 1)  # no local rank known: the world rank, mod 4
    monkeypatch.setenv("MPI_LOCALRANKID", "6")
    assert rank_device(args, "cpu") == torch.device("cuda", 2)
    assert rank_device(argparse.Namespace(using_gpu=False, process_id=1), "cpu") == "cpu"
    assert rank_device(argparse.Namespace(using_gpu=True, gpu_mapping_file="m.yaml", process_id=1), "dev") == "dev"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device_args.using_gpu=True: MPI rank 5 sees no CUDA device"):
        rank_device(args, "cpu")


@needs_mnist
@needs_mpi
def test_one_round_on_mpi_finishes(mnist_root, tmp_path):
    """FedML's MPI worker waited forever after a run's only round (FedML's own FedAvg too)."""
    _mpi_run(mnist_root, tmp_path / "mpi", extra=["--set", "comm_round=1"])
    summary = json.loads((tmp_path / "mpi" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 1 and (tmp_path / "mpi" / "model.pt").exists()
    # `mpirun -n 3 fedml-perfedavg --resume RUN --set comm_round=3` cannot resume FedML's MPI loop:
    # every rank refuses before it touches the finished run's files (they used to end "failed").
    files = {p: p.read_bytes() for p in (tmp_path / "mpi").rglob("*") if p.is_file()}
    command = [MPIRUN, "-n", "3", sys.executable, "-m", "fedml_perfedavg", "--resume", str(tmp_path / "mpi")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*command, "--set", "comm_round=3"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.count("resuming needs the batched engine on sp or a cross-silo server") == 3, out.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "mpi").rglob("*") if p.is_file()} == files


@needs_mnist
@needs_mpi
def test_fedmls_own_fedavg_finishes_one_round_on_mpi_when_its_user_asks_for_the_plugins_fixes(mnist_root, tmp_path):
    """FedML's MPI worker waits for ever after a one-round run; with the plugin imported, FedML's own
    FedAvg gets the plugin's fix only where its YAML asks (common_args.plugin_fixes: issue 77)."""
    from tests.helpers import EXAMPLE, example_yaml

    path = example_yaml(
        tmp_path,
        "fedml_config_mpi.yaml",
        mnist_root,
        "fedavg",
        tmp_path / "runs",
        comm_round=1,
        federated_optimizer="FedAvg",
        epochs=1,
        client_optimizer="sgd",
        plugin_fixes=True,
    )
    out = subprocess.run(
        [
            MPIRUN,
            "-n",
            "3",
            sys.executable,
            str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py"),
            "--cf",
            path,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


# Run by every rank: the CLI, with rank RANK changed by a line of Python (PMI_RANK is MPICH's).
_ONE_RANK_DIFFERS = r"""
import os, sys
if os.environ.get("PMI_RANK") == sys.argv[1]:
    exec(sys.argv[2])
from fedml_perfedavg.run.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _mpi_cli_with_one_rank_changed(mnist_root, run_dir, rank, change, timeout=120, **settings):
    sets = {**SETTINGS, "backend": "MPI", "data_cache_dir": mnist_root, "comm_round": 1, **settings}
    command = [MPIRUN, "-n", "3", sys.executable, "-c", _ONE_RANK_DIFFERS, str(rank), change, "--cf", HF_YAML]
    command += ["--run-dir", str(run_dir), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(run_dir.parent / "home")}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


@needs_mnist
@needs_mpi
def test_a_slow_rank_joins_the_run_directory_rank_0_has_started_writing(mnist_root, tmp_path):
    """Every rank used to check that the run directory held no run: a rank slower than rank 0 found
    rank 0's config.yaml there, stopped, and the job hung (CI, 2026-11-24)."""
    slow_start = "from mpi4py import MPI; import time; time.sleep(8)"  # MPI started; rank 0 writes config.yaml
    out = _mpi_cli_with_one_rank_changed(mnist_root, tmp_path / "run", 2, slow_start)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"


@needs_mnist
@needs_mpi
def test_a_rank_that_cannot_start_stops_every_rank_with_its_error(mnist_root, tmp_path):
    """One rank's failure before FedML's loop used to leave the other ranks waiting for it forever."""
    fail_start = (
        "import fedml_perfedavg.run.data_modes as modes\n"
        "from fedml_perfedavg.core.errors import ConfigError\n"
        "def refuse(*_): raise ConfigError('data_args.data_cache_dir: rank 1 cannot read it')\n"
        "modes.SharedData.check_data = refuse"
    )
    out = _mpi_cli_with_one_rank_changed(mnist_root, tmp_path / "run", 1, fail_start, timeout=90)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stderr.count("rank 1 cannot read it") == 3, out.stderr[-4000:]  # every rank says why
    assert "MPI rank 1 could not start (ConfigError: data_args.data_cache_dir: rank 1 cannot read it)" in out.stderr
    assert not (tmp_path / "run").exists()  # a failed start leaves no directory behind


@needs_mnist
@needs_mpi
def test_a_failed_start_leaves_no_run_directory_even_with_a_slow_rank(mnist_root, tmp_path):
    """Rank 0 used to remove a failed start's directory while a slower rank was still in
    fedml.init, which then wrote FedML's files into it again (a fresh clone's CI, 2026-11-24)."""
    slow_start = "from mpi4py import MPI; import time; time.sleep(8)"
    run_dir = tmp_path / "run"
    out = _mpi_cli_with_one_rank_changed(mnist_root, run_dir, 2, slow_start, client_num_per_round=1)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-4000:]
    assert "must be at least the number of ranks - 1 (this is mpirun -n 3: at least 2" in out.stderr
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


@needs_mnist
@needs_mpi
def test_a_run_rank_0_stops_ends_every_rank_within_seconds(mnist_root, tmp_path):
    """Every update is over train_args.max_update_norm, so rank 0 stops the run at
    max_skipped_rounds: it writes the record, then ends the whole job (the workers would wait for
    a model that never comes, and FedML's receive threads keep them alive)."""
    sets = {
        **SETTINGS,
        "backend": "MPI",
        "data_cache_dir": mnist_root,
        "comm_round": 50,
        "max_update_norm": 1e-9,
        "max_skipped_rounds": 2,
    }
    command = [MPIRUN, "-n", "3", sys.executable, "-m", "fedml_perfedavg", "--cf", HF_YAML, "--run-dir", str(tmp_path)]
    command += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=90
    )
    printed = out.stdout + out.stderr
    assert out.returncode != 0, printed[-4000:]
    # The run's log says it (mpirun may drop a rank's last printed lines when the job is aborted:
    # CI run of 5d8e427 printed everything up to the stop but that line).
    assert "ending every MPI rank" in (tmp_path / "run.log").read_text(), printed[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and "train_args.max_skipped_rounds=2" in summary["error"]
