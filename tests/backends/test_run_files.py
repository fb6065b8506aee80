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


def _resume(tmp_path, run_dir, *extra):
    """``fedml-perfedavg --resume RUN_DIR`` with ``extra`` arguments, as a user types it."""
    command = [sys.executable, "-m", "fedml_perfedavg", "--resume", str(run_dir), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


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

    done = _resume(tmp_path, run_dir)
    assert done.returncode == 0 and "finished all 6 rounds already; nothing to train" in done.stdout
    assert json.loads((run_dir / "summary.json").read_text()) == first

    more = _resume(tmp_path, run_dir, "--set", "comm_round=8")
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


def _popen_cli(tmp_path, mnist_root, *extra, settings=None):
    sets = {**SETTINGS, "data_cache_dir": mnist_root, **(settings or {})}
    command = [sys.executable, "-m", "fedml_perfedavg", "--cf", QUICK]
    command += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + list(extra)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)


@needs_mnist
def test_overwrite_or_resume_of_a_folder_a_live_run_writes_is_refused_naming_the_process(tmp_path, mnist_root):
    """Issue 55 item 7: --overwrite on the folder of a run still going rewrote its config.yaml and
    summary.json. The live run holds its folder (a lock the kernel drops when the process ends):
    --overwrite and --resume are refused, exit 2, naming its pid; the live run ends untouched;
    once it has ended (killed, here) --resume goes on."""
    import signal

    from tests.helpers import wait_for_text

    run_dir = tmp_path / "run"
    live = _popen_cli(tmp_path, mnist_root, "--run-dir", str(run_dir), settings={"comm_round": 100000})
    try:
        wait_for_text(run_dir / "run.log", "round 2: personalized accuracy", lambda: live.poll() is None)
        config_before = (run_dir / "config.yaml").read_bytes()
        for extra in (["--overwrite"], []):
            refused = _cli(tmp_path, mnist_root, "--run-dir", str(run_dir), *extra, settings={"random_seed": 1})
            assert refused.returncode == 2, refused.stderr[-3000:]
            assert f"run directory '{run_dir}' is in use by a live process (pid {live.pid} on " in refused.stderr
        resumed = _resume(tmp_path, run_dir)
        assert resumed.returncode == 2 and f"in use by a live process (pid {live.pid} on " in resumed.stderr
        assert (run_dir / "config.yaml").read_bytes() == config_before
        assert live.poll() is None  # still running, its folder as it left it
    finally:
        live.send_signal(signal.SIGKILL)
        live.communicate(timeout=60)
    again = _resume(tmp_path, run_dir, "--set", "comm_round=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


@needs_mnist
def test_a_server_that_fails_at_start_leaves_nothing_its_corrected_retry_trips_on(tmp_path, mnist_root):
    """Issue 55 item 7: a cross-silo server whose own port is taken fails at start; its record
    (summary.json: stopped, 0 rounds) was then "holds a run" to the corrected retry. A record of a
    start that failed before round 0 is replaced, saying so; one with rounds stays refused."""
    import socket

    from fedml_perfedavg.net.addresses import free_ports, write_ipconfig
    from tests.helpers import SILO_YAML, make_tls, rank_command

    run_dir = tmp_path / "run"
    ports = free_ports(2)
    ipconfig = write_ipconfig(str(tmp_path / "ip.csv"), 2, ports=ports)
    sets = {"data_cache_dir": mnist_root, "grpc_ipconfig_path": ipconfig, "tls_dir": make_tls(tmp_path / "tls", 1)}
    sets.update({"client_num_in_total": 2, "client_num_per_round": 1, "comm_round": 2, "connect_timeout": 3})
    command = rank_command([sys.executable, "-m", "fedml_perfedavg"], SILO_YAML, run_dir, sets, 0, "retry")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}
    busy = socket.socket()
    busy.bind(("127.0.0.1", ports[0]))
    busy.listen(1)
    try:
        first = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    finally:
        busy.close()
    assert first.returncode != 0 and "the port is in use" in first.stdout + first.stderr, first.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 0
    retry = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    said = retry.stdout + retry.stderr
    assert "holds a run" not in said, said[-3000:]
    assert "replacing the record of a start that failed (stopped: " in said, said[:3000]
    assert "the port is in use" in said.split("replacing the record", 1)[1].split("\n", 1)[0], said[:3000]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "did not come online" in str(summary["error"]), summary  # it ran this time: no silo came
