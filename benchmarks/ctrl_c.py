"""Ctrl-C to ``fedml-perfedavg launch-silo``, many times: does every process end cleanly?

    python benchmarks/ctrl_c.py --mnist-root ../shared/datasets [--tries 20]

Each try starts ``launch-silo`` (a server and 2 silos, the silo YAML, 400 rounds), waits for round
1's evaluation, waits a further 0.05 s x the try's number (a different moment of the round each
time) and sends SIGINT to the launcher's process group, as a terminal's Ctrl-C does. A try is clean
when the launcher exits 130, its output holds no Traceback and no ERROR line, no process of the run
is left and ``summary.json`` says ``interrupted``. Writes ``benchmarks/results/ctrl_c.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

from tests.helpers import launch_silo, launched_alive  # noqa: E402


def one_try(number: int, mnist_root: str) -> dict:
    run_dir = Path(tempfile.mkdtemp()) / "run"
    settings = {
        "client_num_per_round": 2,
        "frequency_of_the_test": 1,
        "show_progress": False,
        "data_cache_dir": mnist_root,
        "comm_round": 400,
    }
    process = launch_silo(run_dir, settings)
    log = run_dir / "run.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "round 1: personalized accuracy" in log.read_text()):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            return {"try": number, "clean": False, "why": "round 1 was never evaluated"}
        time.sleep(0.05)
    time.sleep(number * 0.05)
    os.killpg(os.getpgid(process.pid), signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    time.sleep(1)
    status = json.loads((run_dir / "summary.json").read_text())["status"]
    problems = [
        why
        for why, bad in (
            (f"exit {process.returncode}", process.returncode != 130),
            ("a Traceback", "Traceback" in out),
            ("an ERROR line", "ERROR" in out),
            ("processes left", launched_alive(run_dir)),
            (f"summary.json says {status}", status != "interrupted"),
        )
        if bad
    ]
    return {"try": number, "clean": not problems, "why": ", ".join(problems)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "ctrl_c.md"))
    args = parser.parse_args()
    results = []
    for number in range(args.tries):
        results.append(one_try(number, args.mnist_root))
        print(results[-1], flush=True)
    clean = sum(r["clean"] for r in results)
    lines = [
        f"# Ctrl-C to launch-silo ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python benchmarks/ctrl_c.py --mnist-root ... --tries {args.tries}`: clean {clean} of {args.tries}",
        "",
    ]
    lines += [f"- try {r['try']}: {'clean' if r['clean'] else 'NOT clean: ' + r['why']}" for r in results]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"clean {clean} of {args.tries}")
    sys.exit(0 if clean == args.tries else 1)


if __name__ == "__main__":
    main()
