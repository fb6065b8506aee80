"""As a FedML user works: FedML's own step-by-step main script plus one import, a FedML YAML
switched to PerFedAvg with FedML's `lr` model, in a subprocess, offline (a network namespace
with only loopback, and an audit hook that records any other socket use); sp (batched engine
and FedML's loop), MPI (3 ranks) and cross-silo gRPC (server + 2 silos) give the same model, which
the model object the script handed FedMLRunner holds afterwards."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import EXAMPLE, NETWORK_GUARD, REPO, example_yaml, needs_mnist, offline

SCRIPT = str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py")
# FedML's main as above, saving at the end what the model object it handed FedMLRunner holds
USER_MODEL = str(REPO / "tests" / "backends" / "user_model_main.py")
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


def _env(tmp_path, run_name=None):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    saved = {"USER_MODEL_OUT": str(tmp_path / f"user-{run_name}.pt")} if run_name else {}
    return {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home), **saved}


def _summary(tmp_path, run_name):
    run_dir = tmp_path / "runs" / run_name
    return json.loads((run_dir / "summary.json").read_text()), torch.load(run_dir / "model.pt")


def _check(out, processes=1):
    printed = out.stdout + out.stderr
    assert out.returncode == 0, printed[-5000:]
    assert printed.count("NETWORK_ATTEMPTS []") == processes, printed[-3000:]


@needs_mnist
def test_fedml_stock_main_runs_perfedavg_on_every_backend_with_one_model(mnist_root, tmp_path):
    runs = {}
    for engine in ("batched", "fedml"):
        path = example_yaml(
            tmp_path, "fedml_config.yaml", mnist_root, f"sp-{engine}", tmp_path / "runs", simulation_engine=engine
        )
        out = subprocess.run(
            offline([sys.executable, "-c", NETWORK_GUARD, "--script", USER_MODEL, "--cf", path]),
            capture_output=True,
            text=True,
            env=_env(tmp_path, f"sp-{engine}"),
            timeout=300,
            cwd=tmp_path,
        )
        _check(out)
        assert "round 2: personalized accuracy" in out.stderr  # the plugin's evaluation reaches the console
        runs[engine] = _summary(tmp_path, f"sp-{engine}")
    if MPIRUN is not None:
        path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "runs")
        out = subprocess.run(
            offline([MPIRUN, "-n", "3", sys.executable, "-c", NETWORK_GUARD, "--script", USER_MODEL, "--cf", path]),
            capture_output=True,
            text=True,
            env=_env(tmp_path, "mpi"),
            timeout=300,
            cwd=tmp_path,
        )
        _check(out, processes=3)
        runs["mpi"] = _summary(tmp_path, "mpi")
    (tmp_path / "ipconfig.csv").write_text(
        "eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(f"{r},{r},127.0.0.1,{19370 + r}\n" for r in range(3))
    )
    path = example_yaml(
        tmp_path,
        "fedml_config_silo.yaml",
        mnist_root,
        "silo",
        tmp_path / "runs",
        grpc_ipconfig_path=str(tmp_path / "ipconfig.csv"),
    )
    # no run_name: the server and each silo, started apart, name one folder from the YAML and --run_id
    silo_yaml = yaml.safe_load(Path(path).read_text())
    del silo_yaml["common_args"]["run_name"]
    Path(path).write_text(yaml.safe_dump(silo_yaml))
    script = (
        " & ".join(
            f'{sys.executable} -c "$GUARD" --script {USER_MODEL} --cf {path} --rank {r} --role '
            f"{'server' if r == 0 else 'client'} --run_id 5"
            for r in range(3)
        )
        + " & wait"
    )
    out = subprocess.run(
        offline(["sh", "-c", script]),
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(tmp_path, "silo"), "GUARD": NETWORK_GUARD},
        cwd=tmp_path,
    )
    _check(out, processes=3)
    assert not [name for name in os.listdir(tmp_path / "runs") if name.startswith("silo") and name != "silo-run-5"]
    os.rename(tmp_path / "runs" / "silo-run-5", tmp_path / "runs" / "silo")
    runs["silo"] = _summary(tmp_path, "silo")
    # the module FedML's main handed FedMLRunner holds the final global model, on every backend
    for name in ("sp-batched", "sp-fedml", *(["mpi"] if MPIRUN is not None else []), "silo"):
        final = torch.load(tmp_path / "runs" / name / "model.pt")
        user_model = torch.load(tmp_path / f"user-{name}.pt")
        assert all(torch.equal(user_model[k], final[k]) for k in final), name

    reference_summary, reference_model = runs["fedml"]
    for backend, (summary, model) in runs.items():
        assert summary["status"] == "finished" and summary["rounds"] == 3, backend
        assert summary["aggregate_calls"] == 3, backend  # the plugin's algorithm aggregated every round
        assert [h["round"] for h in summary["history"]] == [0, 1, 2], backend
        assert summary["config"]["model_args"]["model"] == "lr"
        for k in reference_model:
            torch.testing.assert_close(model[k], reference_model[k], rtol=1e-5, atol=1e-6, msg=backend)
        assert summary["per_user_accuracy"] == pytest.approx(reference_summary["per_user_accuracy"], abs=1e-6)
    assert not any((tmp_path / "home").iterdir())  # FedML's files went to the run directories
    assert not (tmp_path / "logs").exists()  # nor did FedML leave a logs folder in the working directory


@needs_mnist
def test_a_trainer_handed_to_fedmlrunner_is_really_used(mnist_root, tmp_path, monkeypatch):
    """FedML's sp simulator would silently run its own trainer; with the plugin's fixes asked for
    (``common_args.plugin_fixes: true``) the user's pair runs, hooks included. Without the switch
    FedML's own FedAvg is FedML's: the plugin imported changes nothing (issue 77)."""
    import fedml_perfedavg  # noqa: F401
    import fedml
    from fedml import FedMLRunner

    from tests.backends.own_pair_main import CALLS, CountingAggregator, PlusOneTrainer

    CALLS.update({k: 0 for k in CALLS})
    # plugin_fixes would also move FedML's own classes onto the plugin's transport and MPI loop for the
    # rest of this process (this test's worker): the dispatch alone is under test here
    install = __import__("importlib").import_module("fedml_perfedavg.fedml_bridge.install")
    monkeypatch.setattr(install, "apply_to_fedml_algorithms", lambda: None)
    path = example_yaml(
        tmp_path,
        "fedml_config.yaml",
        mnist_root,
        "mine",
        tmp_path / "runs",
        federated_optimizer="FedAvg",
        epochs=1,
        client_optimizer="sgd",
        plugin_fixes=True,
    )
    args = fedml.init(
        yaml.safe_load(open(path))
        and __import__("fedml").arguments.Arguments(
            __import__("argparse").Namespace(
                yaml_config_file=path,
                run_id="0",
                rank=0,
                local_rank=0,
                node_rank=0,
                role="client",
                run_device_id="0",
                using_mlops=False,
            )
        ),
        should_init_logs=False,
    )
    device = fedml.device.get_device(args)
    dataset, output_dim = fedml.data.load(args)
    model = fedml.model.create(args, output_dim)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runner = FedMLRunner(args, device, dataset, model, PlusOneTrainer(model, args), CountingAggregator(model, args))
    runner.run()
    calls = {k: CALLS[k] for k in ("train", "aggregate", "test_all")}
    assert calls == {"train": 3 * 2, "aggregate": 3, "test_all": 3}
    assert all(torch.allclose(model.state_dict()[k], start[k] + 3.0) for k in start)  # +1 per round, averaged
    assert type(runner.runner).__name__ == "SPSimulation"
    args.plugin_fixes = False  # the same pair, not asked for: FedML's own simulator (which drops the pair)
    plain = FedMLRunner(args, device, dataset, model, PlusOneTrainer(model, args), CountingAggregator(model, args))
    assert type(plain.runner).__module__.startswith("fedml."), type(plain.runner)


@needs_mnist
def test_fedml_stock_main_applies_fedmls_dp_attack_and_defense_sections_alike_on_both_sp_engines(mnist_root, tmp_path):
    """A FedML user's YAML with dp_args (its delta after train_args' delta: FedML's flat args hold
    DP's), attack_args and defense_args: one model on both engines, unlike the run without them."""
    runs = {}
    for engine, sections in (("batched", True), ("fedml", True), ("plain", False)):
        path = example_yaml(
            tmp_path,
            "fedml_config.yaml",
            mnist_root,
            f"sp-{engine}",
            tmp_path / "runs",
            simulation_engine="batched" if engine == "plain" else engine,
        )
        config = yaml.safe_load(Path(path).read_text())
        assert config["train_args"].get("delta", 0.001) == 0.001
        config["train_args"]["delta"] = 0.001
        if sections:
            config["dp_args"] = {
                "enable_dp": True,
                "dp_solution_type": "ldp",
                "mechanism_type": "gaussian",
                "epsilon": 0.5,
                "delta": 1e-5,
                "sensitivity": 0.001,
            }
            config["attack_args"] = {
                "enable_attack": True,
                "attack_type": "byzantine",
                "attack_mode": "flip",
                "byzantine_client_num": 1,
            }
            config["defense_args"] = {"enable_defense": True, "defense_type": "norm_diff_clipping", "norm_bound": 0.2}
        Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
        out = subprocess.run(
            offline([sys.executable, "-c", NETWORK_GUARD, "--script", SCRIPT, "--cf", path]),
            capture_output=True,
            text=True,
            env=_env(tmp_path),
            timeout=300,
            cwd=tmp_path,
        )
        _check(out)
        if sections:
            assert (
                "FedML's DP ldp (gaussian, epsilon 0.5, delta 1e-05), attack byzantine, defense "
                "norm_diff_clipping" in out.stderr
            )
        runs[engine] = _summary(tmp_path, f"sp-{engine}")
    (batched_summary, batched), (_, fedml_loop), (_, plain) = runs["batched"], runs["fedml"], runs["plain"]
    assert batched_summary["config"]["train_args"]["delta"] == 0.001
    assert batched_summary["config"]["dp_args"]["delta"] == 1e-5
    for k in batched:
        torch.testing.assert_close(fedml_loop[k], batched[k], rtol=1e-5, atol=1e-6)
    assert max(float((batched[k] - plain[k]).abs().max()) for k in plain) > 1e-3


@needs_mnist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (.[mpi])")
def test_fedml_stock_main_under_mpi_trains_shares_and_gives_the_single_process_model(mnist_root, tmp_path):
    """FedML's own main with backend MPI and 6 clients per round on 2 worker ranks: each trains a
    share of 3, and the model is the sp batched engine's."""
    runs = {}
    for name, yaml_name, command in (
        ("sp", "fedml_config.yaml", []),
        ("mpi", "fedml_config_mpi.yaml", [MPIRUN, "-n", "3"]),
    ):
        path = example_yaml(
            tmp_path, yaml_name, mnist_root, name, tmp_path / "runs", client_num_per_round=6, comm_round=2
        )
        out = subprocess.run(
            offline(command + [sys.executable, "-c", NETWORK_GUARD, "--script", SCRIPT, "--cf", path]),
            capture_output=True,
            text=True,
            env=_env(tmp_path),
            timeout=300,
            cwd=tmp_path,
        )
        _check(out, processes=3 if command else 1)
        runs[name] = _summary(tmp_path, name)
    assert (
        "2 worker ranks, each training a share of the round's 6 clients"
        in (tmp_path / "runs" / "mpi" / "run.log").read_text()
    )
    (_, sp_model), (mpi_summary, mpi_model) = runs["sp"], runs["mpi"]
    assert mpi_summary["status"] == "finished" and mpi_summary["aggregate_calls"] == 2
    for k in sp_model:
        torch.testing.assert_close(mpi_model[k], sp_model[k], rtol=1e-5, atol=1e-6)
