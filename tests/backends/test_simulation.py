"""End-to-end runs through FedML's single-process simulator with the plugin's classes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import load_split, run

from tests.helpers import HF_YAML, NETWORK_GUARD, REPO, needs_mnist, unshare_works


def _config(mnist_root, **overrides):
    base = dict(
        data_cache_dir=mnist_root, show_progress=False, comm_round=2, frequency_of_the_test=1, simulation_engine="fedml"
    )  # these tests are about FedML's own round loop
    base.update(overrides)
    return resolve(load_yaml(HF_YAML), base, source=HF_YAML)


@pytest.fixture(scope="module")
def mnist_data(mnist_root):
    return load_split(_config(mnist_root))


@needs_mnist
def test_sp_run_uses_plugin_classes_and_learns(mnist_root, mnist_data, tmp_path, monkeypatch):
    from fedml_perfedavg.algorithms import base as algorithm_module

    aggregated = []
    original = algorithm_module.average

    def spy(updates, weighting):
        out = original(updates, weighting)
        aggregated.append((updates, out))
        return out

    monkeypatch.setattr(algorithm_module, "average", spy)
    config = _config(mnist_root, comm_round=10, beta=0.05, frequency_of_the_test=5)
    result = run(config, str(tmp_path / "run"), data=mnist_data)

    assert result.trainer.train_calls == 10 * 10 and result.algorithm.aggregate_calls == 10
    # the server's model is the plain (uniform) average, although users hold 980 or 490 samples
    updates, out = aggregated[-1]
    mean = {k: sum(sd[k] for _, sd in updates) / len(updates) for k in out}
    assert all(torch.allclose(out[k], mean[k], atol=1e-7) for k in out)
    mixed = [(u, o) for u, o in aggregated if len({n for n, _ in u}) > 1]
    assert mixed, "some round should mix users with 980 and 490 samples"
    u, o = mixed[0]
    weighted = {k: sum(n * sd[k] for n, sd in u) / sum(n for n, _ in u) for k in o}
    assert not all(torch.allclose(o[k], weighted[k], atol=1e-7) for k in o)
    final = result.final_state
    assert all(torch.equal(final[k], out[k]) for k in out)

    history = result.summary["history"]
    assert [h["round"] for h in history] == [0, 5, 9]
    assert result.summary["personalized_accuracy"] > 0.4  # chance is 0.1
    assert result.summary["personalized_accuracy"] > history[0]["personalized_accuracy"] + 0.2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "personalized_accuracy",
        "accuracy_before_adaptation",
        "per_user_accuracy",
        "rounds",
        "wall_seconds",
        "config",
    ):
        assert key in summary
    assert len(summary["per_user_accuracy"]) == 50 and summary["rounds"] == 10
    assert summary["config"]["train_args"]["beta"] == 0.05
    assert (tmp_path / "run" / "model.pt").exists()


@needs_mnist
@pytest.mark.parametrize(
    "optimizer,variant", [("FedAvgUpdate", "hf"), ("PerFedAvg", "fo"), ("PerFedAvg", "exact"), ("FedAvgARUBA", "hf")]
)
def test_every_method_runs(mnist_root, mnist_data, tmp_path, optimizer, variant):
    config = _config(
        mnist_root, federated_optimizer=optimizer, perfedavg_variant=variant, client_num_per_round=3, local_steps=2
    )
    result = run(config, str(tmp_path), data=mnist_data)
    assert result.summary["rounds"] == 2 and result.trainer.train_calls == 6
    standard = result.algorithm.standard_update  # the client maths each algorithm declares
    if optimizer == "FedAvgARUBA":
        assert standard is None  # its own (learned rates), not core.client_maths'
    else:
        assert standard.variant == (variant if optimizer == "PerFedAvg" else "sgd")


def test_cifar10_run_on_generated_files(fake_cifar_root, tmp_path):
    config = resolve(
        {
            "data_args": {
                "dataset": "cifar10",
                "data_cache_dir": fake_cifar_root,
                "images_per_class": 8,
                "test_images_per_class": 2,
            }
        },
        dict(
            client_num_in_total=10,
            client_num_per_round=2,
            comm_round=2,
            local_steps=2,
            batch_size=8,
            meta_batch_size=8,
            hessian_batch_size=8,
            show_progress=False,
            frequency_of_the_test=1,
            simulation_engine="fedml",
        ),
    )
    result = run(config, str(tmp_path / "run"))
    assert result.final_state["net.1.weight"].shape[1] == 3072
    assert len(result.summary["per_user_accuracy"]) == 10 and result.summary["rounds"] == 2


@needs_mnist
def test_short_run_sends_nothing_off_the_machine_and_leaves_home_alone(mnist_root, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-c",
        NETWORK_GUARD,
        "--cf",
        HF_YAML,
        "--set",
        f"data_cache_dir={mnist_root}",
        "--set",
        "comm_round=2",
        "--set",
        "show_progress=false",
        "--set",
        "simulation_engine=fedml",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    if unshare_works():
        command = ["unshare", "-n"] + command  # only loopback exists in there
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NETWORK_ATTEMPTS []" in out.stdout
    assert "personalized_accuracy=" in out.stdout
    assert list(home.iterdir()) == []  # FedML's .fedml files went to the run directory
    assert (tmp_path / "run" / "fedml" / ".fedml").is_dir()


def test_wandb_logs_offline_into_the_run_directory(fake_cifar_root, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "run"))
    config = resolve(
        {
            "data_args": {
                "dataset": "cifar10",
                "data_cache_dir": fake_cifar_root,
                "images_per_class": 8,
                "test_images_per_class": 2,
            }
        },
        dict(
            client_num_in_total=10,
            client_num_per_round=2,
            comm_round=2,
            local_steps=1,
            batch_size=8,
            meta_batch_size=8,
            hessian_batch_size=8,
            show_progress=False,
            frequency_of_the_test=1,
            enable_wandb=True,
            wandb_group="test-group",
        ),
    )
    run(config, str(tmp_path / "run"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@needs_mnist
def test_cli_resume_continues_an_interrupted_run(mnist_root, tmp_path):
    from fedml_perfedavg.run.cli import main

    run_dir = tmp_path / "run"
    common = [
        "--set",
        f"data_cache_dir={mnist_root}",
        "--set",
        "show_progress=false",
        "--set",
        "checkpoint_every=2",
        "--set",
        "comm_round=4",
        "--set",
        "frequency_of_the_test=2",
    ]
    assert main(["--cf", HF_YAML, *common, "--run-dir", str(tmp_path / "full")]) == 0
    # an interrupted run: only the first two rounds' checkpoint was written
    assert main(["--cf", HF_YAML, *common, "--set", "comm_round=3", "--run-dir", str(run_dir)]) == 0
    (run_dir / "summary.json").unlink()
    config_text = (run_dir / "config.yaml").read_text().replace("comm_round: 3", "comm_round: 4")
    (run_dir / "config.yaml").write_text(config_text)
    assert main(["--resume", str(run_dir)]) == 0
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["per_user_accuracy"] == full["per_user_accuracy"] and resumed["rounds"] == 4
    a, b = torch.load(tmp_path / "full" / "model.pt"), torch.load(run_dir / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_mnist
def test_a_refused_resume_leaves_a_finished_runs_files_byte_for_byte(mnist_root, tmp_path, capsys):
    """``--resume`` may change comm_round, checkpoint_every and the reporting; any other --set, or a
    run that cannot resume (FedML's sp loop), is refused (exit 2) naming the key, before a file of
    the run is touched (it used to end the run "failed", replace model.pt, or keep `model: cnn` in
    config.yaml so that every later resume failed)."""
    from fedml_perfedavg.run.cli import main

    def files(run_dir):
        return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    common = ["--set", f"data_cache_dir={mnist_root}", "--set", "show_progress=false", "--set", "comm_round=2"]
    runs = {engine: tmp_path / engine for engine in ("batched", "fedml")}
    for engine, run_dir in runs.items():
        sets = [
            "--set",
            f"simulation_engine={engine}",
            "--set",
            "client_num_in_total=4",
            "--set",
            "client_num_per_round=2",
        ]
        assert main(["--cf", HF_YAML, *common, *sets, "--run-dir", str(run_dir)]) == 0
    before = {engine: files(run_dir) for engine, run_dir in runs.items()}
    capsys.readouterr()
    refusals = [
        ("batched", ["model=cnn"], "cannot change model_args.model='cnn' (the run's: "),
        ("batched", ["comm_round=4", "local_steps=5", "alpha=0.5"], "train_args.alpha=0.5 (the run's: "),
        ("batched", ["simulation_engine=fedml"], "train_args.simulation_engine='fedml' (the run's: 'batched')"),
        ("fedml", ["comm_round=4"], "resuming needs the batched engine on sp or a cross-silo server"),
    ]
    for engine, sets, says in refusals:
        assert main(["--resume", str(runs[engine]), *[a for s in sets for a in ("--set", s)]]) == 2
        err = capsys.readouterr().err
        assert says in err, err
        if "cannot change" in says:
            assert "train_args.local_steps=5" in err or "local_steps" not in " ".join(sets)
            assert "Allowed with --resume: --set comm_round, checkpoint_every, enable_wandb" in err
        assert files(runs[engine]) == before[engine], engine
    # What --resume may change, it takes: two more rounds, from the checkpoint, without a progress bar.
    assert main(["--resume", str(runs["batched"]), "--set", "comm_round=4", "--set", "checkpoint_every=1"]) == 0
    assert json.loads((runs["batched"] / "summary.json").read_text())["rounds"] == 4


@needs_mnist
def test_ctrl_c_keeps_the_round_it_lands_in_and_resume_gives_the_uninterrupted_model(mnist_root, tmp_path):
    """The quick start interrupted by Ctrl-C (SIGINT) mid-run, checkpoint_every 100 as shipped:
    the run stops at the end of the round the signal came in, with a checkpoint of it, exits 130,
    and ``--resume`` gives the uninterrupted run's model bit for bit (it used to find no checkpoint
    and start again from round 0)."""
    import signal
    import subprocess
    import sys
    import time

    quickstart = str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    sets = [f"data_cache_dir={mnist_root}", "comm_round=30", "show_progress=false"]
    command = [sys.executable, "-m", "fedml_perfedavg", "--cf", quickstart, *[a for s in sets for a in ("--set", s)]]

    def finish(*args):
        out = subprocess.run([*command[:3], *args], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    finish(*command[3:], "--run-dir", str(tmp_path / "whole"))
    run_dir = tmp_path / "interrupted"
    process = subprocess.Popen(
        [*command, "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        log, deadline = run_dir / "run.log", time.monotonic() + 200
        while not (log.exists() and "round 10: personalized accuracy" in log.read_text()):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        out = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert process.returncode == 130, out[-3000:]
    assert "SIGINT: the run stops at the end of this round, kept for --resume" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 10 < summary["rounds"] < 30, summary["rounds"]
    resumed = finish("--resume", str(run_dir))
    assert f"resumed {run_dir} at round {summary['rounds']}" in resumed.stderr + resumed.stdout
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    again = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 30


@needs_mnist
def test_a_population_larger_than_mnist_runs_on_the_resampled_split(mnist_root, tmp_path):
    """``partition_method: paper_resampled``: 400 users of the paper's size, which the disjoint split
    refuses (MNIST holds too few images of each class), train and are all evaluated; their images
    are held as read, uint8, each user's tensors views of one block."""
    from fedml_perfedavg.core.errors import ConfigError

    sets = dict(
        partition_method="paper_resampled",
        client_num_in_total=400,
        client_num_per_round=20,
        comm_round=2,
        frequency_of_the_test=2,
        data_cache_dir=mnist_root,
        show_progress=False,
        checkpoint_every=0,
    )
    with pytest.raises(ConfigError, match="400 users would need .* images of class"):
        resolve({}, {**sets, "partition_method": "paper"})
    config = resolve({}, sets)
    result = run(config, str(tmp_path / "run"))
    assert result.summary["status"] == "finished" and len(result.summary["per_user_accuracy"]) == 400
    assert 0.0 < result.summary["personalized_accuracy"] < 1.0
    users = load_split(config).users
    assert users[0].train_x.dtype == torch.uint8
    assert users[1].train_x.data_ptr() == users[0].train_x.data_ptr() + users[0].train_x.numel()
