"""One method's round on two checkouts (before and after a change), their rounds alternated; or
one checkout's round without and with DP-SGD (what DP-SGD costs a round).

    python benchmarks/before_after.py --before ../before-checkout [--after .] --method hf [--dp] [--rounds 30]
    python benchmarks/before_after.py --dp-cost [--after .] --method hf [--rounds 30]

Each checkout runs in a process of its own (its own code, imported from its own tree, on this
venv), building the batched engine as ``speed.py`` does (``--dp``: as ``dp_round_parts.py`` does,
sigma 1, C 1); the parent asks each for one ``train_round`` in turn and reads back its
milliseconds. A pair of rounds meets the same machine state, so the median of the pairs' ratios
holds on a machine whose pace moves by a third within minutes, which two separate runs do not.
The two processes evict each other's data from the caches between rounds, so the rounds are
slower than a run's; only the ratio is the measure. With ``--block K`` each side runs K rounds in
turn and its figure is the median of the last K - 1: rounds that follow rounds of their own, as in
a run (where one side's round is much longer than the other's, the eviction would otherwise weigh
on the shorter one more). ``--before`` is any checkout, e.g. ``git
worktree add ../before <commit>``. Prints one line and writes before_after_<method>.json under --out.

``--dp-cost``: both processes run ``--after``'s code on the quickstart config (the paper's MLP and
split, 10 clients, tau 10, batches of 40), one without DP-SGD and one with it (sigma 1, C 1); the
ratio is the private round's time over the plain one's (written as dp_cost_<method>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))


def serve(repo: str, method: str, dp: bool, quickstart: bool = False) -> None:
    """Worker: ``repo``'s engine for ``method`` (``quickstart``: built on the quickstart config
    even without ``dp``); one round per line read, its ms printed. The engine is built here from
    the checkout's public API (as dp_round_parts.py and speed.py build theirs), not by a helper
    of this checkout's: the other checkout may predate any such helper."""
    sys.path[:0] = [repo, os.path.join(repo, "benchmarks")]
    import torch

    if dp or quickstart:
        from dp_round_parts import DP, _Driver

        from fedml_perfedavg.algorithms import create_algorithm
        from fedml_perfedavg.engine.batched import BatchedSimulation
        from fedml_perfedavg.models import create_model
        from fedml_perfedavg.run.config import load_yaml, resolve
        from fedml_perfedavg.run.runner import load_split

        overrides = {
            "data_cache_dir": MNIST_ROOT,
            "show_progress": False,
            "perfedavg_variant": method,
            **(DP if dp else {}),
        }
        config = resolve(load_yaml(os.path.join(repo, "yaml_configs", "quickstart_mnist_hf.yaml")), overrides)
        users = load_split(config).users
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60])
        algorithm = create_algorithm(config.train.federated_optimizer, model, config)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        algorithm.probe_model(state, users[0].train_x[:40], users[0].train_y[:40])
        engine = BatchedSimulation(algorithm, users, state, _Driver(algorithm))
    else:
        from speed import load_users, method_engine

        engine, _ = method_engine(method, load_users(50, "cpu")[0])
    print("ready", flush=True)
    round_idx = 0
    for line in sys.stdin:  # "go K": K rounds; the reply is the median of all but the first
        times = []
        for _ in range(int(line.split()[1])):
            start = time.perf_counter()
            engine.train_round(round_idx)
            times.append((time.perf_counter() - start) * 1000)
            round_idx += 1
        print(statistics.median(times[1:] or times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the checkout before the change (required)")
    parser.add_argument("--after", default=str(REPO), help="the checkout after it (default: this one)")
    parser.add_argument("--method", choices=["fedavg", "fo", "hf", "exact"], default="hf")
    parser.add_argument("--dp", action="store_true", help="with DP-SGD (sigma 1, C 1)")
    parser.add_argument(
        "--dp-cost", action="store_true", help="--after's round without DP-SGD (before) and with it (after)"
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed pairs, after 3 untimed")
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="rounds each side runs in turn; a side's figure is the median of its block's rounds "
        "but the first (which meets the caches as the other process left them)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--serve", nargs=3, metavar=("REPO", "METHOD", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], args.dp, quickstart=args.serve[2] == "quickstart")
        return
    if args.dp_cost:
        if args.before is not None or args.dp:
            parser.error("--dp-cost compares --after's round without and with DP-SGD: no --before, no --dp")
        sides = {"before": os.path.abspath(args.after), "after": os.path.abspath(args.after)}
        private = {"before": False, "after": True}
    elif args.before is None:
        parser.error("--before is required (or --dp-cost)")
    else:
        sides = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
        private = {"before": args.dp, "after": args.dp}
    workers = {}
    for name, repo in sides.items():
        config = "quickstart" if args.dp_cost else "speed"
        command = [sys.executable, __file__, "--serve", repo, args.method, config] + (["--dp"] if private[name] else [])
        workers[name] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=repo)
    for name, worker in workers.items():  # the data loads and logs first; then "ready"
        assert worker.stdout is not None
        line = "?"
        while line and line.strip() != "ready":
            line = worker.stdout.readline()
        if not line:
            raise SystemExit(f"the {name} checkout's worker ended before it was ready (exit {worker.wait()})")
    times: dict = {name: [] for name in workers}
    for pair in range(args.rounds + 3):
        for name, worker in workers.items():
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(f"go {args.block}\n")
            worker.stdin.flush()
            reply = worker.stdout.readline()
            if not reply:
                raise SystemExit(f"the {name} checkout's worker ended in round {pair} (exit {worker.wait()})")
            ms = float(reply)
            if pair >= 3:
                times[name].append(ms)
    for worker in workers.values():
        assert worker.stdin is not None
        worker.stdin.close()
        worker.wait()

    def commit(repo: str) -> str:
        done = subprocess.run(
            ["git", "log", "--oneline", "-1", "--format=%h"], cwd=repo, capture_output=True, text=True
        )
        return done.stdout.strip() or "?"

    ratios = [after / before for before, after in zip(times["before"], times["after"])]
    result = {
        "method": args.method
        + (" DP-SGD" if args.dp else "")
        + (" without (before) and with DP-SGD" if args.dp_cost else ""),
        "before": commit(sides["before"]),
        "after": commit(sides["after"]),
        "pairs": args.rounds,
        "block": args.block,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/before_after.py " + " ".join(sys.argv[1:]),
        "before_ms": statistics.median(times["before"]),
        "after_ms": statistics.median(times["after"]),
        "after_over_before_median": statistics.median(ratios),
        "after_over_before_min": min(ratios),
        "after_over_before_max": max(ratios),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"dp_cost_{args.method}" if args.dp_cost else "before_after_" + args.method + ("_dp" if args.dp else "")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    print(
        f"{result['method']}: {result['before']} {result['before_ms']:.1f} ms, {result['after']} "
        f"{result['after_ms']:.1f} ms; after/before {result['after_over_before_median']:.3f} (pairs' median; "
        f"{result['after_over_before_min']:.3f}-{result['after_over_before_max']:.3f}), {args.rounds} pairs"
    )


if __name__ == "__main__":
    main()
