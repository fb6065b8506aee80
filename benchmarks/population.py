"""How many users one machine holds: distinct users of the paper's size, a round's cost per sampled
client, an evaluation of every user, and the process's peak memory against the users' data.

    python benchmarks/population.py [--rounds 3] [--points 50:10:196,5000:1000:196,...] [--out benchmarks/results]

Each point (users n, clients per round, the paper's a) runs in a fresh process: the MNIST split
``partition_method: paper_resampled`` (the paper's class counts per user, each user's images drawn
on its own, so n may outgrow MNIST; images stored as uint8), Per-FedAvg HF on the batched engine
(the paper's MLP, tau 10, batches of 40, 2 threads), one warm-up round then ``--rounds`` timed
rounds, then one personalized evaluation of all n users (timed; after an evaluation of 64 users,
which does what a run's first evaluation does once: its probes of the matrix kernels). Peak RSS is the process's
VmHWM; the users' data bytes are their tensors' (inputs and labels, train and test). Writes
population.json and population.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# (users, clients per round, a): the paper's 50 users; 5,000 and 20,000 of the paper's size
# (a=196: 980 or 490 training images each); 50,000 small users (a=54: 270 or 135, about 200 on average).
POINTS = [(50, 10, 196), (5000, 1000, 196), (20000, 1000, 196), (50000, 1000, 54)]
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))


def _vm_hwm_mb() -> float:
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _data_bytes(users) -> int:
    """The bytes of the users' tensors, each storage counted once."""
    seen, total = set(), 0
    for user in users:
        for t in user:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def measure(users: int, clients: int, a: int, rounds: int) -> dict:
    """One point in this process."""
    from fedml_perfedavg.data.loading import load_federated
    from speed import method_engine, samples_ms

    torch.set_num_threads(2)
    baseline_mb = _vm_hwm_mb()
    start = time.perf_counter()
    data = load_federated("mnist", MNIST_ROOT, users, "paper_resampled", 0, images_per_class=a)
    load_s = time.perf_counter() - start
    # the benchmarks' HF engine (speed.method_engine: seed 0, the paper's MLP, tau 10, batches of 40)
    engine, algorithm = method_engine("hf", data.users, clients=clients, n=users)
    counter = iter(range(10**6))
    samples = samples_ms(lambda: engine.train_round(next(counter)), rounds, warmup=1)
    start = time.perf_counter()
    algorithm.evaluate(0, engine.state, data.users[:64])  # a run's first evaluation probes the kernels once
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    result = algorithm.evaluate(0, engine.state, data.users)
    evaluation_s = time.perf_counter() - start
    data_bytes = _data_bytes(data.users)
    return {
        "users": users,
        "clients": clients,
        "a": a,
        "train_images": sum(len(u.train_y) for u in data.users),
        "data_mb": data_bytes / 2**20,
        "load_s": load_s,
        "round_ms": statistics.median(samples),
        "round_ms_min": min(samples),
        "round_ms_max": max(samples),
        "ms_per_client": statistics.median(samples) / clients,
        "first_evaluation_of_64_s": first_s,
        "evaluation_s": evaluation_s,
        "evaluation_ms_per_user": evaluation_s * 1000 / users,
        "personalized_accuracy": result.personalized_accuracy,
        "start_mb": baseline_mb,
        "peak_mb": _vm_hwm_mb(),
    }


def isolated(users: int, clients: int, a: int, rounds: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", str(users), str(clients), str(a), "--rounds", str(rounds)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return {"users": users, "clients": clients, "a": a, "error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "population.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Population ({results['machine']})",
        "",
        f"Measured {results['date']} at {results['commit']} with `{results['command']}`: MNIST "
        "`partition_method: paper_resampled` (images stored as uint8), Per-FedAvg HF on the batched engine, "
        f"2 threads; median of {results['rounds']} rounds after a warm-up round, then one evaluation of "
        "every user (after one of 64 users: a run's first evaluation probes the kernels once); each point "
        "in a fresh process. Peak RSS over data: the process's VmHWM against its "
        "users' tensors (the constant is the interpreter, torch and MNIST itself).",
        "",
        "| users n | a | clients/round | data MiB | peak RSS MiB | peak - data MiB | round ms (min-max) | "
        "ms per client | evaluation s | ms per user evaluated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["points"]:
        if "error" in r:
            lines.append(f"| {r['users']} | {r['a']} | {r['clients']} | failed: {r['error'].splitlines()[-1]} |")
            continue
        lines.append(
            f"| {r['users']:,} | {r['a']} | {r['clients']:,} | {r['data_mb']:,.0f} | {r['peak_mb']:,.0f} | "
            f"{r['peak_mb'] - r['data_mb']:,.0f} | {r['round_ms']:,.0f} ({r['round_ms_min']:,.0f}-"
            f"{r['round_ms_max']:,.0f}) | {r['ms_per_client']:.2f} | {r['evaluation_s']:.1f} | "
            f"{r['evaluation_ms_per_user']:.2f} |"
        )
    (out / "population.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--points", default=",".join(f"{n}:{k}:{a}" for n, k, a in POINTS))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--one", nargs=3, type=int, metavar=("USERS", "CLIENTS", "A"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.rounds)))
        return
    points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
    results = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/population.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "points": [],
    }
    for users, clients, a in points:
        row = isolated(users, clients, a, args.rounds)
        print(json.dumps(row), flush=True)
        results["points"].append(row)
    write_report(results, Path(args.out))
    print((Path(args.out) / "population.md").read_text())


if __name__ == "__main__":
    main()
