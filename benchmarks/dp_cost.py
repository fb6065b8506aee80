"""What DP-SGD costs (dp_args.dp_solution_type: dpsgd): round time against the plain run, and
personalized accuracy against epsilon.

    python benchmarks/dp_cost.py --mnist-root ../shared/datasets [--seeds 0 1 2] [--rounds 200]

1. Round time: the paper's MLP on its MNIST split, 10 of 50 users per round, tau = 10, batches of
   40, with and without DP-SGD (sigma 1, C 1), each variant; the training time of ``--speed-rounds``
   rounds (summary.json's train_seconds, evaluation excluded) divided by the rounds. A plain run
   and a private one in turn, ``--speed-repeats`` times: the ratio is the median of the pairs'
   (this machine's pace moves by a third within minutes).
2. Accuracy against epsilon: ``yaml_configs/quickstart_mnist_hf.yaml`` (HF, ``--rounds`` rounds,
   evaluated every 10) with sigma in {0.5, 1, 2} (C 1, delta 1e-5) and without DP, each seed of
   ``--seeds``: the final personalized accuracy (mean over seeds, 95% t-interval) and the largest
   and the median epsilon over users.

Writes ``benchmarks/results/dp_cost.md``, ``.json`` and ``dp_accuracy_epsilon.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# not `benchmarks.table1`: opacus 1.6.0 installs a top-level package named benchmarks, which shadows this folder
from table1 import mean_ci95  # noqa: E402  (the 95% t interval every table states)

QUICKSTART = os.path.join(REPO, "yaml_configs", "quickstart_mnist_hf.yaml")
SIGMAS = (0.5, 1.0, 2.0)


def _dp(sigma: float, clip: float = 1.0) -> dict:
    return {
        "dp_args.enable_dp": True,
        "dp_args.dp_solution_type": "dpsgd",
        "dp_args.noise_multiplier": sigma,
        "dp_args.max_grad_norm": clip,
        "dp_args.delta": 1e-5,
    }


def _run(overrides: dict, work: str, name: str) -> dict:
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import run

    config = resolve(load_yaml(QUICKSTART), {"show_progress": False, **overrides})
    return run(config, os.path.join(work, name)).summary


def speed(root: str, rounds: int, work: str, repeats: int = 3) -> list:
    rows = []
    for variant in ("hf", "fo", "exact"):
        times: dict = {False: [], True: []}
        for repeat in range(repeats):  # plain and private runs in turn: a pair meets the same machine
            for private in (False, True):
                overrides = {
                    "data_cache_dir": root,
                    "perfedavg_variant": variant,
                    "comm_round": rounds,
                    "frequency_of_the_test": 100000,  # the last round only: its time is not training time
                    **(_dp(1.0) if private else {}),
                }
                summary = _run(overrides, work, f"speed-{variant}-{private}-{repeat}")
                times[private].append(summary["history"][-1]["train_seconds"] / summary["rounds"])
        ratios = [dp / plain for plain, dp in zip(times[False], times[True])]
        rows.append(
            {
                "variant": variant,
                "plain_s": statistics.median(times[False]),
                "dp_s": statistics.median(times[True]),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
            }
        )
        print(rows[-1], flush=True)
    return rows


def accuracy(root: str, rounds: int, seeds: list, work: str, clip: float) -> list:
    rows = []
    for sigma in (None, *SIGMAS):
        accuracies, largest, median = [], [], []
        for seed in seeds:
            overrides = {
                "data_cache_dir": root,
                "comm_round": rounds,
                "random_seed": seed,
                **(_dp(sigma, clip) if sigma else {}),
            }
            summary = _run(overrides, work, f"acc-{sigma}-{seed}")
            accuracies.append(summary["personalized_accuracy"])
            if sigma:
                per_user = [entry["epsilon"] for entry in summary["privacy"]["per_user"].values()]
                largest.append(summary["privacy"]["epsilon"])
                median.append(statistics.median(per_user))
        rows.append(
            {
                "sigma": sigma,
                "seeds": seeds,
                "max_grad_norm": clip,
                "accuracy": statistics.mean(accuracies),
                "accuracy_ci95": mean_ci95(accuracies)[1],
                "accuracies": accuracies,
                "epsilon_largest": statistics.mean(largest) if largest else None,
                "epsilon_median": statistics.mean(median) if median else None,
            }
        )
        print(rows[-1], flush=True)
    return rows


CLIPPING = ((0.01, 1.0), (1.0, 1.0), (1.0, 10.0))  # (sigma, C): which of the two costs accuracy


def clipping(root: str, rounds: int, work: str) -> list:
    rows = []
    for sigma, clip in CLIPPING:
        overrides = {"data_cache_dir": root, "comm_round": rounds, "random_seed": 0, **_dp(sigma)}
        overrides["dp_args.max_grad_norm"] = clip
        summary = _run(overrides, work, f"clip-{sigma}-{clip}")
        rows.append(
            {
                "sigma": sigma,
                "max_grad_norm": clip,
                "accuracy": summary["personalized_accuracy"],
                "epsilon_largest": summary["privacy"]["epsilon"],
            }
        )
        print(rows[-1], flush=True)
    return rows


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private = [r for r in rows if r["sigma"]]
    plain = next(r for r in rows if not r["sigma"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar(
        [r["epsilon_largest"] for r in private],
        [r["accuracy"] for r in private],
        yerr=[0 if r["accuracy_ci95"] != r["accuracy_ci95"] else r["accuracy_ci95"] for r in private],
        marker="o",
        label="DP-SGD (largest epsilon over users)",
    )
    for r in private:
        ax.annotate(
            f"sigma={r['sigma']:g}", (r["epsilon_largest"], r["accuracy"]), textcoords="offset points", xytext=(4, 4)
        )
    ax.axhline(plain["accuracy"], color="gray", linestyle="--", label="no DP")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon at delta 1e-5")
    ax.set_ylabel("personalized accuracy")
    ax.set_title("Per-FedAvg (HF), MNIST paper split")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--speed-rounds", type=int, default=30)
    parser.add_argument("--speed-repeats", type=int, default=3, help="plain and private runs in turn, each this often")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clip", type=float, default=10.0, help="C of the accuracy-against-epsilon part")
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["speed", "accuracy", "clipping"],
        default=["speed", "accuracy", "clipping"],
        help="measure these; the other's figures are kept from the last results, with their command",
    )
    args = parser.parse_args()
    out = os.path.join(REPO, "benchmarks", "results")
    date = datetime.date.today().isoformat()
    command = "python benchmarks/dp_cost.py --mnist-root ../shared/datasets " + " ".join(sys.argv[3:])
    previous: dict = {"speed": [], "accuracy": [], "clipping": [], "speed_measured": {}, "accuracy_measured": {}}
    if os.path.exists(os.path.join(out, "dp_cost.json")):
        with open(os.path.join(out, "dp_cost.json")) as f:
            previous = json.load(f)
    with tempfile.TemporaryDirectory() as work:
        speed_rows = (
            speed(args.mnist_root, args.speed_rounds, work, args.speed_repeats)
            if "speed" in args.parts
            else previous["speed"]
        )
        accuracy_rows = (
            accuracy(args.mnist_root, args.rounds, args.seeds, work, args.clip)
            if "accuracy" in args.parts
            else previous["accuracy"]
        )
        clipping_rows = (
            clipping(args.mnist_root, args.rounds, work) if "clipping" in args.parts else previous.get("clipping", [])
        )
    record = {
        "speed": speed_rows,
        "speed_measured": {"date": date, "command": command} if "speed" in args.parts else previous["speed_measured"],
        "accuracy": accuracy_rows,
        "accuracy_measured": (
            {"date": date, "command": command} if "accuracy" in args.parts else previous["accuracy_measured"]
        ),
        "clipping": clipping_rows,
        "clipping_measured": (
            {"date": date, "command": command} if "clipping" in args.parts else previous.get("clipping_measured", {})
        ),
    }
    with open(os.path.join(out, "dp_cost.json"), "w") as f:
        json.dump(record, f, indent=1)
    if accuracy_rows:
        _plot(accuracy_rows, os.path.join(out, "dp_accuracy_epsilon.png"))
    lines = [
        "# DP-SGD: cost and accuracy against epsilon",
        "",
        f"Round time (training only), paper MLP, 10 of 50 users, tau 10, batches of 40, sigma 1, C 1 "
        f"({record['speed_measured'].get('date')}, `{record['speed_measured'].get('command')}`):",
        "",
        "| variant | plain s/round | DP-SGD s/round | ratio (median of the pairs; each pair) |",
        "|---|---|---|---|",
        *[
            f"| {r['variant']} | {r['plain_s']:.3f} | {r['dp_s']:.3f} | {r['ratio']:.2f}x "
            f"({', '.join(f'{x:.2f}' for x in r.get('ratios', [r['ratio']]))}) |"
            for r in speed_rows
        ],
        "",
        f"Accuracy against epsilon, quickstart HF config, seeds {accuracy_rows[0]['seeds'] if accuracy_rows else []}, "
        f"C {accuracy_rows[0].get('max_grad_norm', 1.0) if accuracy_rows else ''}, delta 1e-5 "
        f"({record['accuracy_measured'].get('date')}, `{record['accuracy_measured'].get('command')}`):",
        "",
        "| sigma | personalized accuracy (95% CI) | largest epsilon | median epsilon |",
        "|---|---|---|---|",
        *[
            f"| {r['sigma'] or 'no DP'} | {r['accuracy']:.4f} ± {r['accuracy_ci95']:.4f} | "
            f"{'' if r['epsilon_largest'] is None else format(r['epsilon_largest'], '.3g')} | "
            f"{'' if r['epsilon_median'] is None else format(r['epsilon_median'], '.3g')} |"
            for r in accuracy_rows
        ],
        "",
        "![accuracy against epsilon](dp_accuracy_epsilon.png)",
        "",
        f"Clipping or noise: the same config, seed 0 ({record['clipping_measured'].get('date')}, "
        f"`{record['clipping_measured'].get('command')}`):",
        "",
        "| sigma | C | personalized accuracy | largest epsilon |",
        "|---|---|---|---|",
        *[
            f"| {r['sigma']:g} | {r['max_grad_norm']:g} | {r['accuracy']:.4f} | {r['epsilon_largest']:.3g} |"
            for r in clipping_rows
        ],
    ]
    with open(os.path.join(out, "dp_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
