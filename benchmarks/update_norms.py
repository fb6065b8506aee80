"""How far honest client updates stray from the update screen's reference (issue 44).

    python benchmarks/update_norms.py --mnist-root ../shared/datasets [--rounds 1000]

Runs the given shipped configs with ``train_args.update_norm_factor`` off and records, in every
round, the largest ratio of a client update's norm to the screen's reference (the lower median of
the last 20 accepted update norms and the round's own, zero norms left out): the factor an honest
run needs. Writes ``benchmarks/results/update_norms.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

CONFIGS = (
    "mnist_tau10_alpha0.01_hf",
    "mnist_tau10_alpha0.01_fo",
    "mnist_tau10_alpha0.01_fedavg",
    "mnist_tau4_alpha0.01_exact",
    "mnist_tau4_alpha0.01_aruba",
)


def worst_ratio(name: str, root: str, rounds: int, work: str) -> dict:
    from fedml_perfedavg.algorithms import update_screen
    from fedml_perfedavg.core.guards import update_distance
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import run

    worst = {"ratio": 0.0, "round": None}
    accept = update_screen.UpdateScreen.accept

    def measuring(self, round_idx, updates, global_state, clients=None):
        norms = [update_distance(u, global_state, self.parameter_names) for _, u in updates]
        reference = [n for n in (*self.norms, *norms) if n > 0]
        if reference:
            ratio = max(norms) / statistics.median_low(reference)
            if ratio > worst["ratio"]:
                worst.update(ratio=ratio, round=round_idx)
        return accept(self, round_idx, updates, global_state, clients)

    update_screen.UpdateScreen.accept = measuring
    try:
        config = resolve(
            load_yaml(os.path.join(REPO, "yaml_configs", name + ".yaml")),
            {
                "data_cache_dir": root,
                "comm_round": rounds,
                "frequency_of_the_test": rounds,
                "show_progress": False,
                "checkpoint_every": 0,
                "update_norm_factor": None,
            },
        )
        result = run(config, os.path.join(work, name))
    finally:
        update_screen.UpdateScreen.accept = accept
    return {**worst, "accuracy": result.summary["personalized_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "update_norms"))
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        found = {name: worst_ratio(name, os.path.abspath(args.mnist_root), args.rounds, work) for name in args.configs}
    when = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        "# Honest update norms against the screen's reference\n",
        f"`python benchmarks/update_norms.py --mnist-root {args.mnist_root} --rounds {args.rounds}`, {when}: the "
        f"largest ratio of an honest update's norm to the lower median of the last 20 accepted norms and the "
        f"round's (train_args.update_norm_factor off).\n",
        "| config | worst ratio | at round | personalized accuracy |",
        "| --- | --- | --- | --- |",
        *[f"| {n} | {r['ratio']:.3f} | {r['round']} | {r['accuracy']:.4f} |" for n, r in found.items()],
    ]
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as stream:
        stream.write(text)
    with open(args.out + ".json", "w") as stream:
        json.dump({"when": when, "rounds": args.rounds, **found}, stream, indent=2)
    print(text)


if __name__ == "__main__":
    main()
