"""The compiled local update (``device_args.compile_local_update``) against the eager path.

    python benchmarks/compiled_update.py [--methods hf fo exact fedavg] [--blocks 6] [--full-run]

The paper's MNIST config (10 of 50 users a round, tau 10, batches of 40, the MLP), on the
batched engine, whose Linear chain compiles its own step (core/compiled_update.py):

1. Round time: an eager engine and a compiled one in one process, their rounds alternated in
   ``--blocks`` blocks of ``--rounds`` rounds; the median of the blocks' ratios (this machine's
   pace moves by a third within minutes), and the compile time (the first round's).
2. How far the results move: both engines from the same start, the largest difference of the
   global models after 1 and after 10 rounds (the fused kernels sum in other orders).
3. ``--full-run``: a 1000-round HF run (evaluated every 10) through the runner, eager and
   compiled: wall time and the final personalized accuracy of each.

Writes compiled_update.json and .md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import speed  # noqa: E402
from fedml_perfedavg.engine.batched import BatchedSimulation  # noqa: E402


def engine_for(method: str, users, compiled: bool) -> BatchedSimulation:
    return speed.method_engine(method, users, compile_local_update=compiled)[0]


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(method: str, users, blocks: int, rounds: int) -> dict:
    """Part 1 and 2 for ``method``."""
    eager, compiled = engine_for(method, users, False), engine_for(method, users, True)
    start = time.perf_counter()
    compiled.train_round(0)
    compile_seconds = time.perf_counter() - start
    eager.train_round(0)
    after_one = largest_difference(eager.state, compiled.state)
    for round_idx in range(1, 10):
        eager.train_round(round_idx)
        compiled.train_round(round_idx)
    after_ten = largest_difference(eager.state, compiled.state)
    counter = iter(range(10, 10**6))
    eager_ms, compiled_ms = [], []
    for _ in range(blocks):
        for engine, samples in ((eager, eager_ms), (compiled, compiled_ms)):
            samples.append(speed.median_ms(lambda: engine.train_round(next(counter)), rounds, warmup=0))
    return {
        "method": method,
        "compile_seconds": compile_seconds,
        "eager_ms": statistics.median(eager_ms),
        "compiled_ms": statistics.median(compiled_ms),
        "ratio": statistics.median(c / e for c, e in zip(compiled_ms, eager_ms)),
        "ratio_min": min(c / e for c, e in zip(compiled_ms, eager_ms)),
        "ratio_max": max(c / e for c, e in zip(compiled_ms, eager_ms)),
        "largest_difference_after_1_round": after_one,
        "largest_difference_after_10_rounds": after_ten,
    }


def full_run(compiled: bool) -> dict:
    from fedml_perfedavg.run.runner import run

    config = speed.resolve(
        {},
        dict(
            comm_round=1000,
            frequency_of_the_test=10,
            data_cache_dir=speed.MNIST_ROOT,
            show_progress=False,
            compile_local_update=compiled,
        ),
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(config, tmp)
    return {
        "compiled": compiled,
        "wall_seconds": time.perf_counter() - start,
        "personalized_accuracy": result.summary["personalized_accuracy"],
    }


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled_update.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# The compiled local update against the eager path",
        "",
        f"Measured {results['date']} with `{results['command']}`; data: {results['data']}; "
        f"{results['threads']} threads. Rounds alternated in {results['blocks']} blocks of {results['rounds']}.",
        "",
        "| method | eager ms/round | compiled ms/round | compiled / eager (min-max) | compile s | "
        "largest difference after 1 round | after 10 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["methods"]:
        lines.append(
            f"| {r['method']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['ratio']:.2f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | {r['compile_seconds']:.1f} | "
            f"{r['largest_difference_after_1_round']:.1e} | {r['largest_difference_after_10_rounds']:.1e} |"
        )
    if results.get("full_runs"):
        lines += ["", "| 1000 HF rounds | wall s | personalized accuracy |", "| --- | --- | --- |"]
        for r in results["full_runs"]:
            name = "compiled" if r["compiled"] else "eager"
            lines.append(f"| {name} | {r['wall_seconds']:.1f} | {r['personalized_accuracy']:.4f} |")
    (out / "compiled_update.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["hf", "fo", "exact", "fedavg"], choices=sorted(speed.METHODS))
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5, help="rounds a block")
    parser.add_argument("--full-run", action="store_true", help="also a 1000-round HF run, eager and compiled")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    users, source = speed.load_users(50, "cpu")
    results = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/compiled_update.py " + " ".join(sys.argv[1:]),
        "data": source,
        "threads": torch.get_num_threads(),
        "blocks": args.blocks,
        "rounds": args.rounds,
        "methods": [],
    }
    for method in args.methods:
        results["methods"].append(compare(method, users, args.blocks, args.rounds))
        print(json.dumps(results["methods"][-1]), flush=True)
    if args.full_run:
        results["full_runs"] = [full_run(False), full_run(True)]
        print(json.dumps(results["full_runs"]), flush=True)
    write_report(results, Path(args.out))
    print((Path(args.out) / "compiled_update.md").read_text())


if __name__ == "__main__":
    main()
