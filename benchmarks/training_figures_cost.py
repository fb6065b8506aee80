"""What recording the rounds' training figures costs: the batched engine's round with and without
them, alternating, on the paper's MNIST config (issue 58: the figures come from the forward pass the
gradient needs anyway; this measures the few batched kernels and the one read a round that remain).

    python benchmarks/training_figures_cost.py [--threads 2] [--repeats 6] [--out benchmarks/results]

Writes ``training_figures_cost.json`` under --out: per method, the median and minimum over the
repeats of each arm's median ms per round (15 rounds each, after 3 warm-up rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_check  # noqa: E402  (its config, engine and timer: the same measurement on the CPU)

from fedml_perfedavg.models import create_model  # noqa: E402


def measure(users, device: torch.device, method: str, repeats: int) -> dict:
    engines = {}
    for records in (True, False):
        config = cuda_check.config_for(method)
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60])
        _, engine = cuda_check.engine_for(config, users, model, device, record_training=records)
        engines[records] = (engine, iter(range(10**6)))
    samples = {True: [], False: []}
    for repeat in range(repeats):
        for records in (True, False) if repeat % 2 == 0 else (False, True):
            engine, counter = engines[records]
            samples[records].append(cuda_check.timed_ms(lambda: engine.train_round(next(counter)), device, 15, 3))
    arms = {"with_figures": samples[True], "without_figures": samples[False]}
    return {
        f"{arm}_ms_{stat}": fn(values)
        for arm, values in arms.items()
        for stat, fn in (("median", statistics.median), ("min", min))
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(cuda_check.REPO.parent / "shared" / "datasets"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default=str(cuda_check.REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    users = cuda_check.mnist_users(args.data_root, device)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "threads": args.threads,
        "command": " ".join(["python", "benchmarks/training_figures_cost.py", *(argv or sys.argv[1:])]),
    }
    for method in ("hf", "fo", "fedavg"):
        results[method] = measure(users, device, method, args.repeats)
        print(method, json.dumps(results[method]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "training_figures_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
