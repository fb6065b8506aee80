"""What data-owner cross-silo costs against shared mode and the single-process run.

    python benchmarks/silo_cost.py --mnist-root ../shared/datasets [--silos 10] [--rounds 30]

Runs ``fedml-perfedavg launch-silo`` (loopback, mutual TLS: what launch-silo sets up) with
``--silos`` silos in data-owner mode (one user per silo: n = silos) and in shared mode (n = 50,
``--silos`` per round), every silo training each round in both, and samples each process's peak
resident memory (VmHWM) while it runs. A round's time is the server's training time between its
first and last evaluation, divided by the rounds between them; the single-process run of each
config (batched engine, the default) is timed the same way. Writes
``benchmarks/results/silo_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
SILO_YAML = os.path.join(REPO, "yaml_configs", "mnist_tau10_alpha0.01_hf_silo.yaml")
HF_YAML = os.path.join(REPO, "yaml_configs", "mnist_tau10_alpha0.01_hf.yaml")


def _peak_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as stream:
            for line in stream:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _ms_per_round(summary: dict) -> float:
    first, last = summary["history"][0], summary["history"][-1]
    return 1000 * (last["train_seconds"] - first["train_seconds"]) / (last["round"] - first["round"])


def settings(mode: str, silos: int, rounds: int, root: str) -> dict:
    users = silos if mode == "own" else 50
    return {
        "silo_data": mode,
        "client_num_in_total": users,
        "client_num_per_round": silos,
        "comm_round": rounds,
        "frequency_of_the_test": rounds,
        "show_progress": False,
        "data_cache_dir": root,
    }


def launched(mode: str, silos: int, rounds: int, root: str, work: str) -> dict:
    run_dir = os.path.join(work, mode)
    sets = [a for k, v in settings(mode, silos, rounds, root).items() for a in ("--set", f"{k}={v}")]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "launch-silo",
            "--cf",
            SILO_YAML,
            "--clients",
            str(silos),
            "--run-dir",
            run_dir,
            *sets,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    peaks: dict = {}
    pids_file = os.path.join(run_dir, "silo_processes.json")
    while process.poll() is None:
        if os.path.exists(pids_file):
            try:
                with open(pids_file) as stream:
                    pids = json.load(stream)
            except ValueError:
                pids = {}
            for rank, pid in pids.items():
                peaks[int(rank)] = max(peaks.get(int(rank), 0), _peak_kib(pid))
        time.sleep(0.2)
    if process.returncode != 0:
        raise SystemExit(f"launch-silo ({mode}) failed with {process.returncode}; see {run_dir}/run.log")
    with open(os.path.join(run_dir, "summary.json")) as stream:
        summary = json.load(stream)
    silo_peaks = [peaks[r] for r in peaks if r > 0]
    return {
        "server_peak_mib": peaks.get(0, 0) / 1024,
        "silo_peak_mib_median": statistics.median(silo_peaks) / 1024,
        "silo_peak_mib_max": max(silo_peaks) / 1024,
        "ms_per_round": _ms_per_round(summary),
        "personalized_accuracy": summary["personalized_accuracy"],
    }


def single_process(mode: str, silos: int, rounds: int, root: str, work: str) -> dict:
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import run

    config = resolve(load_yaml(HF_YAML), {**settings(mode, silos, rounds, root), "silo_data": "shared"})
    result = run(config, os.path.join(work, f"sp-{mode}"))
    return {
        "ms_per_round": _ms_per_round(result.summary),
        "personalized_accuracy": result.summary["personalized_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--silos", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "silo_cost"))
    args = parser.parse_args()
    root = os.path.abspath(args.mnist_root)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for mode in ("own", "shared"):
            results[mode] = {
                "cross_silo": launched(mode, args.silos, args.rounds, root, work),
                "single_process": single_process(mode, args.silos, args.rounds, root, work),
            }
    when = time.strftime("%Y-%m-%d %H:%M")
    rows = [
        "| mode | users | server peak RSS, MiB | silo peak RSS, MiB (median, max) | ms/round cross-silo | "
        "ms/round single process | personalized accuracy (cross-silo = single process) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results.items():
        c, s = r["cross_silo"], r["single_process"]
        users = args.silos if mode == "own" else 50
        rows.append(
            f"| {mode} | {users} | {c['server_peak_mib']:.0f} | {c['silo_peak_mib_median']:.0f}, "
            f"{c['silo_peak_mib_max']:.0f} | {c['ms_per_round']:.1f} | {s['ms_per_round']:.1f} | "
            f"{c['personalized_accuracy']:.4f} = {s['personalized_accuracy']:.4f} |"
        )
    text = (
        f"# Cross-silo cost: data-owner against shared mode\n\n`python benchmarks/silo_cost.py --mnist-root "
        f"{args.mnist_root} --silos {args.silos} --rounds {args.rounds}`, {when}; {args.silos} silos and a "
        f"server on this machine (loopback, mutual TLS, 1 torch thread each), every silo training each of the "
        f"{args.rounds} rounds (HF, paper MNIST split).\n\n" + "\n".join(rows) + "\n"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as stream:
        stream.write(text)
    with open(args.out + ".json", "w") as stream:
        json.dump({"when": when, "silos": args.silos, "rounds": args.rounds, **results}, stream, indent=2)
    print(text)


if __name__ == "__main__":
    main()
