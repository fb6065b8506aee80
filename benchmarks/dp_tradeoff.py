"""DP-SGD's accuracy against epsilon at the paper's length (issue 59 item 3): fixed C against
adaptive clipping.

    python benchmarks/dp_tradeoff.py --mnist-root ../shared/datasets \\
        [--sigmas 2 4 8] [--clips 1 10 adaptive] [--seeds 0 1 2 3 4] [--rounds 1000] [--workers 2]

The config is the paper's MNIST HF run (``yaml_configs/mnist_tau10_alpha0.01_hf.yaml``: 50 users,
10 a round, tau 10, batches of 40, alpha 0.01, beta 0.001, 1000 rounds), evaluated every
``--every`` rounds and after the last (each evaluation is a use of every user's data, so it is part
of epsilon), delta 1e-5, PRV's epsilon. A clip of ``adaptive`` starts every user's bound at C = 1 and
follows the median of its norms (``dp_args.clip: adaptive``, the defaults). Without DP the same
config is run for each seed too (the accuracy each epsilon is measured against).

Every finished run is kept in ``benchmarks/results/dp_tradeoff.json`` (``--results``) at once
(keyed by rounds, sigma, clip and seed, with the date and commit), so the grid can be run in
pieces: a cell already there is not run again, and several instances (other parts of the grid) can
share the file. The table (``dp_tradeoff_<rounds>.md``: mean over seeds, 95% t-interval) and the
plot (``dp_tradeoff_<rounds>.png``), beside it, are written from every cell of that length.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# not `benchmarks.table1`: opacus 1.6.0 installs a top-level package named benchmarks, which shadows this folder
from table1 import mean_ci95  # noqa: E402  (the 95% t interval every table states)

CONFIG = os.path.join(REPO, "yaml_configs", "mnist_tau10_alpha0.01_hf.yaml")
RESULTS = os.path.join(REPO, "benchmarks", "results")
ADAPTIVE = "adaptive"


def _key(rounds: int, sigma: Optional[float], clip: Optional[str], seed: int) -> str:
    return f"rounds={rounds} sigma={sigma} clip={clip} seed={seed}"


def _overrides(root: str, rounds: int, every: int, sigma: Optional[float], clip: Optional[str], seed: int) -> dict:
    overrides: Dict[str, Any] = {
        "data_cache_dir": root,
        "comm_round": rounds,
        "frequency_of_the_test": every,
        "random_seed": seed,
        "show_progress": False,
        "checkpoint_every": 0,
    }
    if sigma is not None:
        overrides.update(
            {
                "dp_args.enable_dp": True,
                "dp_args.dp_solution_type": "dpsgd",
                "dp_args.noise_multiplier": sigma,
                "dp_args.delta": 1e-5,
                "dp_args.max_grad_norm": 1.0 if clip == ADAPTIVE else float(clip),  # type: ignore[arg-type]
            }
        )
        if clip == ADAPTIVE:
            overrides["dp_args.clip"] = ADAPTIVE
    return overrides


def run_cell(root: str, rounds: int, every: int, sigma: Optional[float], clip: Optional[str], seed: int) -> dict:
    """One run, in a worker process of one thread; its figures."""
    import torch

    torch.set_num_threads(1)
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import run

    with tempfile.TemporaryDirectory() as work:
        summary = run(resolve(load_yaml(CONFIG), _overrides(root, rounds, every, sigma, clip, seed)), work).summary
    cell: Dict[str, Any] = {
        "rounds": rounds,
        "sigma": sigma,
        "clip": clip,
        "seed": seed,
        "accuracy": summary["personalized_accuracy"],
        "wall_seconds": summary["wall_seconds"],
    }
    if sigma is not None:
        per_user = [entry["epsilon"] for entry in summary["privacy"]["per_user"].values()]
        cell.update({"epsilon": summary["privacy"]["epsilon"], "epsilon_median": statistics.median(per_user)})
        bounds = summary.get("dp_clip_bounds")
        if bounds:  # each role's median over users of the final bounds
            cell["bounds_median"] = [statistics.median(b[i] for b in bounds.values()) for i in range(3)]
    return cell


def _rows(cells: Dict[str, dict], rounds: int) -> List[dict]:
    groups: Dict[tuple, List[dict]] = {}
    for cell in cells.values():
        if cell["rounds"] == rounds:
            groups.setdefault((cell["sigma"], cell["clip"]), []).append(cell)
    plain = [c["accuracy"] for c in groups.get((None, None), [])]
    rows = []
    for (sigma, clip), group in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0.0, str(kv[0][1]))):
        accuracies = [c["accuracy"] for c in sorted(group, key=lambda c: c["seed"])]
        row = {
            "sigma": sigma,
            "clip": clip,
            "seeds": sorted(c["seed"] for c in group),
            "accuracy": statistics.mean(accuracies),
            "ci95": mean_ci95(accuracies)[1],
            "cost": (statistics.mean(plain) - statistics.mean(accuracies)) if plain and sigma is not None else None,
        }
        if sigma is not None:
            row["epsilon"] = statistics.mean(c["epsilon"] for c in group)
            row["epsilon_median"] = statistics.mean(c["epsilon_median"] for c in group)
            if clip == ADAPTIVE:
                row["bounds_median"] = [statistics.mean(c["bounds_median"][i] for c in group) for i in range(3)]
        rows.append(row)
    return rows


def _plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plain = [r for r in rows if r["sigma"] is None]
    if plain:
        ax.axhline(plain[0]["accuracy"], color="black", linestyle="--", label="no DP")
    for clip in sorted({str(r["clip"]) for r in rows if r["sigma"] is not None}):
        own = sorted((r for r in rows if str(r["clip"]) == clip and r["sigma"] is not None), key=lambda r: r["epsilon"])
        label = "adaptive (from C = 1, median)" if clip == ADAPTIVE else f"C = {clip}"
        ax.errorbar(
            [r["epsilon"] for r in own],
            [r["accuracy"] for r in own],
            yerr=[r["ci95"] for r in own],
            marker="o",
            label=label,
        )
    ax.set_xscale("log")
    ax.set_xlabel("largest user epsilon (delta 1e-5, PRV)")
    ax.set_ylabel("personalized accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(cells: Dict[str, dict], rounds: int, out: str = RESULTS) -> str:
    """``dp_tradeoff_<rounds>.md`` and ``.png`` in ``out`` from the recorded cells of that length."""
    rows = _rows(cells, rounds)
    measured = sorted({(c["date"], c["commit"]) for c in cells.values() if c["rounds"] == rounds})
    lines = [
        f"# DP-SGD at {rounds} rounds: accuracy against epsilon, fixed C and adaptive clipping",
        "",
        f"Config `yaml_configs/mnist_tau10_alpha0.01_hf.yaml` ({rounds} rounds), delta 1e-5, PRV's epsilon; "
        f"mean over seeds with 95% t-interval; cost: the plain run's mean accuracy minus this one's. Runs "
        f"(date, commit): {', '.join(f'{d} {c}' for d, c in measured)}.",
        "",
        "| sigma | clip | seeds | personalized accuracy (95% CI) | cost | largest epsilon | median epsilon |"
        " final bounds D / D' / D'' (median user) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "" if r["sigma"] is None else f"{r['epsilon']:.3g}"
        median = "" if r["sigma"] is None else f"{r['epsilon_median']:.3g}"
        cost = "" if r["cost"] is None else f"{r['cost']:+.4f}"
        bounds = " / ".join(f"{b:.3g}" for b in r["bounds_median"]) if "bounds_median" in r else ""
        lines.append(
            f"| {r['sigma'] if r['sigma'] is not None else 'no DP'} | {r['clip'] or ''} | {len(r['seeds'])} | "
            f"{r['accuracy']:.4f} ± {r['ci95']:.4f} | {cost} | {eps} | {median} | {bounds} |"
        )
    lines += ["", f"![accuracy against epsilon at {rounds} rounds](dp_tradeoff_{rounds}.png)"]
    if rows:
        _plot(rows, os.path.join(out, f"dp_tradeoff_{rounds}.png"))
    with open(os.path.join(out, f"dp_tradeoff_{rounds}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100, help="evaluate every this many rounds (and after the last)")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--clips", nargs="+", default=["1", "10", ADAPTIVE])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-plain", action="store_true", help="leave out the runs without DP")
    parser.add_argument("--results", default=os.path.join(RESULTS, "dp_tradeoff.json"))
    args = parser.parse_args(argv)
    for clip in args.clips:
        if clip != ADAPTIVE and not clip.replace(".", "", 1).isdigit():
            parser.error(f"--clips {clip!r}: a number (a fixed C) or {ADAPTIVE!r}")
    cells: Dict[str, dict] = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            cells = json.load(f)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    grid = ([] if args.no_plain else [(None, None)]) + [(sigma, clip) for sigma in args.sigmas for clip in args.clips]
    todo = [(s, c, seed) for s, c in grid for seed in args.seeds if _key(args.rounds, s, c, seed) not in cells]
    print(f"{len(todo)} runs to do ({len(grid) * len(args.seeds) - len(todo)} recorded already)", flush=True)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {
            pool.submit(run_cell, args.mnist_root, args.rounds, args.every, s, c, seed): (s, c, seed)
            for s, c, seed in todo
        }
        for future in as_completed(futures):
            sigma, clip, seed = futures[future]
            cell = future.result()
            cell.update({"date": datetime.date.today().isoformat(), "commit": commit.strip()})
            cells = keep(args.results, _key(args.rounds, sigma, clip, seed), cell)
            print(json.dumps(cell), flush=True)
    print(write_report(cells, args.rounds, os.path.dirname(os.path.abspath(args.results))))


def keep(path: str, key: str, cell: dict) -> Dict[str, dict]:
    """Add one finished run to the results file, under a lock and onto what the file holds now:
    several instances (other parts of the grid) can share it. Returns every cell recorded."""
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cells: Dict[str, dict] = {}
        if os.path.exists(path):
            with open(path) as f:
                cells = json.load(f)
        cells[key] = cell
        with open(path + ".tmp", "w") as f:
            json.dump(cells, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)
    return cells


if __name__ == "__main__":
    main()
