"""Ctrl-C to ``fedml-perfedavg launch-silo``, many times: does every process end cleanly?

    python benchmarks/ctrl_c.py --mnist-root ../shared/datasets [--tries 20] [--load 6]

Each try starts ``launch-silo`` (a server and 2 silos, the silo YAML, 400 rounds), waits for round
1's evaluation, waits a further 0.05 s x the try's number (a different moment of the round each
time) and sends SIGINT to the launcher's process group, as a terminal's Ctrl-C does. A try is clean
when the launcher exits 130, its output holds no Traceback and no ERROR line, no process of the run
is left and ``summary.json`` says ``interrupted``. ``--load N`` runs N busy loops beside the tries
(issue 45 saw 5 of 9 tries end with a process killed at load 6-10) and writes
``benchmarks/results/ctrl_c_load.md`` instead of ``benchmarks/results/ctrl_c.md``. Each try's
seconds from the signal to the launcher's exit are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
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
    signalled = time.monotonic()
    out, _ = process.communicate(timeout=600)
    took = time.monotonic() - signalled
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
    return {"try": number, "clean": not problems, "why": ", ".join(problems), "seconds": round(took, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the tries")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    name = "ctrl_c_load.md" if args.load else "ctrl_c.md"
    out = args.out or os.path.join(REPO, "benchmarks", "results", name)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results = []
    try:
        for number in range(args.tries):
            results.append(one_try(number, args.mnist_root))
            print(results[-1], flush=True)
    finally:
        for loop in busy:
            loop.kill()
    clean = sum(r["clean"] for r in results)
    load = f" --load {args.load}" if args.load else ""
    lines = [
        f"# Ctrl-C to launch-silo ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`python benchmarks/ctrl_c.py --mnist-root ... --tries {args.tries}{load}`: clean {clean} of {args.tries}",
        "",
    ]
    lines += [
        f"- try {r['try']}: {'clean' if r['clean'] else 'NOT clean: ' + r['why']}"
        + (f", {r['seconds']} s from the signal to the launcher's exit" if "seconds" in r else "")
        for r in results
    ]
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"clean {clean} of {args.tries}")
    sys.exit(0 if clean == args.tries else 1)


if __name__ == "__main__":
    main()
