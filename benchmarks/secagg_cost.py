"""What secure aggregation costs (secagg_args.enable_secagg), against plaintext and against Flower.

    python benchmarks/secagg_cost.py --mnist-root ../shared/datasets [--silos 10] [--rounds 5]

1. Deployment: ``fedml-perfedavg launch-silo`` in data-owner mode (loopback, mutual TLS), ``--silos``
   silos, every one sampled each round, with and without secure aggregation, on the paper's MLP and
   on FedML's ``cnn``. Bytes: what each silo sent the server in a secure round (summary.json's
   ``secure_aggregation``) against its plaintext upload (the same model encoded as the transport
   encodes it). Round time: the server's training time between its first and last evaluation,
   divided by the rounds between them (as ``silo_cost.py``).
2. One round in one process, for the same silo count and vector sizes: this plugin's parties
   (fedml_perfedavg/secagg) and Flower's SecAgg+ (``secagg_flower_round.py``, run in a venv of its own,
   ``--flower-python``; made in ``.venv-flwr`` when not given), each stage timed per client.

Writes ``benchmarks/results/secagg_cost.md`` and ``.json``.
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
MODELS = {"mlp": {}, "cnn": {"model": "cnn"}}


def _ms_per_round(summary: dict) -> float:
    first, last = summary["history"][0], summary["history"][-1]
    return 1000 * (last["train_seconds"] - first["train_seconds"]) / (last["round"] - first["round"])


def deployed(model: str, secure: bool, silos: int, rounds: int, root: str, work: str) -> dict:
    run_dir = os.path.join(work, f"{model}-{'secure' if secure else 'plain'}")
    settings = {
        "silo_data": "own",
        "client_num_in_total": silos,
        "client_num_per_round": silos,
        "comm_round": rounds,
        "frequency_of_the_test": 1,
        "show_progress": False,
        "data_cache_dir": root,
        "enable_secagg": secure,
        **MODELS[model],
    }
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    command = [sys.executable, "-m", "fedml_perfedavg", "launch-silo", "--cf", SILO_YAML, "--clients", str(silos)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--run-dir", run_dir, *sets],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    if done.returncode != 0:
        raise SystemExit(f"launch-silo ({model}, secure={secure}) failed with {done.returncode}; see {run_dir}/run.log")
    with open(os.path.join(run_dir, "summary.json")) as stream:
        summary = json.load(stream)
    out = {
        "run_dir": run_dir,
        "ms_per_round": _ms_per_round(summary),
        "personalized_accuracy": summary["personalized_accuracy"],
        "wall_seconds": time.perf_counter() - started,
    }
    if secure:
        per_round = summary["secure_aggregation"]["per_round"]
        out["bytes_per_silo"] = statistics.mean(b for r in per_round for b in r["bytes_per_silo"].values())
        out["fraction_bits"] = per_round[-1]["fraction_bits"]
    return out


def upload_bytes(run_dir: str) -> dict:
    """A silo's plaintext upload of the run's model (its model.pt) and its masked input, as the
    wire encodes them."""
    import torch

    from fedml_perfedavg.net import wire

    state = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    length = sum(v.numel() for v in state.values() if v.is_floating_point())

    def size(kind: int, params: dict, tensors) -> int:
        envelope = wire.Envelope(kind, 1, 0, "a" * 16, 3, 7, params, tensors, reply_to=6, session="b" * 16)
        return len(wire.encode(envelope))

    return {
        "length": length,
        "plain": size(wire.UPLOAD, {"num_samples": 392}, state),
        "masked": size(wire.SECAGG_MASKED, {}, {wire.MASKED_KEY: torch.zeros(length, dtype=torch.int32)}),
    }


def ours_in_process(silos: int, length: int) -> dict:
    """One round of this plugin's parties, every silo sampled, each stage timed per silo."""
    import numpy as np

    from fedml_perfedavg.net.credentials import make_certificates
    from fedml_perfedavg.secagg import fixed_point
    from fedml_perfedavg.secagg.primitives import sign
    from fedml_perfedavg.secagg.rounds import ServerRound, SiloRound, default_threshold

    t = default_threshold(silos)
    ranks = list(range(1, silos + 1))
    with tempfile.TemporaryDirectory() as tls:
        make_certificates(tls, silos)
        read = lambda name: open(os.path.join(tls, name), "rb").read()  # noqa: E731
        keys = {r: (read(f"rank-{r}.pem"), read(f"rank-{r}.key")) for r in ranks}
    parties = {
        r: SiloRound("run", 0, r, t, lambda data, k=keys[r][1]: sign(k, data), keys[r][0], peers=tuple(ranks))
        for r in ranks
    }
    server = ServerRound(0, ranks, t, length, run_id="run")
    seconds = {"advertise": 0.0, "share_keys": 0.0, "masked": 0.0, "consistency": 0.0, "unmask": 0.0}
    generator = np.random.default_rng(0)

    def timed(stage, call):
        start = time.perf_counter()
        value = call()
        seconds[stage] += time.perf_counter() - start
        return value

    for r in ranks:
        server.take_advert(r, timed("advertise", parties[r].advertise))
    adverts = dict(server.adverts)
    for r in ranks:
        server.take_shares(r, timed("share_keys", lambda r=r: parties[r].share(adverts, lambda a: None)))
    for r in ranks:
        update = fixed_point.encode(generator.normal(0, 0.05, length), 1 / silos, 27)
        masked = timed("masked", lambda r=r, u=update: parties[r].masked_input(u, server.shares_for(r)))
        server.take_masked(r, masked)
    survivors = server.close_masked()
    for r in survivors:
        server.take_signature(r, timed("consistency", lambda r=r: parties[r].sign_survivors(survivors)))
    server.close_signatures()
    for r in survivors:
        server.take_unmasking(r, timed("unmask", lambda r=r: parties[r].unmask(survivors, server.signatures)))
    start = time.perf_counter()
    server.total()
    unmask = time.perf_counter() - start
    return {"client_seconds": {k: v / silos for k, v in seconds.items()}, "server_unmask_seconds": unmask}


def flower_python(given: str | None) -> str:
    if given:
        return given
    venv = os.path.join(REPO, ".venv-flwr")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "flwr"], check=True)
    return python


def flower_in_process(python: str, silos: int, length: int) -> dict:
    script = os.path.join(REPO, "benchmarks", "secagg_flower_round.py")
    out = subprocess.run(
        [python, script, "--clients", str(silos), "--length", str(length)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--silos", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--flower-python", help="a Python with flwr installed (default: .venv-flwr, made if missing)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "secagg_cost"))
    args = parser.parse_args()
    import fedml_perfedavg  # noqa: F401  (installs the plugin)

    root = os.path.abspath(args.mnist_root)
    python = flower_python(args.flower_python)
    results: dict = {}
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            plain = deployed(model, False, args.silos, args.rounds, root, work)
            sizes = upload_bytes(plain.pop("run_dir"))
            secure = deployed(model, True, args.silos, args.rounds, root, work)
            secure.pop("run_dir")
            results[model] = {
                "sizes": sizes,
                "plain": plain,
                "secure": secure,
                "ours_in_process": ours_in_process(args.silos, sizes["length"]),
                "flower_in_process": flower_in_process(python, args.silos, sizes["length"]),
            }
    when = time.strftime("%Y-%m-%d %H:%M")
    command = f"python benchmarks/secagg_cost.py --mnist-root DATA --silos {args.silos} --rounds {args.rounds}"
    rows = [
        f"Measured {when} with `{command}` ({args.silos} silos, every one sampled, HF, loopback, mutual TLS).",
        "",
        "| model | parameters | plaintext upload, bytes | secure bytes per silo per round (ratio) | "
        "of which the masked input | ms/round plaintext | ms/round secure (change) | accuracy plaintext / secure |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, r in results.items():
        plain, secure, sizes = r["plain"], r["secure"], r["sizes"]
        rows.append(
            f"| {model} | {sizes['length']:,} | {sizes['plain']:,} | {secure['bytes_per_silo']:,.0f} "
            f"({secure['bytes_per_silo'] / sizes['plain']:.3f}x) | {sizes['masked']:,} | {plain['ms_per_round']:.0f} | "
            f"{secure['ms_per_round']:.0f} ({100 * (secure['ms_per_round'] / plain['ms_per_round'] - 1):+.1f}%) | "
            f"{plain['personalized_accuracy']:.4f} / {secure['personalized_accuracy']:.4f} |"
        )
    rows += [
        "",
        "One round in one process, every party in turn (seconds per client for each stage; the server's unmasking):",
        "",
        "| model | implementation | keys | share keys | masked input | survivor list signed | unmask | server unmask "
        "| bytes per client |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, r in results.items():
        ours, flower = r["ours_in_process"], r["flower_in_process"]
        c, f = ours["client_seconds"], flower["client_seconds"]
        rows.append(
            f"| {model} | fedml-perfedavg | {c['advertise']:.4f} | {c['share_keys']:.4f} | {c['masked']:.4f} | "
            f"{c['consistency']:.4f} | {c['unmask']:.4f} | {ours['server_unmask_seconds']:.3f} | "
            f"{r['secure']['bytes_per_silo']:,.0f} (wire) |"
        )
        rows.append(
            f"| {model} | Flower SecAgg+ | {f['setup']:.4f} | {f['share_keys']:.4f} | {f['masked']:.4f} | "
            f"(none) | {f['unmask']:.4f} | {flower['server_unmask_seconds']:.3f} | "
            f"{flower['bytes_per_client']:,.0f} (values) |"
        )
    with open(args.out + ".json", "w") as stream:
        json.dump({"when": when, "command": command, "results": results}, stream, indent=2)
    with open(args.out + ".md", "w") as stream:
        stream.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
