"""Per-FedAvg (HF) against FedAvg + update at equal training time (the paper's appendix claim).

    python benchmarks/equal_time.py --jobs 2 --set data_cache_dir=../shared/datasets

Table 1 fixes K: FedAvg's rounds are cheaper, so it stops long before HF has used its time. Here
Per-FedAvg (HF) runs its K=1000 rounds and FedAvg + update runs ``--fedavg-rounds`` (default 3000,
more than HF's training time on this engine), so FedAvg's curve covers the whole of HF's time.
Both run in one invocation from the Table 1 YAMLs through the plugin's runner (same seeds, engine,
machine and job layout). Each seed's pair is compared at budgets of 25/50/75/100% of that seed's HF
training time: each method's personalized accuracy at its last evaluation within the budget.
Outputs in ``--out``: equal_time.md (mean and 95% interval over seeds, paired HF - FedAvg),
equal_time.csv (one row per seed and budget) and one plot per cell (accuracy against training time).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from table1 import CONFIG_DIR, METHOD_NAMES, _band, _fmt, finished, mean_ci95, run_one  # noqa: E402

CELLS = ("mnist_tau10_alpha0.01", "mnist_tau4_alpha0.01")
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
CSV_COLUMNS = [
    "cell",
    "seed",
    "fraction",
    "budget_seconds",
    "hf_accuracy",
    "hf_round",
    "fedavg_accuracy",
    "fedavg_round",
    "hf_minus_fedavg",
]


def at_budget(history: List[Dict], seconds: float) -> Optional[Dict]:
    """The last evaluation whose training time is within ``seconds`` (None if none is)."""
    within = [e for e in history if e["train_seconds"] <= seconds]
    return within[-1] if within else None


def compare(hf: Dict, fedavg: Dict) -> List[Dict]:
    """Rows for one seed: both methods at fractions of the HF run's training time."""
    total = hf["history"][-1]["train_seconds"]
    rows = []
    for fraction in FRACTIONS:
        budget = fraction * total
        a, b = at_budget(hf["history"], budget), at_budget(fedavg["history"], budget)
        if a is None or b is None:
            continue
        rows.append(
            {
                "fraction": fraction,
                "budget_seconds": round(budget, 2),
                "hf_accuracy": a["personalized_accuracy"],
                "hf_round": a["round"],
                "fedavg_accuracy": b["personalized_accuracy"],
                "fedavg_round": b["round"],
                "hf_minus_fedavg": a["personalized_accuracy"] - b["personalized_accuracy"],
            }
        )
    return rows


def report(out: Path, command: str, seeds: int, hf_rounds: int, fedavg_rounds: int) -> str:
    """Write equal_time.csv, equal_time.md and the plots from the finished runs under ``out``."""
    rows, summaries = [], {}
    for cell in CELLS:
        for seed in range(seeds):
            pair = {m: out / "runs" / cell / m / f"seed{seed}" / "summary.json" for m in ("hf", "fedavg")}
            if not all(p.exists() for p in pair.values()):
                continue
            hf, fedavg = (json.loads(pair[m].read_text()) for m in ("hf", "fedavg"))
            if hf.get("status") != "finished" or fedavg.get("status") != "finished":
                continue
            summaries.setdefault(cell, []).append((hf, fedavg))
            rows += [{"cell": cell, "seed": seed, **r} for r in compare(hf, fedavg)]
    with open(out / "equal_time.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    lines = [
        "# Per-FedAvg (HF) against FedAvg + update at equal training time",
        "",
        f"Command: `{command}`; written {time.strftime('%Y-%m-%d')}.",
        "",
        f"HF runs K={hf_rounds} rounds, FedAvg + update {fedavg_rounds}; both evaluate every 10 rounds. Budget: a "
        "fraction of each seed's HF training time (evaluation excluded); each method's personalized accuracy "
        "(%) at its last evaluation within the budget, mean ± 95% interval over seeds; the difference is "
        "paired by seed.",
        "",
        "| cell | budget (share of HF's time) | mean budget (s) | Per-FedAvg (HF) | FedAvg + update | FedAvg's "
        "rounds by then | HF - FedAvg |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell in CELLS:
        for fraction in FRACTIONS:
            sel = [r for r in rows if r["cell"] == cell and r["fraction"] == fraction]
            if not sel:
                continue
            budget = sum(r["budget_seconds"] for r in sel) / len(sel)
            cols = [_fmt(*mean_ci95([100 * r[k] for r in sel])) for k in ("hf_accuracy", "fedavg_accuracy")]
            fedavg_rounds_by = sum(r["fedavg_round"] + 1 for r in sel) / len(sel)
            lines.append(
                f"| {cell} | {fraction:.0%} | {budget:.1f} | {cols[0]} | {cols[1]} | "
                f"{fedavg_rounds_by:.0f} | {_fmt(*mean_ci95([100 * r['hf_minus_fedavg'] for r in sel]))} |"
            )
    lines += [
        "",
        "At the end of each run (K rounds):",
        "",
        f"| cell | seeds | Per-FedAvg (HF), K={hf_rounds} | "
        f"FedAvg + update, K={fedavg_rounds} | HF training time (s) | FedAvg training time (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cell, pairs in summaries.items():
        acc = [_fmt(*mean_ci95([100 * s["personalized_accuracy"] for s in side])) for side in zip(*pairs)]
        secs = [sum(s["history"][-1]["train_seconds"] for s in side) / len(side) for side in zip(*pairs)]
        lines.append(f"| {cell} | {len(pairs)} | {acc[0]} | {acc[1]} | {secs[0]:.1f} | {secs[1]:.1f} |")
    markdown = "\n".join(lines) + "\n"
    (out / "equal_time.md").write_text(markdown)
    plot(summaries, out)
    return markdown


def plot(summaries: Dict[str, List], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for cell, pairs in summaries.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for side, method in zip(zip(*pairs), ("hf", "fedavg")):
            histories = [s["history"] for s in side]
            _, means, halves = _band(histories, "personalized_accuracy")
            _, seconds, _ = _band(histories, "train_seconds")
            means, halves = [100 * m for m in means], [100 * h for h in halves]
            ax.plot(seconds, means, label=METHOD_NAMES[method])
            ax.fill_between(
                seconds, [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)], alpha=0.2
            )
        hf_time = sum(s["history"][-1]["train_seconds"] for s, _ in pairs) / len(pairs)
        ax.axvline(hf_time, color="grey", linestyle=":", label="HF's last round")
        ax.set(
            xlabel="training time (s, evaluation excluded; this engine and machine)",
            ylabel="personalized accuracy (%)",
            title=f"{cell}: equal training time, mean and 95% band",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{cell}.png", dpi=90)
        plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--fedavg-rounds", type=int, default=3000)
    parser.add_argument("--hf-rounds", type=int, default=1000)
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "equal_time"))
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (e.g. data_cache_dir=...)",
    )
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/equal_time.py " + " ".join(argv if argv is not None else sys.argv[1:])
    failures: List[str] = []
    if not args.report_only:
        rounds = {"hf": args.hf_rounds, "fedavg": args.fedavg_rounds}
        threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
        jobs = [
            (
                str(CONFIG_DIR / f"{cell}_{method}.yaml"),
                str(out / "runs" / cell / method / f"seed{seed}"),
                seed,
                rounds[method],
                list(args.overrides),
                threads,
            )
            for cell in args.cells
            for seed in range(args.seeds)
            for method in ("hf", "fedavg")
        ]
        jobs = [job for job in jobs if not finished(Path(job[1]))]
        print(f"{len(jobs)} runs to make", file=sys.stderr)
        started = time.time()
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_one, *job): job[1] for job in jobs}
            for future in as_completed(futures):
                try:
                    summary = future.result()
                    print(f"{futures[future]}: {100 * summary['personalized_accuracy']:.2f}%", file=sys.stderr)
                except Exception as err:  # keep the others going; report at the end
                    failures.append(f"{futures[future]}: {err}")
        for failure in failures:
            print("FAILED:", failure, file=sys.stderr)
        print(f"{len(jobs)} runs in {time.time() - started:.0f} s", file=sys.stderr)
    print(report(out, command.strip(), args.seeds, args.hf_rounds, args.fedavg_rounds))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
