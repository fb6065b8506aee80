"""Fingerprints of what a seed produces, to show that a speed change changed no bit.

    python benchmarks/bit_identity.py --record benchmarks/results/bit_identity.json   # before
    python benchmarks/bit_identity.py --check benchmarks/results/bit_identity.json    # after

For FedAvg and Per-FedAvg FO, HF and exact on the paper's MNIST config, each engine path (the
hand-batched default, torch.func's vmap, and the per-client path), the SHA-256 of the global
model's bytes after ``--rounds`` rounds, of the personalized evaluation's per-user numbers, and of
a 50-clients-per-round round (two computations). ``--check`` exits with 1 naming every
fingerprint that moved. Floating-point results depend on the CPU's kernels and, through MKL's
matrix products, on the number of torch threads: the record names the CPU and the thread count,
and ``--check`` runs with the recorded count (and says so when the CPU is another).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import struct
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from speed import METHODS, bare_engine, config_for, load_users  # noqa: E402

from fedml_perfedavg.algorithms.registry import create_algorithm  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402


def digest_state(state) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def digest_numbers(values) -> str:
    return hashlib.sha256(b"".join(struct.pack("<d", float(v)) for v in values)).hexdigest()[:16]


def fingerprint(method: str, path: str, rounds: int, clients: int) -> dict:
    config = config_for(method, clients)
    users, _ = load_users(50, "cpu")
    torch.manual_seed(0)
    model = create_model("mlp", (1, 28, 28), 10)
    optimizer, _ = METHODS[method]
    algorithm = create_algorithm(optimizer, model, config)
    engine = bare_engine(algorithm, users, model, try_hand_batched=path == "batched")
    if path == "per_client":
        engine.batched = False
    state = engine.run(0, rounds)
    result = algorithm.evaluate(rounds, state, users, batched=path != "per_client")
    return {
        "model": digest_state(state),
        "evaluation": digest_numbers(result.per_user_accuracy + result.per_user_accuracy_before + result.per_user_loss),
        "personalized_accuracy": result.personalized_accuracy,
    }


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def all_fingerprints(rounds: int) -> dict:
    out = {}
    for method in METHODS:
        for path in ("batched", "vmap", "per_client"):
            out[f"{method}/{path}/10 clients"] = fingerprint(method, path, rounds, 10)
        out[f"{method}/batched/50 clients"] = fingerprint(method, "batched", 2, 50)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if args.record:
        import subprocess

        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        record = {
            "commit": commit,
            "machine": f"{platform.machine()}, torch {torch.__version__}",
            "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "rounds": args.rounds,
            "fingerprints": all_fingerprints(args.rounds),
        }
        Path(args.record).write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record, indent=2))
        return
    record = json.loads(Path(args.check).read_text())
    if "threads" in record:
        torch.set_num_threads(record["threads"])
    if record.get("cpu", cpu_name()) != cpu_name():
        print(f"recorded on {record['cpu']}, checked on {cpu_name()}: the kernels may differ, and so the bits")
    now = all_fingerprints(record["rounds"])
    moved = [name for name, value in record["fingerprints"].items() if now.get(name) != value]
    for name in record["fingerprints"]:
        print(f"{'MOVED' if name in moved else 'same '}  {name}  {now[name]}")
    if moved:
        sys.exit(1)
    print(f"all {len(now)} fingerprints equal those of commit {record['commit']}")


if __name__ == "__main__":
    main()
