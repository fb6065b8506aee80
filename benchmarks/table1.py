"""Reproduce Table 1 of Fallah et al. (2020) through the plugin's normal runner.

    python benchmarks/table1.py                       # MNIST cells, 4 methods, 5 seeds, K=1000
    python benchmarks/table1.py --datasets mnist cifar10 --seeds 3 --rounds 200 --jobs 2
    python benchmarks/table1.py --report-only         # rebuild CSV/MD/plots from finished runs

Each run is ``fedml_perfedavg.run.runner.run`` on a YAML of ``yaml_configs/`` (cell x method) with
the seed and rounds overridden; its directory is ``<out>/runs/<cell>/<method>/seed<k>``. Runs
whose summary.json says "finished" are skipped, so an interrupted grid resumes. Outputs in
``<out>``: table1.csv (one row per run), table1.md (mean and 95% interval per cell next to the
paper, paired gains over FedAvg), plots per cell (accuracy against rounds and against training
time, the stationarity measure where logged, per-user accuracy at the end) and wandb_report.md
(offline wandb runs and how to sync them, with --wandb).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG_DIR = REPO / "yaml_configs"
METHODS = ("fedavg", "fo", "hf", "exact", "aruba")
METHOD_NAMES = {
    "fedavg": "FedAvg + update",
    "fo": "Per-FedAvg (FO)",
    "hf": "Per-FedAvg (HF)",
    "exact": "Per-FedAvg (exact)",
    "aruba": "FedAvg + ARUBA",
}
# Table 1 of the paper: mean per-user accuracy (%) after one local step.
PAPER = {
    "mnist_tau10_alpha0.01": {"fedavg": 75.96, "fo": 78.00, "hf": 79.85},
    "mnist_tau4_alpha0.01": {"fedavg": 60.18, "fo": 64.55, "hf": 70.94},
    "cifar10_tau10_alpha0.001": {"fedavg": 40.49, "fo": 46.98, "hf": 50.44},
    "cifar10_tau4_alpha0.001": {"fedavg": 38.38, "fo": 34.04, "hf": 43.73, "aruba": 36.74},  # aruba: appendix
    "cifar10_tau4_alpha0.01": {"fedavg": 35.97, "fo": 25.32, "hf": 46.32},
    "cifar10_tau4_alpha0.01_diffhetero": {"fedavg": 58.59, "fo": 37.71, "hf": 71.25},
}
CSV_COLUMNS = [
    "cell",
    "dataset",
    "method",
    "seed",
    "rounds",
    "personalized_accuracy",
    "accuracy_before_adaptation",
    "personalized_accuracy_std",
    "new_user_personalized_accuracy",
    "stationarity",
    "train_seconds",
    "wall_seconds",
    "status",
    "run_dir",
]
# Beyond the paper: extra cells, each a paper cell's YAMLs with overrides.
EXTRAS = {
    "new_users": [(f"{cell}_newusers", cell, ["new_user_fraction=0.1"]) for cell in PAPER],
    "alpha_sweep": [(f"mnist_tau4_alpha{a}_sweep", "mnist_tau4_alpha0.01", [f"alpha={a}"]) for a in (0.001, 0.05)],
}


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% Student-t quantile."""
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def mean_ci95(values: Sequence[float]) -> Tuple[float, float]:
    """(mean, half-width of the 95% t interval); half-width is nan for fewer than 2 values."""
    values = list(values)
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def grid(
    datasets: Sequence[str], cells: Sequence[str], methods: Sequence[str], extras: Sequence[str] = ()
) -> List[Tuple[str, str, Path, List[str]]]:
    """(cell, method, yaml, overrides) for every existing config that matches."""
    chosen = [(cell, cell, []) for cell in PAPER] + [item for name in extras for item in EXTRAS[name]]
    out = []
    for cell, base, overrides in chosen:
        if base.split("_")[0] not in datasets or (cells and cell not in cells and base not in cells):
            continue
        for method in methods:
            path = CONFIG_DIR / f"{base}_{method}.yaml"
            if path.exists():
                out.append((cell, method, path, list(overrides)))
    return out


def cell_order(rows: List[Dict]) -> List[str]:
    """Paper cells first, then the extra cells, as far as they have rows."""
    present = {r["cell"] for r in rows}
    return [c for c in PAPER if c in present] + sorted(present - set(PAPER))


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch on ``threads`` threads, and back to the caller's count after: with ``--jobs 1`` the
    runs are in the caller's process, whose later work must not inherit this count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_one(path: str, run_dir: str, seed: int, rounds: int, overrides: Sequence[str], threads: int) -> Dict:
    """One run through the plugin's runner (in a worker process)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from fedml_perfedavg.run.config import load
    from fedml_perfedavg.run.runner import run

    config = load(path, [f"random_seed={seed}", f"comm_round={rounds}", "show_progress=false", *overrides])
    with _torch_threads(threads):
        result = run(config, run_dir)
    return result.summary


def run_group(
    path: str, run_dirs: Sequence[str], seeds: Sequence[int], rounds: int, overrides: Sequence[str], threads: int
) -> List[Dict]:
    """Grid mode: the seeds of one cell and method in one process, their clients trained as one
    computation per round (``fedml_perfedavg.run.runner.run_grid``)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    from fedml_perfedavg.run.config import load
    from fedml_perfedavg.run.runner import run_grid

    configs = [
        load(path, [f"random_seed={seed}", f"comm_round={rounds}", "show_progress=false", *overrides]) for seed in seeds
    ]
    with _torch_threads(threads):
        return [result.summary for result in run_grid(configs, list(run_dirs))]


def finished(run_dir: Path) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("status", "finished") == "finished"


def collect(out: Path) -> List[Dict]:
    rows = []
    for summary_path in sorted((out / "runs").glob("*/*/seed*/summary.json")):
        s = json.loads(summary_path.read_text())
        cell, method, seed = summary_path.parts[-4], summary_path.parts[-3], int(summary_path.parts[-2][4:])
        rows.append(
            {
                "cell": cell,
                "dataset": cell.split("_")[0],
                "method": method,
                "seed": seed,
                "rounds": s["rounds"],
                "personalized_accuracy": s["personalized_accuracy"],
                "accuracy_before_adaptation": s["accuracy_before_adaptation"],
                "personalized_accuracy_std": s.get("personalized_accuracy_std"),
                "new_user_personalized_accuracy": s.get("new_user_personalized_accuracy"),
                "stationarity": (s["history"] or [{}])[-1].get("stationarity"),
                "train_seconds": (s["history"] or [{}])[-1].get("train_seconds"),
                "wall_seconds": s["wall_seconds"],
                "status": s.get("status", "finished"),
                "run_dir": str(summary_path.parent.relative_to(out)),
                "_summary": s,
            }
        )
    return rows


def write_csv(rows: List[Dict], path: Path) -> None:
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _fmt(mean: float, half: float) -> str:
    return f"{mean:.2f} ± {half:.2f}" if not math.isnan(half) else f"{mean:.2f}"


def table_markdown(rows: List[Dict], command: str) -> str:
    lines = [
        "# Table 1: ours vs the paper",
        "",
        f"Command: `{command}`; written {time.strftime('%Y-%m-%d')}.",
        "Mean per-user personalized accuracy (%) after one alpha-step on the user's training data, mean ± "
        "half-width of the 95% t interval over seeds; `before` is the global model's accuracy without the step.",
        "",
    ]
    for cell in cell_order(rows):
        cell_rows = [r for r in rows if r["cell"] == cell and r["status"] == "finished"]
        if not cell_rows:
            continue
        lines += [
            f"## {cell}",
            "",
            "| method | seeds | rounds | ours | paper | ours - paper | before | "
            "paired gain over FedAvg | new users | ||grad F(w)||^2 at the end | train s/run | wall s/run |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        fedavg = {r["seed"]: r["personalized_accuracy"] for r in cell_rows if r["method"] == "fedavg"}
        for method in METHODS:
            mr = sorted((r for r in cell_rows if r["method"] == method), key=lambda r: r["seed"])
            if not mr:
                continue
            acc = [100 * r["personalized_accuracy"] for r in mr]
            mean, half = mean_ci95(acc)
            before = mean_ci95([100 * r["accuracy_before_adaptation"] for r in mr])
            paper = PAPER.get(cell, {}).get(method)
            diff = f"{mean - paper:+.2f}" if paper is not None else "-"
            paired = [100 * (r["personalized_accuracy"] - fedavg[r["seed"]]) for r in mr if r["seed"] in fedavg]
            gain = _fmt(*mean_ci95(paired)) if paired and method != "fedavg" else "-"
            wall = statistics.mean(r["wall_seconds"] for r in mr)
            new = [
                100 * r["new_user_personalized_accuracy"] for r in mr if r["new_user_personalized_accuracy"] is not None
            ]
            new_users = _fmt(*mean_ci95(new)) if new else "-"
            stationarity = [r["stationarity"] for r in mr if r["stationarity"] is not None]
            stationary = f"{statistics.mean(stationarity):.3g}" if stationarity else "-"
            trained = [r["train_seconds"] for r in mr if r["train_seconds"] is not None]
            train = f"{statistics.mean(trained):.0f}" if trained else "-"
            lines.append(
                f"| {METHOD_NAMES[method]} | {len(mr)} | {mr[0]['rounds']} | {_fmt(mean, half)} | "
                f"{paper if paper is not None else '-'} | {diff} | {_fmt(*before)} | {gain} | {new_users} | "
                f"{stationary} | {train} | {wall:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def _band(histories: List[List[Dict]], key: str) -> Tuple[List[float], List[float], List[float]]:
    """(rounds, mean, 95% half-width) of ``key`` over runs that logged it on the same rounds."""
    measured = [[e for e in h if key in e] for h in histories]  # some keys are logged on their own schedule
    rounds = [e["round"] for e in measured[0]]
    usable = [h for h in measured if [e["round"] for e in h] == rounds]
    if not rounds or not usable:
        return [], [], []
    curves = [[e[key] for e in h] for h in usable]
    means = [statistics.mean(c) for c in zip(*curves)]
    halves = [mean_ci95(c)[1] if len(c) > 1 else 0.0 for c in zip(*curves)]
    return rounds, means, halves


def plot_cells(rows: List[Dict], out: Path) -> List[Path]:
    """Per cell: accuracy against rounds and against training time (mean and 95% band over
    seeds), the stationarity measure where it was logged, and per-user accuracy at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for cell in cell_order(rows):
        cell_rows = [r for r in rows if r["cell"] == cell and r["status"] == "finished"]
        if not cell_rows:
            continue
        has_stationarity = any("stationarity" in e for r in cell_rows for e in r["_summary"]["history"])
        fig, axes = plt.subplots(1, 4 if has_stationarity else 3, figsize=(22 if has_stationarity else 17, 4.5))
        ax_curve, ax_time, ax_users = axes[0], axes[1], axes[-1]
        box_data, box_labels = [], []
        for method in METHODS:
            mr = [r for r in cell_rows if r["method"] == method]
            if not mr:
                continue
            histories = [r["_summary"]["history"] for r in mr]
            rounds, means, halves = _band(histories, "personalized_accuracy")
            means, halves = [100 * m for m in means], [100 * h for h in halves]
            low, high = [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)]
            ax_curve.plot(rounds, means, label=METHOD_NAMES[method])
            ax_curve.fill_between(rounds, low, high, alpha=0.2)
            # x: the mean over seeds of the training time (evaluation excluded) at each evaluation
            _, seconds, _ = _band(histories, "train_seconds")
            if seconds:
                # FedAvg + ARUBA trains on the engine's vmap path (its clients send statistics back),
                # the others on the hand-batched one: its time axis is not comparable with theirs.
                path_note = " (vmap path)" if method == "aruba" else ""
                ax_time.plot(seconds, means, label=METHOD_NAMES[method] + path_note)
                ax_time.fill_between(seconds, low, high, alpha=0.2)
            if has_stationarity:
                s_rounds, s_means, s_halves = _band(histories, "stationarity")
                if s_rounds:
                    axes[2].plot(s_rounds, s_means, label=METHOD_NAMES[method])
                    axes[2].fill_between(
                        s_rounds,
                        [max(m - h, m / 10) for m, h in zip(s_means, s_halves)],
                        [m + h for m, h in zip(s_means, s_halves)],
                        alpha=0.2,
                    )
            box_data.append([100 * a for r in mr for a in r["_summary"]["per_user_accuracy"]])
            box_labels.append(method)
        ax_curve.set(xlabel="round", ylabel="personalized accuracy (%)", title=f"{cell}: mean and 95% band over seeds")
        ax_curve.legend()
        ax_time.set(
            xlabel="training time (s, evaluation excluded; this engine and machine)",
            ylabel="personalized accuracy (%)",
            title="accuracy against training time",
        )
        ax_time.legend()
        if has_stationarity:
            axes[2].set(
                xlabel="round", ylabel="||grad F(w)||^2", yscale="log", title="stationarity measure (exact, full data)"
            )
            axes[2].legend()
        ax_users.boxplot(box_data, tick_labels=box_labels, showmeans=True)
        ax_users.set(ylabel="per-user accuracy at the end (%)", title="who gains: per-user accuracy, all seeds")
        fig.tight_layout()
        path = out / f"{cell}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (reports are committed)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def wandb_report(rows: List[Dict], out: Path) -> None:
    """wandb_report.md: every run's offline wandb folder and the one command that uploads them."""
    lines = [
        "# wandb runs of the Table 1 grid",
        "",
        "Each run logged offline into its run directory: project `fedml-perfedavg`, group = the cell, tags = "
        "method (with the variant), seed and dataset. The folders stay on the machine that ran the grid (git "
        "ignores wandb run folders); there, one command uploads them all (from the repository root, after "
        "`wandb login`):",
        "",
        "```",
        f"wandb sync {_shown(out)}/runs/*/*/seed*/wandb/offline-run-*",
        "```",
        "",
        "In wandb's UI, group the runs table by `Group` (one row per cell) and then by tag, or filter one tag "
        "per method: the panels of `eval/personalized_accuracy` then show each cell's mean and band over seeds, "
        "which is Table 1; `eval/train_seconds` as the x-axis gives accuracy against training time, and "
        "`final/per_user_accuracy` is the per-user table of each run.",
        "",
        "| cell | method | seed | personalized accuracy | wandb run folder |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        folders = sorted((out / r["run_dir"] / "wandb").glob("offline-run-*"))
        if folders:
            lines.append(
                f"| {r['cell']} | {r['method']} | {r['seed']} | {100 * r['personalized_accuracy']:.2f} | "
                f"`{folders[-1].relative_to(out)}` |"
            )
    if lines[-1].startswith("| ---"):
        lines.append("| (none: no run here was made with `--wandb`) | | | | |")
    (out / "wandb_report.md").write_text("\n".join(lines) + "\n")


def report(out: Path, command: str, seeds: int = None) -> str:
    """Write the CSV (every finished run) and the table, plots and wandb report (seeds < ``seeds``,
    so that every method of a cell is compared on the same seeds)."""
    rows = collect(out)
    write_csv(rows, out / "table1.csv")
    if seeds is not None:
        rows = [r for r in rows if r["seed"] < seeds]
    markdown = table_markdown(rows, command)
    (out / "table1.md").write_text(markdown)
    plot_cells(rows, out)
    wandb_report(rows, out)
    return markdown


README_BEGIN = "<!-- table1: generated by benchmarks/readme.py from benchmarks/results/table1 -->"
README_END = "<!-- /table1 -->"
README_CELLS = ("mnist_tau10_alpha0.01", "mnist_tau4_alpha0.01")  # the paper's MNIST cells


def read_csv(path: Path) -> List[Dict]:
    """The rows :func:`write_csv` wrote (numbers as numbers)."""
    with open(path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    for row in rows:
        row["seed"], row["rounds"] = int(row["seed"]), int(row["rounds"])
        row["personalized_accuracy"] = float(row["personalized_accuracy"])
    return rows


def readme_table(rows: List[Dict], written: str) -> str:
    """README's Table 1: each paper MNIST cell's mean personalized accuracy by method, ± the 95% t
    interval over seeds, the paper's figure in parentheses (from the recorded runs' CSV)."""
    methods = ("fedavg", "fo", "hf", "exact")
    lines = [
        f"Table 1 of the paper on MNIST (`make table1`, runs of {written}): mean per-user personalized accuracy (%)",
        "after one alpha-step, ± the 95% t interval over 5 seeds, the paper's figure in parentheses; K=1000 rounds.",
        "",
        "| cell | " + " | ".join(METHOD_NAMES[m] for m in methods) + " |",
        "| --- |" + " --- |" * len(methods),
    ]
    for cell in README_CELLS:
        cells = []
        for method in methods:
            accuracy = [
                100 * r["personalized_accuracy"]
                for r in rows
                if r["cell"] == cell and r["method"] == method and r["status"] == "finished" and r["seed"] < 5
            ]
            paper = PAPER.get(cell, {}).get(method)
            shown = _fmt(*mean_ci95(accuracy)) if accuracy else "-"
            cells.append(shown + (f" ({paper:.2f})" if paper is not None else ""))
        tau, alpha = cell.split("_")[1][3:], cell.split("_")[2][5:]
        lines.append(f"| tau={tau}, alpha={alpha} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_with_table(readme: str, results: Path) -> str:
    """``readme`` with its Table 1 between the markers generated from ``results`` (table1.csv, and the
    date table1.md was written)."""
    written = re.search(r"written (\d{4}-\d{2}-\d{2})", (results / "table1.md").read_text())
    table = readme_table(read_csv(results / "table1.csv"), written.group(1) if written else "an unrecorded date")
    start, end = readme.index(README_BEGIN) + len(README_BEGIN), readme.index(README_END)
    return readme[:start] + "\n" + table + "\n" + readme[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["mnist"], choices=["mnist", "cifar10"])
    parser.add_argument("--cells", nargs="*", default=[], help="cell names, e.g. mnist_tau4_alpha0.01")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "table1"))
    parser.add_argument("--wandb", action="store_true", help="log every run to wandb (offline unless WANDB_MODE)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (e.g. data_cache_dir=...)",
    )
    parser.add_argument(
        "--extras",
        nargs="*",
        default=[],
        choices=sorted(EXTRAS),
        help="beyond the paper: new_users (10%% of users never trained on), alpha_sweep (MNIST tau=4)",
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--grid-mode",
        action="store_true",
        help="run the seeds of each cell and method in one process, their clients trained as one "
        "computation per round (same results per run; --jobs processes over the groups)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/table1.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if not args.report_only:
        overrides = list(args.overrides) + (["enable_wandb=true"] if args.wandb else [])
        if args.wandb:
            os.environ.setdefault("WANDB_MODE", "offline")
        todo = [
            (cell, method, path, extra, seed)
            for cell, method, path, extra in grid(args.datasets, args.cells, args.methods, args.extras)
            for seed in range(args.seeds)
        ]
        pending = [t for t in todo if not finished(out / "runs" / t[0] / t[1] / f"seed{t[4]}")]
        print(
            f"{len(todo)} runs in the grid, {len(todo) - len(pending)} already finished, {len(pending)} to run",
            file=sys.stderr,
        )
        threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
        failures: List[str] = []
        from tqdm import tqdm

        def record(cell, method, seed, get_summary):
            try:
                summary = get_summary()
                bar.set_postfix_str(f"{cell} {method} s{seed}: {100 * summary['personalized_accuracy']:.2f}%")
            except Exception as err:  # keep the grid going; report at the end
                failures.append(f"{cell} {method} seed {seed}: {err}")
            bar.update(1)

        started = time.time()
        with tqdm(total=len(pending), unit="run") as bar:
            jobs = [
                (
                    str(path),
                    str(out / "runs" / cell / method / f"seed{seed}"),
                    seed,
                    args.rounds,
                    overrides + extra,
                    threads,
                    (cell, method, seed),
                )
                for cell, method, path, extra, seed in pending
            ]
            if args.grid_mode:
                groups: Dict[Tuple[str, str], list] = {}
                for job in jobs:
                    groups.setdefault(job[-1][:2], []).append(job)

                def record_group(group, get_summaries):
                    try:
                        summaries = get_summaries()
                    except Exception as err:  # keep the grid going; report at the end
                        failures.extend(f"{c} {m} seed {k}: {err}" for c, m, k in (job[-1] for job in group))
                        bar.update(len(group))
                        return
                    for job, summary in zip(group, summaries):
                        record(*job[-1], lambda summary=summary: summary)

                group_jobs = [
                    (
                        group,
                        (group[0][0], [j[1] for j in group], [j[2] for j in group], args.rounds, group[0][4], threads),
                    )
                    for group in groups.values()
                ]
                if args.jobs <= 1:  # in this process (also what tests use)
                    for group, call in group_jobs:
                        record_group(group, lambda call=call: run_group(*call))
                else:
                    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                        futures = {pool.submit(run_group, *call): group for group, call in group_jobs}
                        for future in as_completed(futures):
                            record_group(futures[future], future.result)
            elif args.jobs <= 1:  # in this process (also what tests use)
                for *job, key in jobs:
                    record(*key, lambda: run_one(*job))
            else:
                with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                    futures = {pool.submit(run_one, *job): key for *job, key in jobs}
                    for future in as_completed(futures):
                        record(*futures[future], future.result)
        for failure in failures:
            print("FAILED:", failure, file=sys.stderr)
        mode = (
            "grid mode (the seeds of a cell and method as one computation)" if args.grid_mode else "one process per run"
        )
        timing = {
            "command": command.strip(),
            "date": time.strftime("%Y-%m-%d"),
            "runs": len(pending),
            "mode": mode,
            "jobs": args.jobs,
            "wall_seconds": time.time() - started,
        }
        (out / "grid_timing.json").write_text(json.dumps(timing, indent=2))
        print(f"{len(pending)} runs in {timing['wall_seconds']:.0f} s ({mode}, {args.jobs} jobs)", file=sys.stderr)
    print(report(out, command.strip(), args.seeds))
    return 1 if not args.report_only and failures else 0


if __name__ == "__main__":
    sys.exit(main())
