"""Choose FedAvg + ARUBA's hyper-parameters (epsilon, zeta, p) for a Table 1 cell.

    python benchmarks/aruba_tuning.py                      # MNIST tau=4 cell, tuning seed 100, K=1000

Every combination runs the cell's FedAvg YAML with ``federated_optimizer=FedAvgARUBA`` on a
tuning seed (a different split, sampling and initialisation from the reported seeds 0-4), and
is ranked by the mean personalized accuracy of its last five evaluations. Results go to
``benchmarks/results/aruba_tuning.{json,md}``; the winner becomes the cell's
``*_aruba.yaml`` values by hand (stated in RESULTS.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
# not `benchmarks.table1`: opacus 1.6.0 installs a top-level package named benchmarks, which shadows this folder
from table1 import run_one  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", default="mnist_tau4_alpha0.01")
    parser.add_argument("--seed", type=int, default=100, help="tuning seed (not one of the reported 0-4)")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1])
    parser.add_argument("--zeta", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--p", type=float, nargs="+", default=[1.0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    base = REPO / "yaml_configs" / f"{args.cell}_fedavg.yaml"
    combos = list(itertools.product(args.epsilon, args.zeta, args.p))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    started = time.time()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [
            pool.submit(
                run_one,
                str(base),
                str(out / "aruba_tuning_runs" / f"eps{e}_zeta{z}_p{p}"),
                args.seed,
                args.rounds,
                [
                    "federated_optimizer=FedAvgARUBA",
                    f"aruba_epsilon={e}",
                    f"aruba_zeta={z}",
                    f"aruba_p={p}",
                    *args.overrides,
                ],
                threads,
            )
            for e, z, p in combos
        ]
        summaries = [f.result() for f in futures]
    rows = []
    for (e, z, p), s in zip(combos, summaries):
        tail = [h["personalized_accuracy"] for h in s["history"][-5:]]
        rows.append(
            {
                "epsilon": e,
                "zeta": z,
                "p": p,
                "final": s["personalized_accuracy"],
                "last5_mean": sum(tail) / len(tail),
                "lr_mean_final": s["history"][-1].get("aruba_lr_mean"),
                "status": s["status"],
            }
        )
    rows.sort(key=lambda r: -r["last5_mean"])
    command = "python benchmarks/aruba_tuning.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "aruba_tuning.json").write_text(
        json.dumps(
            {
                "command": command.strip(),
                "date": time.strftime("%Y-%m-%d"),
                "cell": args.cell,
                "seed": args.seed,
                "rounds": args.rounds,
                "wall_seconds": time.time() - started,
                "rows": rows,
            },
            indent=2,
        )
    )
    lines = [
        f"# FedAvg + ARUBA tuning: {args.cell}, seed {args.seed}, K={args.rounds}",
        "",
        f"Command: `{command.strip()}`; {time.strftime('%Y-%m-%d')}; {time.time() - started:.0f} s.",
        "Ranked by the mean personalized accuracy of the last five evaluations.",
        "",
        "| epsilon | zeta | p | eta0 = epsilon/zeta | last-5 mean (%) | final (%) | mean eta at the end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['epsilon']} | {r['zeta']} | {r['p']} | {r['epsilon'] / r['zeta']:.4g} | "
        f"{100 * r['last5_mean']:.2f} | {100 * r['final']:.2f} | {r['lr_mean_final']:.4g} |"
        for r in rows
    ]
    (out / "aruba_tuning.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
