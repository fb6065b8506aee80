"""Nothing lost, nothing overwritten: the command line on a full disk (a small tmpfs), a
read-only one, a run directory that holds a run, and --resume on a finished run."""

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from tests.helpers import REPO, needs_mnist

SETTINGS = {
    "client_num_per_round": 5,
    "comm_round": 6,
    "frequency_of_the_test": 2,
    "local_steps": 2,
    "show_progress": False,
    "checkpoint_every": 2,
}
QUICK = str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")


def _cli(tmp_path, mnist_root, *extra, settings=None):
    sets = {**SETTINGS, "data_cache_dir": mnist_root, **(settings or {})}
    command = [
        sys.executable,
        "-m",
        "fedml_perfedavg",
        "--cf",
        QUICK,
        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        *extra,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")},
    )


@pytest.fixture
def mounted(tmp_path):
    """A tmpfs of a given size (and options) under tmp_path; unmounted afterwards."""
    points = []

    def mount(size_kb, options=""):
        point = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k{options}", "tmpfs", str(point)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@needs_mnist
def test_a_full_disk_ends_the_run_cleanly_naming_the_file_and_keeping_the_record(tmp_path, mnist_root, mounted):
    disk = mounted(160)  # summary.json fits; a checkpoint (2 x 275 KB model) and model.pt do not
    run_dir = disk / "run"
    out = _cli(tmp_path, mnist_root, "--run-dir", str(run_dir))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert f"cannot write checkpoint.pt in {run_dir}: the disk is full" in out.stderr
    assert "the checkpoint before failed too, so the run stops here" in out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "the disk is full" in summary["error"]
    assert [h["round"] for h in summary["history"]] == [0, 2]
    assert not list(run_dir.glob("*.tmp"))
    assert not (run_dir / "model.pt").exists() or torch.load(run_dir / "model.pt", weights_only=True)


@needs_mnist
def test_a_read_only_disk_or_a_file_in_the_way_is_a_clean_error(tmp_path, mnist_root, mounted):
    disk = mounted(64, ",ro")
    out = _cli(tmp_path, mnist_root, "--run-dir", str(disk / "run"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "the file system is read-only" in out.stderr and str(disk) in out.stderr
    (tmp_path / "a-file").write_text("x")
    out = _cli(tmp_path, mnist_root, "--run-dir", str(tmp_path / "a-file" / "run"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "a-file" in out.stderr


@needs_mnist
def test_a_run_directory_is_never_silently_reused(tmp_path, mnist_root):
    run_dir = tmp_path / "run"
    assert _cli(tmp_path, mnist_root, "--run-dir", str(run_dir)).returncode == 0
    first = json.loads((run_dir / "summary.json").read_text())
    first_model = torch.load(run_dir / "model.pt", weights_only=True)

    again = _cli(tmp_path, mnist_root, "--run-dir", str(run_dir), settings={"random_seed": 1})
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"run directory '{run_dir}' holds a run (summary.json, config.yaml, model.pt, checkpoint.pt" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert json.loads((run_dir / "summary.json").read_text()) == first  # untouched

    done = subprocess.run(
        [sys.executable, "-m", "fedml_perfedavg", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0 and "finished all 6 rounds already; nothing to train" in done.stdout
    assert json.loads((run_dir / "summary.json").read_text()) == first

    more = subprocess.run(
        [sys.executable, "-m", "fedml_perfedavg", "--resume", str(run_dir), "--set", "comm_round=8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert "finished 6 rounds; continuing it to comm_round=8" in more.stderr
    longer = json.loads((run_dir / "summary.json").read_text())
    assert longer["rounds"] == 8 and [h["round"] for h in longer["history"]][-1] == 7
    assert longer["history"][: len(first["history"])] == first["history"]

    replaced = _cli(tmp_path, mnist_root, "--run-dir", str(run_dir), "--overwrite", settings={"random_seed": 1})
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 6 and summary["config"]["common_args"]["random_seed"] == 1
    assert not all(torch.equal(v, first_model[k]) for k, v in torch.load(run_dir / "model.pt").items())
