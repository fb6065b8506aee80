"""The command line: clean errors, usage, and --describe-data."""

import subprocess
import sys

import pytest

from fedml_perfedavg.run.cli import main

from tests.helpers import REPO, needs_mnist

CONFIGS = sorted((REPO / "yaml_configs").glob("*.yaml"))


def test_cli_reports_config_errors_without_a_traceback(capsys, tmp_path):
    assert main(["--cf", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["--set", "alpha=0"]) == 2
    err = capsys.readouterr().err
    assert "--cf CONFIG.yaml is required" in err and "usage: fedml-perfedavg" in err
    assert main(["--cf", str(CONFIGS[0]), "--set", "alpha=0"]) == 2
    assert "train_args.alpha=0: must be > 0" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nowhere")]) == 2
    assert "no config.yaml there; is it a run directory" in capsys.readouterr().err


def test_a_command_called_in_process_leaves_logging_as_it_found_it(tmp_path, capsys):
    """main() called from a test or a notebook: its console handler, on a stream the caller may
    close (capsys's here), is gone afterwards, so later lines do not fail with "I/O operation on a
    closed file" (every later test's output once held dozens of those blocks)."""
    import logging

    root = logging.Logger.manager.root
    handlers, level = root.handlers[:], root.level
    # export-split sets the command line's console, then fails on the missing YAML
    assert main(["export-split", "--cf", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert root.handlers == handlers and root.level == level
    logging.getLogger("fedml_perfedavg.test").warning("a line after the command")
    assert "Logging error" not in capsys.readouterr().err


@needs_mnist
def test_describe_data_prints_the_paper_counts(mnist_root):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "--cf",
            str(CONFIGS[-1]),
            "--describe-data",
            "--set",
            f"data_cache_dir={mnist_root}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[2].split()[:3] == ["0", "980", "160"]
    assert lines[2 + 25].split()[:3] == ["25", "490", "80"]
    assert len(lines) == 2 + 50


@pytest.mark.backend  # the start gets as far as installing into FedML (about 13 s to import)
def test_a_failed_start_leaves_no_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "--cf",
                str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml"),
                "--set",
                f"data_cache_dir={tmp_path / 'nowhere'}",
                "--run-dir",
                str(run_dir),
            ]
        )
        == 2
    )
    assert "mnist not found: expected its files under" in capsys.readouterr().err
    assert not run_dir.exists()
    kept = tmp_path / "kept"
    kept.mkdir()  # a directory the user made is never removed
    assert (
        main(
            [
                "--cf",
                str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml"),
                "--set",
                f"data_cache_dir={tmp_path / 'nowhere'}",
                "--run-dir",
                str(kept),
            ]
        )
        == 2
    )
    assert kept.exists()


@pytest.mark.parametrize("build", [None, "12.8"])
def test_using_gpu_where_torch_has_no_cuda_device_is_refused_at_start(tmp_path, capsys, monkeypatch, build):
    """It once trained on the CPU, FedML saying only "ML engine install was not built with GPU
    enabled", and summary.json recorded using_gpu: True."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)
    run_dir = tmp_path / "run"
    yaml = str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")
    assert main(["--cf", yaml, "--set", "using_gpu=true", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "device_args.using_gpu=True: this torch (" in err and "so the run would train on the CPU" in err
    assert ("is a CPU build" if build is None else "CUDA 12.8) sees no CUDA device") in err
    assert "docs/fedml.md, 'On a CUDA machine'" in err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "sets, extra, missing",
    [
        pytest.param(  # looks gRPC up, which a fast test may not
            ["training_type=cross_silo", "backend=GRPC", "tls_dir=/nowhere"],
            "silo",
            "safetensors",
            marks=pytest.mark.backend,
        ),
        (["backend=MPI"], "mpi", "mpi4py"),
        (
            [
                "dp_args.enable_dp=true",
                "dp_args.dp_solution_type=dpsgd",
                "dp_args.noise_multiplier=1",
                "dp_args.max_grad_norm=1",
                "dp_args.delta=1e-5",
            ],
            "dp",
            "opacus",
        ),
    ],
)
def test_a_run_whose_extra_is_not_installed_is_refused_naming_the_extra(
    tmp_path, capsys, monkeypatch, sets, extra, missing
):
    """A plain `pip install .` brings no extra: cross-silo once failed deep inside with
    "ModuleNotFoundError: safetensors" (issue 55, item 9)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    run_dir = tmp_path / "run"
    yaml = str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")
    assert main(["--cf", yaml, *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"needs the plugin's {extra!r} extra, and {missing} is not installed here" in err, err
    assert f"pip install -c constraints.txt 'fedml-perfedavg[{extra}]'" in err
    assert not run_dir.exists()


def _summary(**overrides):
    summary = {
        "status": "finished",
        "error": None,
        "rounds": 4,
        "headline_round": 3,
        "wall_seconds": 2.5,
        "personalized_accuracy": 0.75,
        "accuracy_before_adaptation": 0.5,
        "personalized_accuracy_std": 0.25,
        "per_user_accuracy": [0.5, 1.0],
        "per_user_accuracy_before_adaptation": [0.25, 0.75],
        "new_users": [1],
        "config": {"train_args": {"federated_optimizer": "PerFedAvg", "perfedavg_variant": "hf"}},
    }
    summary.update(overrides)
    return summary


def test_show_prints_a_run_and_compares_runs(tmp_path, capsys):
    import json

    for name, summary in {
        "a": _summary(),
        "b": _summary(
            status="stopped",
            error="silo rank(s) [2] sent no update",
            lost_silos=[{"rank": 2, "round": 1, "why": "gone"}],
            config={"train_args": {"federated_optimizer": "FedAvgUpdate"}},
            personalized_accuracy=0.6,
            train_history=[
                {"round": 2, "train_loss": 2.5, "train_accuracy": 0.25, "train_clients": 10},
                {"round": 3, "train_loss": 1.234, "train_accuracy": 0.5625, "train_clients": 10},
            ],
        ),
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert main(["show", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "PerFedAvg (hf), finished, 4 rounds" in out
    assert "personalized accuracy 75.00% (before adaptation 50.00%) at round 3" in out
    assert "     0   50.00    25.00\n" in out and "     1  100.00    75.00  (new user)" in out
    assert "training loss" not in out  # a run that recorded none says nothing of it
    assert main(["show", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "  training loss 1.234, accuracy 56.25% in round 3 (10 clients' local steps)" in out
    assert "ended by: silo rank(s) [2] sent no update" in out and "lost silo rank 2 in round 1: gone" in out
    assert main(["show", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "method", "status", "rounds", "after%", "before%", "std%"]
    assert lines[1].split()[1:] == ["PerFedAvg", "(hf)", "finished", "4", "75.00", "50.00", "25.00"]
    assert lines[2].split()[1:4] == ["FedAvgUpdate", "stopped", "4"]
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert "no summary.json there" in capsys.readouterr().err
