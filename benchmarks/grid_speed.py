"""Grid mode against separate runs, per round: the 5 seeds of a Table 1 cell trained as one
computation (``fedml_perfedavg.engine.grid``) or one engine after the other, in one process.

    python benchmarks/grid_speed.py [--threads 1] [--rounds 20]

Training only (no evaluation), paper MNIST split, tau=10 cell, FedAvg + update and Per-FedAvg (HF).
Writes ``benchmarks/results/grid_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedml_perfedavg.algorithms.registry import create_algorithm  # noqa: E402
from fedml_perfedavg.engine.batched import BatchedSimulation  # noqa: E402
from fedml_perfedavg.engine.grid import GridSimulation  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402
from fedml_perfedavg.run.config import load  # noqa: E402
from fedml_perfedavg.run.runner import load_split  # noqa: E402


class Driver:
    def __init__(self, algorithm) -> None:
        self.algorithm = algorithm

    def sample_clients(self, round_idx):
        return self.algorithm.sample_clients(round_idx)

    def round_finished(self, round_idx, state) -> None:
        pass


def engines(method: str, seeds: int, data_root: str):
    out = []
    for seed in range(seeds):
        config = load(
            str(REPO / "yaml_configs" / f"mnist_tau10_alpha0.01_{method}.yaml"),
            [f"random_seed={seed}", f"data_cache_dir={data_root}"],
        )
        torch.manual_seed(seed)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60])
        algorithm = create_algorithm(config.train.federated_optimizer, model, config)
        out.append(BatchedSimulation(algorithm, load_split(config).users, model.state_dict(), Driver(algorithm)))
    return out


def ms_per_round(step, rounds: int, repeats: int) -> list:
    step(0)  # warm-up
    samples, counter = [], iter(range(1, 10**6))
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            step(next(counter))
        samples.append((time.perf_counter() - start) / rounds * 1000)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-root", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for method in ("fedavg", "hf"):
        separate = engines(method, args.seeds, args.data_root)
        one_by_one = ms_per_round(lambda r: [e.train_round(r) for e in separate], args.rounds, args.repeats)
        grid = GridSimulation(engines(method, args.seeds, args.data_root))
        together = ms_per_round(grid.train_round, args.rounds, args.repeats)
        rows.append(
            {
                "method": method,
                "separate_ms": statistics.median(one_by_one),
                "grid_ms": statistics.median(together),
                "separate_spread": [min(one_by_one), max(one_by_one)],
                "grid_spread": [min(together), max(together)],
            }
        )
    command = "python benchmarks/grid_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "threads": args.threads,
        "seeds": args.seeds,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid_speed.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Grid mode vs separate runs ({result['date']})",
        "",
        f"Command: `{result['command']}`; "
        f"{args.seeds} seeds of the MNIST tau=10 cell, {args.threads} torch thread(s), training only, "
        f"ms per round of all {args.seeds} runs (median of {args.repeats} x {args.rounds} rounds, min-max).",
        "",
        "| method | one engine after the other | grid mode (one computation) | grid / separate |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['separate_ms']:.1f} ({r['separate_spread'][0]:.1f}-{r['separate_spread'][1]:.1f}) "
            f"| {r['grid_ms']:.1f} ({r['grid_spread'][0]:.1f}-{r['grid_spread'][1]:.1f}) | "
            f"{r['grid_ms'] / r['separate_ms']:.2f} |"
        )
    (out / "grid_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
