"""The ledger's two accountants on the same histories: the tight one (Opacus' PRV, the default)
against its RDP bound, each call's seconds, and Google dp-accounting's PLD accountant beside them
where it is installed (an independent implementation; not a dependency of the plugin: install it
in a venv of your own, ``pip install dp-accounting==0.6.0``, and pass ``--python`` to it).

    python benchmarks/accountants.py [--google-python /path/to/venv/bin/python] [--out benchmarks/results]

Writes ``accountants.json`` and ``accountants.md`` under --out. The histories are a user's uses
(sample rate -> count) at delta 1e-5: the paper's MNIST users (40 of 980 and of 490 samples) over
about a hundred and a thousand rounds, the deployment example's sigma 8, and sigma 100 (where
Opacus' RDP orders stop short).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedml_perfedavg.core.accounting import prv_epsilon, rdp_epsilon  # noqa: E402

DELTA = 1e-5
HISTORIES = [  # (name, uses, sigma)
    ("paper user (980 samples), ~100 rounds sampled, sigma 1.1", {40 / 980: 300, 40 / 980 * 2: 10}, 1.1),
    ("paper user (490 samples), ~400 rounds sampled, sigma 1.1", {40 / 490: 1200, 80 / 490: 60}, 1.1),
    ("paper user (980 samples), ~2000 rounds sampled, sigma 1.1", {40 / 980: 6000, 80 / 980: 100}, 1.1),
    ("deployment example, sigma 8", {0.05: 300}, 8.0),
    ("sigma 100", {0.08: 400}, 100.0),
    ("the tests' tiny run", {8 / 24: 100}, 1.1),
]

GOOGLE = (
    """
import json, sys
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
out = []
for uses, sigma in json.loads(sys.stdin.read()):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), c)
        for q, c in uses]))
    out.append(accountant.get_epsilon(%r))
print(json.dumps(out))
"""
    % DELTA
)


def google_pld(python: str) -> list:
    request = json.dumps([[list(uses.items()), sigma] for _, uses, sigma in HISTORIES])
    done = subprocess.run([python, "-c", GOOGLE], input=request, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"--google-python {python}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--google-python", help="a python with dp-accounting installed")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    google = google_pld(args.google_python) if args.google_python else [None] * len(HISTORIES)
    rows = []
    for (name, uses, sigma), pld in zip(HISTORIES, google):
        started = time.perf_counter()
        bound = rdp_epsilon(uses, sigma, DELTA)
        rdp_seconds = time.perf_counter() - started
        started = time.perf_counter()
        tight = prv_epsilon(uses, sigma, DELTA)
        prv_seconds = time.perf_counter() - started
        rows.append(
            {
                "history": name,
                "uses": {str(q): c for q, c in uses.items()},
                "sigma": sigma,
                "rdp": bound,
                "prv": tight,
                "google_pld": pld,
                "rdp_seconds": rdp_seconds,
                "prv_seconds": prv_seconds,
            }
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accountants.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "| history | uses | RDP (Opacus) | PRV (Opacus, reported) | PLD (Google) | PRV against RDP | PRV s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        pld = "-" if r["google_pld"] is None else f"{r['google_pld']:.4g}"
        lines.append(
            f"| {r['history']} | {sum(r['uses'].values())} | {r['rdp']:.4g} | {r['prv']:.4g} | {pld} | "
            f"{(r['prv'] / r['rdp'] - 1) * 100:+.1f}% | {r['prv_seconds']:.2f} |"
        )
    (out / "accountants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
