"""Bad input through the command line, one row each: the exit code, no traceback, and words that
name the file or key, the value and what to do."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MNIST_ROOT, REPO, needs_mnist

QUICK = str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")
RAW = Path(MNIST_ROOT) / "MNIST" / "raw"
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _mnist_copy(root: Path, damage=None) -> str:
    """MNIST's raw files linked under ``root``; ``damage(name, data) -> bytes`` rewrites one."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FILES:
        if damage is not None and damage(name, None) is not None:
            (raw / name).write_bytes(damage(name, (RAW / name).read_bytes()))
        else:
            os.symlink(RAW / name, raw / name)
    return str(root)


def _truncated_images(name, data):
    if name != "train-images-idx3-ubyte":
        return None
    return b"" if data is None else data[:100_000]


def _bad_magic_labels(name, data):
    if name != "train-labels-idx1-ubyte":
        return None
    return b"" if data is None else b"\x00\x00\x09\x99" + data[4:]


def _labels_out_of_range(name, data):
    if name != "t10k-labels-idx1-ubyte":
        return None
    return b"" if data is None else data[:8] + bytes([12]) + data[9:]


def _address_file(tmp_path, rows):
    path = tmp_path / "ip.csv"
    path.write_text("eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(f"{r}\n" for r in rows))
    return str(path)


CASES = {
    "learning_rate inf": (
        lambda t: ["--set", "learning_rate=.inf"],
        2,
        ["train_args.learning_rate=inf (read as train_args.beta): must be a finite number"],
    ),
    "--cf a folder": (lambda t: ["--cf", str(t)], 2, ["is a folder; give a YAML file"]),
    "unknown algorithm": (lambda t: ["--set", "federated_optimizer=PerFedAvgg"], 2, ["did you mean 'PerFedAvg'?"]),
    "truncated images": (
        lambda t: ["--set", f"data_cache_dir={_mnist_copy(t / 'd', _truncated_images)}"],
        2,
        ["mnist under", "damaged", "replace"],
    ),
    "labels with a bad magic number": (
        lambda t: ["--set", f"data_cache_dir={_mnist_copy(t / 'd', _bad_magic_labels)}"],
        2,
        ["mnist under", "damaged or not mnist"],
    ),
    "labels out of range": (
        lambda t: ["--set", f"data_cache_dir={_mnist_copy(t / 'd', _labels_out_of_range)}"],
        2,
        ["the test labels hold 0..12, outside the 10 classes 0..9"],
    ),
    "run directory under a file": (
        lambda t: (t / "f").write_text("x") and ["--run-dir", str(t / "f" / "run")],
        1,
        ["a part of the path is a file"],
    ),
    "output_dir under a file": (
        lambda t: (t / "f").write_text("x") and ["--set", f"output_dir={t / 'f' / 'out'}"],
        1,
        ["a part of the path is a file"],
    ),
    "a rank twice in the address file": (
        lambda t: [
            "--set",
            "training_type=cross_silo",
            "--set",
            "backend=GRPC",
            "--set",
            "client_num_per_round=1",
            "--set",
            "insecure=true",
            "--set",
            "grpc_ipconfig_path="
            + _address_file(t, ["0,0,127.0.0.1,9100", "1,1,127.0.0.1,9101", "1,1,127.0.0.1,9102"]),
            "--rank",
            "0",
            "--role",
            "server",
        ],
        2,
        ["lines 3 and 4 both give eid 1 (the column FedML keys"],
    ),
    "an MPI config without mpirun": (
        lambda t: ["--set", "backend=MPI", "--set", "client_num_per_round=2"],
        2,
        [
            "comm_args.backend='MPI' with 1 process: an MPI run needs a server rank and at "
            "least one worker; start it under mpirun -n 2 to 3"
        ],
    ),
    "eid and rank that differ in the address file": (
        lambda t: [
            "--set",
            "training_type=cross_silo",
            "--set",
            "backend=GRPC",
            "--set",
            "client_num_per_round=1",
            "--set",
            "insecure=true",
            "--set",
            "grpc_ipconfig_path=" + _address_file(t, ["0,0,127.0.0.1,9100", "7,1,127.0.0.1,9101"]),
            "--rank",
            "0",
            "--role",
            "server",
        ],
        2,
        ["line 3: eid 7 but rank 1; FedML keys each process by the eid column"],
    ),
    "two ranks on one port": (
        lambda t: [
            "--set",
            "training_type=cross_silo",
            "--set",
            "backend=GRPC",
            "--set",
            "client_num_per_round=1",
            "--set",
            "insecure=true",
            "--set",
            "grpc_ipconfig_path=" + _address_file(t, ["0,0,127.0.0.1,9100", "1,1,127.0.0.1,9100"]),
            "--rank",
            "0",
            "--role",
            "server",
        ],
        2,
        ["rank 1 and rank 0 (line 2) share 127.0.0.1:9100"],
    ),
}


@needs_mnist
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_ends_in_a_clean_message(tmp_path, case):
    make_args, code, words = CASES[case]
    args = make_args(tmp_path)
    command = [
        sys.executable,
        "-m",
        "fedml_perfedavg",
        "--cf",
        QUICK,
        "--set",
        f"data_cache_dir={MNIST_ROOT}",
        "--set",
        "comm_round=2",
        "--set",
        "output_dir=" + str(tmp_path / "runs"),
        *args,
    ]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")},
    )
    assert out.returncode == code, (out.stdout + out.stderr)[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for word in words:
        assert word in out.stderr, (word, out.stderr[-2000:])
    shutil.rmtree(tmp_path / "d", ignore_errors=True)


MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")


@needs_mnist
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (.[mpi])")
def test_a_bad_rank_count_under_mpirun_says_only_that_and_leaves_nothing(tmp_path):
    """Every rank checks the layout before it opens a file in the run directory, which a failed
    start removes (each rank once told the other's missing run-rank1.log)."""
    for attempt in range(2):
        run_dir = tmp_path / f"run{attempt}"
        out = subprocess.run(
            [
                MPIRUN,
                "-n",
                "3",
                sys.executable,
                "-m",
                "fedml_perfedavg",
                "--cf",
                str(REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf_mpi.yaml"),
                "--set",
                f"data_cache_dir={MNIST_ROOT}",
                "--set",
                "client_num_per_round=1",
                "--run-dir",
                str(run_dir),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")},
        )
        printed = out.stdout + out.stderr
        assert out.returncode != 0 and "Traceback" not in printed and "Errno" not in printed, printed[-3000:]
        assert "train_args.client_num_per_round=1: under MPI each of the ranks but the server trains a share" in printed
        assert "must be at least the number of ranks - 1 (this is mpirun -n 3: at least 2" in printed
        assert not run_dir.exists()
