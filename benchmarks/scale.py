"""How a round scales: clients per round and users on the batched engine, and worker ranks on MPI.

    python benchmarks/scale.py [--rounds 3] [--out benchmarks/results]

Batched engine (Per-FedAvg HF, the paper's MNIST config but for n and clients per round): train
ms/round and the process's peak RSS for clients per round 10, 100, 1000 and users 50, 1,000,
10,000 (the paper split's 50 users replicated; replicas share their tensors), each in a fresh
process. MPI: 100 clients per round on 1, 2 and 4 worker ranks (``mpirun -n W+1``, the plugin's
command line), ms/round from summary.json's training time and each rank's peak RSS (VmHWM, read
from /proc while the job runs); the single-process run of the same config beside them. On a
machine with fewer cores than ranks these rows show correctness and memory, not speed-up; the
speed-up to expect on N machines is given from the measured compute per client, the server's
aggregation per update and the bytes of a model. Writes scale.json, scale.md and scale.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from speed import load_users, method_engine, samples_ms  # noqa: E402

from fedml_perfedavg.models import create_model  # noqa: E402

GRID = [(50, 10), (50, 50), (1000, 10), (1000, 100), (1000, 1000), (10000, 10), (10000, 100), (10000, 1000)]
MPI_WORKERS = (1, 2, 4)
MPI_CLIENTS = 100
MPI_USERS = 100
HF_YAML = REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf.yaml"
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))


def hf_engine(users: int, clients: int):
    """(engine, algorithm, users' data, data source): the batched engine on Per-FedAvg HF with the
    paper's MLP, a driver that samples with the algorithm and records nothing."""
    user_data, source = load_users(users, "cpu")
    engine, algorithm = method_engine("hf", user_data, clients=clients, n=users)
    return engine, algorithm, user_data, source


def measure_batched(users: int, clients: int, rounds: int) -> dict:
    """One (users, clients) cell in this process: train ms/round after a warm-up round."""
    engine, algorithm, user_data, source = hf_engine(users, clients)
    counter = iter(range(10**6))
    samples = samples_ms(lambda: engine.train_round(next(counter)), rounds, warmup=1)
    updates = engine.train_clients(0, algorithm.sample_clients(0), engine.state)
    aggregate_ms = statistics.median(samples_ms(lambda: algorithm.aggregate(0, updates, engine.state), 3, 1))
    return {
        "users": users,
        "clients": clients,
        "train_ms": statistics.median(samples),
        "train_ms_min": min(samples),
        "train_ms_max": max(samples),
        "aggregate_ms": aggregate_ms,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "data": source,
    }


def isolated(users: int, clients: int, rounds: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(users), str(clients), "--rounds", str(rounds)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _descendants(pid: int) -> list:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stream:
                parent = int(stream.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            children.append(int(entry))
    return children + [d for c in children for d in _descendants(c)]


def _peak_rss(pid: int) -> "tuple[str, float] | None":
    """(command line, VmHWM in MB) of a process running the plugin, or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            command = stream.read().replace(b"\0", b" ").decode()
        if "fedml_perfedavg" not in command:
            return None
        with open(f"/proc/{pid}/status") as stream:
            for line in stream:
                if line.startswith("VmHWM:"):
                    return command, int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure_cli(workers: int, rounds: int) -> dict:
    """The plugin's command line at MPI_CLIENTS clients per round of MPI_USERS users (the paper's
    MNIST split with a=98, so that it has images enough): under ``mpirun -n workers+1``, or one
    process on the batched engine for ``workers`` 0."""
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    with tempfile.TemporaryDirectory() as tmp:
        sets = {
            "backend": "MPI" if workers else "sp",
            "client_num_per_round": MPI_CLIENTS,
            "client_num_in_total": MPI_USERS,
            "images_per_class": 98,
            "comm_round": rounds,
            "frequency_of_the_test": rounds,
            "data_cache_dir": MNIST_ROOT,
            "show_progress": False,
            "checkpoint_every": 0,
        }
        command = [
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "--cf",
            str(HF_YAML),
            "--run-dir",
            f"{tmp}/run",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        ]
        if workers:
            command = [mpirun, "-n", str(workers + 1)] + command
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "HOME": tmp},
        )
        peaks: dict = {}
        done = threading.Event()

        def watch():
            while not done.is_set():
                for pid in _descendants(process.pid) + ([process.pid] if peaks_of_self else []):
                    seen = _peak_rss(pid)
                    if seen is not None:
                        peaks[pid] = max(peaks.get(pid, 0.0), seen[1])
                time.sleep(0.2)

        peaks_of_self = not workers  # one process: the run is the process itself
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        output, _ = process.communicate(timeout=1800)
        done.set()
        watcher.join()
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])} failed:\n{output[-3000:]}")
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
    ranks = sorted(peaks.values(), reverse=True)
    return {
        "workers": workers,
        "ranks": workers + 1 if workers else 1,
        "clients": MPI_CLIENTS,
        "rounds": rounds,
        "train_ms": 1000 * summary["history"][-1]["train_seconds"] / rounds,
        "peak_mb_per_rank": ranks,
        "peak_mb_max": max(ranks) if ranks else None,
        "status": summary["status"],
    }


def model_bytes() -> int:
    model = create_model("mlp", (1, 28, 28), 10)
    return sum(p.numel() * p.element_size() for p in model.state_dict().values())


def expected_speedup(per_client_ms: float, aggregate_ms_per_update: float, clients: int, nbytes: int) -> list:
    """A model, not a measurement: T(N) = compute per client x ceil(clients / N) (workers in
    parallel) + the server's aggregation of every update + the round's bytes over the server's
    link (the model to N workers, a model per client back)."""
    rows = []
    base = None
    for gbit in (1.0, 10.0):
        for n in (1, 2, 4, 8, 16, 32):
            compute = per_client_ms * -(-clients // n)
            transfer = (n + clients) * nbytes * 8 / (gbit * 1e9) * 1000
            total = compute + aggregate_ms_per_update * clients + transfer
            if n == 1:
                base = total
            rows.append(
                {
                    "machines": n,
                    "link_gbit_s": gbit,
                    "compute_ms": compute,
                    "transfer_ms": transfer,
                    "round_ms": total,
                    "speedup": base / total,
                }
            )
    return rows


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Scale ({results['machine']})",
        "",
        f"Measured {results['date']} with `{results['command']}`; "
        f"data: {results['batched'][0]['data']}; Per-FedAvg HF, tau=10, batches 40, MLP 784-80-60-10; median of "
        f"{results['rounds']} rounds after a warm-up round, each cell in a fresh process.",
        "",
        "## Batched engine (one process)",
        "",
        "| users n | clients/round | train ms/round (min-max) | ms per client | server aggregate ms | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["batched"]:
        lines.append(
            f"| {r['users']} | {r['clients']} | {r['train_ms']:.0f} ({r['train_ms_min']:.0f}-"
            f"{r['train_ms_max']:.0f}) | {r['train_ms'] / r['clients']:.2f} | {r['aggregate_ms']:.1f} | "
            f"{r['peak_mb']:.0f} |"
        )
    lines += [
        "",
        f"## MPI, {MPI_CLIENTS} clients per round of {MPI_USERS} users (the plugin's command line)",
        "",
        f"On this machine ({os.cpu_count()} cores) the ranks share the cores: these rows show that the "
        "shares train correctly and what each rank holds, not a speed-up.",
        "",
        "| worker ranks | ranks | train ms/round | peak RSS per rank, MB (largest first) |",
        "| --- | --- | --- | --- |",
    ]
    for r in results["mpi"]:
        lines.append(
            f"| {r['workers'] or '0 (one process, batched engine)'} | {r['ranks']} | {r['train_ms']:.0f} | "
            f"{', '.join(f'{m:.0f}' for m in r['peak_mb_per_rank'])} |"
        )
    lines += [
        "",
        "## Speed-up to expect on N machines (a model, not a measurement)",
        "",
        f"From the measured compute per client ({results['per_client_ms']:.2f} ms, the 1,000-user, 100-client "
        f"row), the server's aggregation per update ({results['aggregate_ms_per_update']:.3f} ms) and a model "
        f"of {results['model_bytes'] / 1024:.0f} KiB (the server sends it to each machine and receives one per "
        f"client): T(N) = compute x ceil({MPI_CLIENTS} / N) + aggregation + transfer over the server's link.",
        "",
        "| machines N | link Gbit/s | compute ms | transfer ms | round ms | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["expected"]:
        lines.append(
            f"| {r['machines']} | {r['link_gbit_s']:.0f} | {r['compute_ms']:.0f} | {r['transfer_ms']:.0f} | "
            f"{r['round_ms']:.0f} | {r['speedup']:.1f}x |"
        )
    (out / "scale.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for users in sorted({r["users"] for r in results["batched"]}):
        rows = [r for r in results["batched"] if r["users"] == users]
        left.loglog([r["clients"] for r in rows], [r["train_ms"] for r in rows], "o-", label=f"n={users}")
        right.semilogx([r["clients"] for r in rows], [r["peak_mb"] for r in rows], "o-", label=f"n={users}")
    left.set(xlabel="clients per round", ylabel="train ms/round", title="batched engine")
    right.set(xlabel="clients per round", ylabel="peak RSS (MB)", title="batched engine, one process")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--one", nargs=2, type=int, metavar=("USERS", "CLIENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(measure_batched(args.one[0], args.one[1], args.rounds)))
        return
    batched = []
    for users, clients in GRID:
        batched.append(isolated(users, clients, args.rounds))
        print(json.dumps(batched[-1]), flush=True)
    mpi = []
    for workers in (0,) + MPI_WORKERS:
        mpi.append(measure_cli(workers, args.rounds))
        print(json.dumps(mpi[-1]), flush=True)
    single = next(r for r in batched if (r["users"], r["clients"]) == (1000, 100))
    per_client = single["train_ms"] / single["clients"]
    per_update = single["aggregate_ms"] / single["clients"]
    results = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "rounds": args.rounds,
        "batched": batched,
        "mpi": mpi,
        "per_client_ms": per_client,
        "aggregate_ms_per_update": per_update,
        "model_bytes": model_bytes(),
        "expected": expected_speedup(per_client, per_update, MPI_CLIENTS, model_bytes()),
    }
    write_report(results, Path(args.out))
    print((Path(args.out) / "scale.md").read_text())


if __name__ == "__main__":
    main()
