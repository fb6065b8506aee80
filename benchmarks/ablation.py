"""Ablation of protocol details the paper leaves open, for the MNIST tau=10 cell.

    python benchmarks/ablation.py [--mnist-root DIR] [--seeds 2] [--device cuda] [--jobs 12] [--out DIR]

Each variant changes one detail of this plugin's protocol and reruns FedAvg + update and
Per-FedAvg (HF) for K=1000 rounds through the batched engine (the runner's sp engine, with a
plain uniform average in place of the FedML aggregator object; no FedML needed):
- ``ours``: inputs in [0, 1], PyTorch's default initialisation (the Table 1 runs);
- ``normalized_inputs``: inputs standardised with MNIST's mean and std (0.1307, 0.3081);
- ``xavier_init``: Xavier-uniform weights, zero biases.
Reports the personalized accuracy at rounds K/4, K/2, 3K/4 and K-1 per run, and writes
ablation.md / ablation.json under --out. An explanation aid, not a Table 1 row: nothing here
is tuned, and the protocol of the benchmark is unchanged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_check import REPO, config_for, engine_for  # noqa: E402

from fedml_perfedavg.core.types import UserSplit, model_inputs  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402

VARIANTS = ("ours", "normalized_inputs", "xavier_init")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def checkpoints(rounds: int) -> List[int]:
    return [rounds // 4, rounds // 2, 3 * rounds // 4, rounds - 1]


def one_run(job) -> Dict:
    variant, method, seed, mnist_root, device_name, rounds = job
    from fedml_perfedavg.data.loading import load_federated

    torch.set_num_threads(1)
    device = torch.device(device_name)
    config = config_for(method, random_seed=seed, comm_round=rounds)
    users = load_federated("mnist", mnist_root, 50, "paper", seed).to(device).users
    if variant == "normalized_inputs":
        users = [
            UserSplit(
                (model_inputs(u.train_x) - MNIST_MEAN) / MNIST_STD,
                u.train_y,
                (model_inputs(u.test_x) - MNIST_MEAN) / MNIST_STD,
                u.test_y,
            )
            for u in users
        ]
    torch.manual_seed(seed)
    model = create_model("mlp", (1, 28, 28), 10, [80, 60]).to(device)
    if variant == "xavier_init":
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                torch.nn.init.zeros_(module.bias)
    engine = engine_for(config, method, users, model)
    accuracy = {}
    start = time.perf_counter()
    for round_idx in range(config.train.comm_round):
        engine.train_round(round_idx)
        if round_idx in checkpoints(rounds):
            result = engine.evaluate(round_idx)
            accuracy[round_idx] = (result.personalized_accuracy, result.accuracy_before_adaptation)
    return {
        "variant": variant,
        "method": method,
        "seed": seed,
        "seconds": time.perf_counter() - start,
        "personalized_accuracy": {str(r): a for r, (a, _) in accuracy.items()},
        "accuracy_before_adaptation": {str(r): b for r, (_, b) in accuracy.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    jobs = [
        (v, m, s, args.mnist_root, args.device, args.rounds)
        for v in VARIANTS
        for m in ("fedavg", "hf")
        for s in range(args.seeds)
    ]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        runs: List[Dict] = []
        for run in pool.imap_unordered(one_run, jobs):  # printed as they end, so a cut-off run keeps them
            print(json.dumps(run), flush=True)
            runs.append(run)
    runs.sort(key=lambda r: (VARIANTS.index(r["variant"]), r["method"], r["seed"]))
    marks = checkpoints(args.rounds)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    command = " ".join(["python", "benchmarks/ablation.py", *sys.argv[1:]])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "ablation.json").write_text(
        json.dumps({"command": command, "device": device, "date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1)
    )
    lines = [
        f"# Ablation, MNIST tau=10 alpha=0.01 ({time.strftime('%Y-%m-%d')}, {device})",
        "",
        f"Command: `{command}`",
        "",
        "Personalized accuracy (%) at rounds "
        + ", ".join(map(str, marks))
        + f"; mean over seeds (each seed's value in brackets at round {marks[-1]}).",
        "",
        "| variant | method | " + " | ".join(f"round {r}" for r in marks) + f" | seeds at {marks[-1]} |",
        "| --- | --- | " + " | ".join("---" for _ in marks) + " | --- |",
    ]
    for variant in VARIANTS:
        for method in ("fedavg", "hf"):
            chosen = [r for r in runs if r["variant"] == variant and r["method"] == method]
            means = [100 * sum(r["personalized_accuracy"][str(c)] for r in chosen) / len(chosen) for c in marks]
            last = ", ".join(f"{100 * r['personalized_accuracy'][str(marks[-1])]:.2f}" for r in chosen)
            lines.append(f"| {variant} | {method} | " + " | ".join(f"{m:.2f}" for m in means) + f" | [{last}] |")
    Path(args.out, "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
