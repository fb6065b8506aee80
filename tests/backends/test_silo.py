"""Cross-silo over gRPC: the launcher, equality with single-process, and lost silos."""

import csv
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedml_perfedavg.core.sampling import sample_clients
from fedml_perfedavg.run.config import ConfigError, load_yaml, resolve
from fedml_perfedavg.net.addresses import read_ipconfig, write_ipconfig
from fedml_perfedavg.run.silo_roles import check_silo_role
from fedml_perfedavg.run.runner import load_split, run

from tests.helpers import (
    HF_YAML,
    REPO,
    assert_same_bits,
    launch_silo,
    launched_alive,
    launched_threads,
    needs_mnist,
    single_process_at,
)

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="grpcio not installed (.[silo])")
from tests.helpers import SILO_YAML  # noqa: E402

SETTINGS = {"client_num_per_round": 2, "frequency_of_the_test": 1, "show_progress": False, "beta": 0.05}


def _launch(mnist_root, run_dir, settings, extra=(), wait=True):
    """launch-silo with 2 silos; inside a network namespace with only loopback when possible."""
    process = launch_silo(run_dir, {**SETTINGS, "data_cache_dir": mnist_root, **settings}, extra, loopback_only=True)
    if not wait:
        return process
    out, _ = process.communicate(timeout=300)
    return process.returncode, out


def _ipconfig_hosts(run_dir):
    with open(run_dir / "grpc_ipconfig.csv") as stream:
        return {row["grpc_server_ip"] for row in csv.DictReader(stream)}


@needs_mnist
@needs_grpc
def test_launcher_with_silos_started_first_equals_single_process(mnist_root, tmp_path):
    code, out = _launch(mnist_root, tmp_path / "silo", {"comm_round": 3}, extra=["--server-delay", "4"])
    assert code == 0, out[-5000:]
    assert "is not reachable yet; retrying" in out  # the silos started first and waited for the server
    assert _ipconfig_hosts(tmp_path / "silo") == {"127.0.0.1"}
    summary = json.loads((tmp_path / "silo" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3 and summary["aggregate_calls"] == 3
    assert [h["round"] for h in summary["history"]] == [0, 1, 2]

    config = resolve(
        load_yaml(HF_YAML), {**SETTINGS, "comm_round": 3, "data_cache_dir": mnist_root, "simulation_engine": "fedml"}
    )
    sp = single_process_at(launched_threads(2), config, tmp_path / "sp")
    silo_model = torch.load(tmp_path / "silo" / "model.pt")
    assert_same_bits(silo_model, sp.final_state)
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]

    # Each silo evaluated the final model on its own user of that (K-th) selection, as documented.
    final = summary["silo_evaluation"][-1]
    assert final["when"] == "final"
    users = sample_clients(config.common.random_seed, 3, config.train.client_num_in_total, 2)
    data = load_split(config)
    for rank, user in zip(("1", "2"), users):
        reported = final["silos"][rank]
        assert reported["user"] == user and reported["round"] == 3
        expected = sp.algorithm.evaluate(3, silo_model, [data.users[user]], user_ids=[user], batched=False)
        assert reported["accuracy"] == pytest.approx(expected.per_user_accuracy[0], abs=1e-12)
    mean = sum(final["silos"][r]["accuracy"] for r in ("1", "2")) / 2
    assert final["mean_accuracy"] == pytest.approx(mean)
    assert f"final: silos' own personalized accuracy {mean:.4f} (model they received" in out


def _kill_silo_two_mid_run(process, run_dir):
    log = run_dir / "run.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and "round 1: personalized accuracy" in log.read_text():
            break
        assert process.poll() is None, process.communicate()[0][-5000:]
        time.sleep(0.05)
    else:
        pytest.fail("the run never reached round 1")
    pids = json.loads((run_dir / "silo_processes.json").read_text())
    os.kill(pids["2"], signal.SIGKILL)
    return time.monotonic()


@needs_mnist
@needs_grpc
@pytest.mark.parametrize("min_clients", [1, 2])
def test_killed_silo_costs_seconds_with_the_default_timeouts_and_is_recorded(mnist_root, tmp_path, min_clients):
    """round_timeout stays at its default (600 s): the deadline adapts to the measured rounds."""
    run_dir = tmp_path / "silo"
    rounds = 40
    process = _launch(
        mnist_root,
        run_dir,
        {"comm_round": rounds, "frequency_of_the_test": 1, "min_clients_per_round": min_clients},
        wait=False,
    )
    killed_at = _kill_silo_two_mid_run(process, run_dir)
    out, _ = process.communicate(timeout=300)
    ended_after = time.monotonic() - killed_at
    assert process.returncode != 0  # a silo failed; the launcher says so
    assert "silo rank 2 exited with code -9" in out
    # The deadline follows the rule: 10 x the median of the recent rounds measured, at least 5 s,
    # not round_timeout's 600 (the rounds' own time depends on the machine's load).
    adapted = re.search(
        r"round deadline now (\d+\.\d) s: 10 x the median of the last \d measured rounds \((\d+\.\d+) s", out
    )
    assert adapted, out[-5000:]
    deadline, typical = float(adapted.group(1)), float(adapted.group(2))
    assert deadline == pytest.approx(max(5.0, 10 * typical), abs=0.1) and deadline < 600
    summary = json.loads((run_dir / "summary.json").read_text())
    [lost] = summary["lost_silos"]
    assert lost["rank"] == 2 and 1 <= lost["round"] < rounds
    # Killed while training (no update) or between rounds (the next model could not be sent),
    # after the adapted deadline (it may have grown since it was logged, if a later round was slower).
    said = re.match(
        r"(sent no update within|unreachable for) (\d+\.\d) s \(the round deadline.*acted on (\d+\.\d) s after",
        lost["why"],
    )
    assert said, lost
    waited, acted = float(said.group(2)), float(said.group(3))  # the deadline, and when the server acted
    assert deadline <= waited < 600
    # No update: given up on at the deadline. Unreachable: at the deadline, or at once when its port
    # refused the connection (a killed process's port does; a broken connection is retried).
    assert acted >= waited or said.group(1) == "unreachable for", lost
    if min_clients == 1:  # the server finished every round with the silo that answered
        assert "going on without silo rank(s) [2]" in out
        assert summary["status"] == "finished" and summary["rounds"] == rounds
        assert summary["aggregate_calls"] == rounds
        assert "the server exited" not in out
        # The dead silo cost the round in which it was lost the deadline, and no more.
        wall = {e["round"]: e["wall_seconds"] for e in summary["history"]}
        lost_round_took = wall[lost["round"]] - wall[lost["round"] - 1]
        assert acted - 1 < lost_round_took < acted + 15, (lost_round_took, acted)
    else:  # not enough silos left: the server stops, names the missing rank and keeps its model
        assert summary["status"] == "stopped" and "silo rank(s) [2]" in summary["error"]
        assert "fewer than comm_args.min_clients_per_round=2" in summary["error"]
        assert summary["rounds"] < rounds and summary["headline_round"] == summary["rounds"] - 1
        assert (run_dir / "model.pt").exists()
        assert "the server exited with code 1" in out  # failed: too few silos (README, "Exit codes")
        assert "silo rank 1 exited with code 3" in out  # the live silo: its server ended the run early
        assert ended_after < waited + 30  # the deadline, then the server and the live silo end
    assert launched_alive(run_dir) == []


def _silo_config(tmp_path, **overrides):
    return resolve(load_yaml(SILO_YAML), {"client_num_per_round": 2, "tls_dir": str(tmp_path / "tls"), **overrides})


@pytest.mark.fast  # a pure check, though filed beside the runs it guards
def test_address_file_needs_a_row_per_rank(tmp_path):
    path = write_ipconfig(str(tmp_path / "ip.csv"), 2, ports=[9000, 9001])
    assert read_ipconfig(path, 2) == {0: ("127.0.0.1", 9000), 1: ("127.0.0.1", 9001)}
    with pytest.raises(ConfigError, match=r"no row for rank\(s\) \[2\].*listen on all interfaces"):
        read_ipconfig(path, 3)
    bad = tmp_path / "bad.csv"
    bad.write_text("eid,rank,grpc_server_ip,grpc_server_port\n0,0,localhost-ish,9000\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_ipconfig(str(bad), 1)


@pytest.mark.fast  # a pure check, though filed beside the runs it guards
def test_silo_identity_is_checked(tmp_path):
    path = write_ipconfig(str(tmp_path / "ip.csv"), 3)
    config = _silo_config(tmp_path, grpc_ipconfig_path=path)
    check_silo_role(config, 1, "client")
    with pytest.raises(ConfigError, match="--rank R --role"):
        check_silo_role(config, None, None)
    with pytest.raises(ConfigError, match="the server is rank 0"):
        check_silo_role(config, 0, "client")
    with pytest.raises(ConfigError, match=r"--rank 3: silos are ranks 1..2"):
        check_silo_role(config, 3, "client")
    with pytest.raises(ConfigError, match="grpc_ipconfig_path=None"):
        check_silo_role(_silo_config(tmp_path), 0, "server")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"backend": "sp"},
            "comm_args.backend='sp': with common_args.training_type='cross_silo' it must be one of ['GRPC']",
        ),
        ({"min_clients_per_round": 3}, "comm_args.min_clients_per_round=3: must be <= train_args.client_num_per_round"),
        ({"round_timeout": 0}, "comm_args.round_timeout=0: must be > 0"),
        (
            {"tls_dir": None},
            "comm_args.tls_dir=None: a cross-silo process does not start without TLS; give "
            "comm_args.tls_dir (make certificates with: fedml-perfedavg certs --out DIR --clients N)",
        ),
        ({"insecure": True}, "comm_args.tls_dir="),
        ({"max_message_bytes": 10}, "comm_args.max_message_bytes=10: must be >= 1024"),
    ],
)
@pytest.mark.fast  # a pure check, though filed beside the runs it guards
def test_cross_silo_keys_are_validated(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        _silo_config(tmp_path, **overrides)
    assert message in str(err.value)


def test_launcher_checks_the_number_of_silos(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "launch-silo",
            "--cf",
            SILO_YAML,
            "--clients",
            "3",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 2
    assert "train_args.client_num_per_round=10: must equal --clients (3)" in out.stderr


@needs_mnist
@needs_grpc
def test_fedmls_dp_attack_and_defense_give_the_single_process_model_across_silos(mnist_root, tmp_path):
    sets = {
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "ldp",
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
        "defense_args.defense_type": "norm_diff_clipping",
        "defense_args.norm_bound": 0.3,
    }
    code, out = _launch(mnist_root, tmp_path / "silo", {"comm_round": 2, **sets})
    assert code == 0, out[-5000:]
    from fedml_perfedavg.run.config import parse_overrides

    overrides = {
        **SETTINGS,
        "comm_round": 2,
        "data_cache_dir": mnist_root,
        **parse_overrides([f"{k}={v}" for k, v in sets.items()]),
    }
    batched = run(resolve(load_yaml(HF_YAML), overrides), str(tmp_path / "batched"))
    plain = run(
        resolve(load_yaml(HF_YAML), {**SETTINGS, "comm_round": 2, "data_cache_dir": mnist_root}),
        str(tmp_path / "plain"),
    )
    silo_model = torch.load(tmp_path / "silo" / "model.pt")
    for k in silo_model:
        torch.testing.assert_close(silo_model[k], batched.final_state[k], rtol=1e-5, atol=1e-6)
    assert max(float((silo_model[k] - plain.final_state[k]).abs().max()) for k in silo_model) > 1e-3
