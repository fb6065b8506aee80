"""A secure round's time and bytes on two commits, measured beside each other (alternating runs),
for a change that must not cost the secure round more than a few percent (issue 75: within +5%).

    python benchmarks/secure_round_beside.py --mnist-root ../shared/datasets --before 184dca3 --after HEAD \
        [--silos 10] [--rounds 5] [--pairs 3] [--dp]

Each commit is checked out in a git worktree beside the checkout; each run is ``launch-silo`` in
data-owner mode with secure aggregation (loopback, mutual TLS, every silo sampled), as
``secagg_cost.py`` runs it, with this checkout's Python. ``--dp`` adds DP-SGD (sigma 1, clip 1,
delta 1e-5): each silo then also keeps its account. Writes ``benchmarks/results/secure_round_beside.json``
(one entry per invocation, appended).
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
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RESULTS = os.path.join(REPO, "benchmarks", "results", "secure_round_beside.json")
DP = {
    "enable_dp": True,
    "dp_solution_type": "dpsgd",
    "noise_multiplier": 1.0,
    "max_grad_norm": 1.0,
    "dp_args.delta": 1e-5,
}


def _worktree(commit: str, where: str) -> str:
    path = os.path.join(where, commit.replace("/", "_"))
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, commit], check=True, capture_output=True)
    return path


def _run(tree: str, args: argparse.Namespace, work: str, label: str) -> dict:
    run_dir = os.path.join(work, label)
    settings = {
        "silo_data": "own",
        "client_num_in_total": args.silos,
        "client_num_per_round": args.silos,
        "comm_round": args.rounds,
        "frequency_of_the_test": 1,
        "show_progress": False,
        "data_cache_dir": args.mnist_root,
        "enable_secagg": True,
        **(DP if args.dp else {}),
    }
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    yaml = os.path.join(tree, "yaml_configs", "mnist_tau10_alpha0.01_hf_silo.yaml")
    command = [sys.executable, "-m", "fedml_perfedavg", "launch-silo", "--cf", yaml, "--clients", str(args.silos)]
    env = {**os.environ, "PYTHONPATH": tree, "HOME": os.path.join(work, "home-" + label)}
    env.pop("FEDML_PERFEDAVG_ACCOUNTS", None)
    started = time.perf_counter()
    # run from the worktree: ``python -m`` puts the working folder first on sys.path, ahead of PYTHONPATH
    done = subprocess.run(
        [*command, "--run-dir", run_dir, *sets], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, cwd=tree
    )
    if done.returncode != 0:
        raise SystemExit(f"launch-silo in {tree} failed with {done.returncode}; see {run_dir}/run.log")
    with open(os.path.join(run_dir, "summary.json")) as stream:
        summary = json.load(stream)
    first, last = summary["history"][0], summary["history"][-1]
    per_round = summary["secure_aggregation"]["per_round"]
    return {
        "ms_per_round": 1000 * (last["train_seconds"] - first["train_seconds"]) / (last["round"] - first["round"]),
        "bytes_per_silo": statistics.mean(b for r in per_round for b in r["bytes_per_silo"].values()),
        "personalized_accuracy": summary["personalized_accuracy"],
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--silos", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--dp", action="store_true")
    args = parser.parse_args()
    args.mnist_root = os.path.abspath(args.mnist_root)
    commits = {
        name: subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", ref], check=True, capture_output=True, text=True
        ).stdout.strip()
        for name, ref in (("before", args.before), ("after", args.after))
    }
    with tempfile.TemporaryDirectory(dir=os.path.dirname(REPO)) as where:
        trees = {name: _worktree(commit, where) for name, commit in commits.items()}
        try:
            runs = {"before": [], "after": []}
            for pair in range(args.pairs):
                order = ("before", "after") if pair % 2 == 0 else ("after", "before")
                for name in order:
                    runs[name].append(_run(trees[name], args, where, f"{name}-{pair}"))
                    print(name, pair, runs[name][-1], flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True)
    medians = {name: statistics.median(r["ms_per_round"] for r in rs) for name, rs in runs.items()}
    entry = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/secure_round_beside.py " + " ".join(sys.argv[1:]),
        "commits": commits,
        "silos": args.silos,
        "rounds": args.rounds,
        "dp": args.dp,
        "cpu": _cpu(),
        "runs": runs,
        "median_ms_per_round": medians,
        "code_ran": "each commit's own, run from its worktree",
        "time_ratio": medians["after"] / medians["before"],
        "bytes_ratio": statistics.mean(r["bytes_per_silo"] for r in runs["after"])
        / statistics.mean(r["bytes_per_silo"] for r in runs["before"]),
    }
    history = json.load(open(RESULTS)) if os.path.exists(RESULTS) else []
    history.append(entry)
    with open(RESULTS, "w") as stream:
        json.dump(history, stream, indent=1)
    print(json.dumps({k: entry[k] for k in ("commits", "median_ms_per_round", "time_ratio", "bytes_ratio")}))


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as stream:
            return next(line.split(":", 1)[1].strip() for line in stream if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
