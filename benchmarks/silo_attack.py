"""What a cross-silo TLS run withstands while it trains.

    python benchmarks/silo_attack.py --mnist-root ../shared/datasets [--rounds 200]

Runs ``fedml-perfedavg launch-silo`` (2 silos, mutual TLS, every process limited to 1024 open
files: where FedML's own server died) four times: undisturbed; under the outsiders (from the
moment round 0 starts until the run ends):

- one holding idle TCP connections from 118 loopback addresses (127.0.0.2-119), opening 40 more
  per address every second and keeping whatever the server leaves open;
- one making TLS handshakes without a client certificate from 127.0.0.250, back to back;

and under an insider with silo 2's key sending messages with a 60 KB field, back to back, on one
channel (alone, so that what it measures is the server's refusal rate, not the outsiders' caps);
and under an outsider on the silos' own address (127.0.0.1): idle connections to every rank's port,
300 every 0.1 s, from the moment the port listens, so that it shares the silos' cap per address.

Reports the attackers' rates, what the server refused by reason (summary.json), how much the
server's log grew, a round's time, how long after the server listened every silo was online, and
the largest difference between each run's final model and the undisturbed one's.
Writes ``benchmarks/results/silo_attack.md`` and ``.json``.

``--part liars`` (issue 44): a server and 4 data-owner silos, one of which lies: it shrinks the
model, steps against its data at the fixed bound, claims 2^31 - 1 samples, floods the server with
announcements from a closed port, or has a twin with its key announce itself; the accuracy of each
run against the honest one, what was rejected and lowered per silo, and who was lost. Writes
``benchmarks/results/silo_attack_liars.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
SILO_YAML = os.path.join(REPO, "yaml_configs", "mnist_tau10_alpha0.01_hf_silo.yaml")

from fedml_perfedavg.net.gate import CONNECTION_REASONS  # noqa: E402
from fedml_perfedavg.fedml_bridge.cross_silo import TRAINING_STARTED  # noqa: E402
from tests.backends.test_silo_flood import _addresses, _handshakes, _hold, _listening, _server_address  # noqa: E402


def _insider(address, tls, stop, tally):
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb2
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pb2_grpc

    from fedml_perfedavg.net import wire
    from fedml_perfedavg.net.credentials import rank_name

    junk = wire.encode(
        wire.Envelope(
            type=wire.CLIENT_STATUS,
            sender=2,
            receiver=0,
            run_id="x" * 60_000,
            round=0,
            seq=10**9,
            params={"client_status": "ONLINE"},
        )
    )
    read = lambda name: open(os.path.join(tls, name), "rb").read()  # noqa: E731
    channel = grpc.secure_channel(
        "%s:%d" % address,
        grpc.ssl_channel_credentials(read("ca.pem"), read("rank-2.key"), read("rank-2.pem")),
        options=[("grpc.ssl_target_name_override", rank_name(0))],
    )
    stub = pb2_grpc.gRPCCommManagerStub(channel)
    while not stop.is_set():
        try:
            stub.sendMessage(pb2.CommRequest(client_id=2, message=junk), timeout=5)
            tally["insider_delivered"] += 1
        except grpc.RpcError as err:
            key = "insider_" + err.code().name.lower()
            tally[key] = tally.get(key, 0) + 1
            tally.setdefault("why_" + key, err.details()[:120])
    channel.close()


def one_run(root: str, rounds: int, work: str, attack: str) -> dict:
    run_dir = os.path.join(work, attack)
    sets = {
        "client_num_per_round": 2,
        "comm_round": rounds,
        "frequency_of_the_test": rounds,
        "beta": 0.05,
        "show_progress": False,
        "data_cache_dir": root,
    }
    process = subprocess.Popen(
        [
            "prlimit",
            "--nofile=1024:1024",
            sys.executable,
            "-m",
            "fedml_perfedavg",
            "launch-silo",
            "--cf",
            SILO_YAML,
            "--clients",
            "2",
            "--run-dir",
            run_dir,
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    log = os.path.join(run_dir, "run.log")
    folder = __import__("pathlib").Path(run_dir)

    def wait_for(what, ready):
        while not ready():
            if process.poll() is not None:
                raise SystemExit(f"launch-silo failed with {process.returncode} before {what}; see {log}")
            time.sleep(0.01)

    wait_for("the server listened", lambda: os.path.exists(folder / "grpc_ipconfig.csv"))
    wait_for("the server listened", lambda: _listening(_server_address(folder)))
    listened = time.monotonic()
    tally = {"opened": 0, "most_held": 0, "handshakes": 0, "insider_delivered": 0}
    stop, threads = threading.Event(), []
    if attack == "own-address":  # from the moment each port listens, from the silos' own address
        for address in _addresses(folder):
            threads.append(threading.Thread(target=_hold_own_address, args=(address, stop, tally), daemon=True))
            threads[-1].start()
    wait_for("round 0", lambda: os.path.exists(log) and TRAINING_STARTED in open(log).read())
    silos_online = time.monotonic() - listened
    log_at_start = os.path.getsize(log)
    started = time.monotonic()
    if attack in ("outsiders", "insider"):
        tls = os.path.join(work, f"stolen-{attack}")
        shutil.copytree(os.path.join(run_dir, "tls"), tls)
        address = _server_address(__import__("pathlib").Path(run_dir))
        if attack == "outsiders":
            threads = [
                threading.Thread(target=_hold, args=(address, stop, tally), daemon=True),
                threading.Thread(
                    target=_handshakes, args=(address, os.path.join(tls, "ca.pem"), stop, tally), daemon=True
                ),
            ]
        else:
            threads = [threading.Thread(target=_insider, args=(address, tls, stop, tally), daemon=True)]
        for thread in threads:
            thread.start()
    summary_path = os.path.join(run_dir, "summary.json")
    while process.poll() is None:  # the attack ends with the server's run, not with the launcher's grace period
        try:
            with open(summary_path) as stream:
                if json.load(stream).get("status") != "running":
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    seconds = time.monotonic() - started
    stop.set()
    process.wait()
    for thread in threads:
        thread.join(30)
    with open(os.path.join(run_dir, "summary.json")) as stream:
        summary = json.load(stream)
    history = summary["history"]
    import torch

    return {
        "status": summary["status"],
        "rounds": summary["rounds"],
        "seconds": seconds,
        "ms_per_round": 1000 * (history[-1]["train_seconds"] - history[0]["train_seconds"]) / (rounds - 1),
        "refusals": summary.get("refusals", {}),
        "log_growth_bytes": os.path.getsize(log) - log_at_start,
        "attack": tally,
        "model": torch.load(os.path.join(run_dir, "model.pt"), weights_only=True),
        "lost_silos": summary.get("lost_silos", []),
        "silos_online_seconds": silos_online,
    }


def _hold_own_address(address, stop, tally):
    """Idle connections from 127.0.0.1 (where the silos are), 300 every 0.1 s, from the moment
    ``address`` listens (before that it could take the port itself)."""
    while not (stop.is_set() or _listening(address)):
        time.sleep(0.01)
    _hold(address, stop, tally, sources=[1], per_source=300, period=0.1)


# -- one dishonest silo among four (issue 44) ------------------------------------------------------------
LIARS = {  # scenario -> (rank 4's lie, settings beyond the base)
    "honest": (None, {}),
    "shrink": ("shrink", {}),
    "boundmax": ("boundmax", {}),
    "honest, sample_weighted": (None, {"aggregation": "sample_weighted"}),
    "weight": ("weight", {"aggregation": "sample_weighted"}),
    "flood": ("flood:3", {"min_clients_per_round": 1}),  # the run may go on without the flooding silo
    # 20 rounds take about a second: the twin's announcement needs a longer run to land in one
    "honest, 200 rounds": (None, {"comm_round": 200, "frequency_of_the_test": 200}),
    "twin": (None, {"comm_round": 200, "frequency_of_the_test": 200}),
}


def _twin_announces(run_dir: str, stop: threading.Event, tally: dict) -> None:
    """A second process with silo 4's key announces itself once, as soon as training has started."""
    import grpc

    from fedml_perfedavg.net import wire
    from tests.helpers import raw_send

    log = os.path.join(run_dir, "run", "run.log")
    while not stop.is_set() and not (os.path.exists(log) and TRAINING_STARTED in open(log).read()):
        time.sleep(0.005)  # the rounds take tens of ms: announce within the first ones
    if stop.is_set():
        return
    time.sleep(0.3)  # inside training, not at the instant the seats are taken
    import csv

    with open(os.path.join(run_dir, "ip.csv")) as stream:  # the address file start_by_hand wrote
        row = next(r for r in csv.DictReader(stream) if r["rank"] == "0")
    server = (row["grpc_server_ip"], int(row["grpc_server_port"]))
    envelope = wire.Envelope(wire.CLIENT_STATUS, 4, 0, "by-hand", 0, 0, {"client_status": "ONLINE"}, session="twin")
    tls = os.path.join(run_dir, "tls")
    answer = raw_send(server, wire.encode(envelope), tls, 4, tls)
    tally["twin"] = "refused" if answer == grpc.StatusCode.PERMISSION_DENIED else str(answer)


def liar_run(root: str, rounds: int, work: str, scenario: str) -> dict:
    """Server + 4 data-owner silos started by hand (mutual TLS, loopback), MNIST paper split, HF,
    beta 0.05, 2 silos a round; rank 4 (user 3) lies as ``LIARS[scenario]`` says."""
    from pathlib import Path

    from tests.backends.test_silo_own import OWN, _export
    from tests.helpers import finish_all, start_by_hand

    folder = Path(work) / scenario.replace(", ", "-")
    folder.mkdir()
    lie, extra = LIARS[scenario]
    folders = _export(root, folder, 4)
    settings = {**OWN, "client_num_in_total": 4, "comm_round": rounds, "frequency_of_the_test": rounds, **extra}
    started, stop, tally = time.monotonic(), threading.Event(), {}
    processes = start_by_hand(folder, settings, 4, folders, liars={4: lie} if lie else None)
    twin = None
    if scenario == "twin":
        twin = threading.Thread(target=_twin_announces, args=(str(folder), stop, tally), daemon=True)
        twin.start()
    outs = finish_all(processes, timeout=900)
    stop.set()
    if twin is not None:
        twin.join(30)
    with open(folder / "run" / "summary.json") as stream:
        summary = json.load(stream)
    per_user = summary.get("per_user_accuracy") or []
    honest_users = [a for a in per_user[:3] if a is not None]
    return {
        "status": summary["status"],
        "rounds": summary["rounds"],
        "seconds": time.monotonic() - started,
        "accuracy": summary["personalized_accuracy"],
        "honest_users_accuracy": sum(honest_users) / len(honest_users) if honest_users else None,
        "per_user_accuracy": per_user,
        "rejected_updates": sum(summary.get("rejected_updates", {}).values()),
        "rejected_clients": summary.get("rejected_clients", {}),
        "lowered_counts": summary.get("lowered_counts", {}),
        "lost_silos": summary.get("lost_silos", []),
        "refusals": summary.get("refusals", {}),
        "exit_codes": {rank: p.returncode for rank, p in processes.items()},
        "named": "of its updates rejected so far" in outs[0],
        **tally,
    }


def liars(root: str, rounds: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as work:
        runs = {name: liar_run(root, rounds, work, name) for name in LIARS}
    when = time.strftime("%Y-%m-%d %H:%M")
    honest = runs["honest"]["honest_users_accuracy"]
    lines = [
        "# One dishonest silo among four\n",
        f"`python benchmarks/silo_attack.py --part liars --mnist-root {root} --liar-rounds {rounds}`, {when}: "
        f"server + 4 data-owner silos by hand (mutual TLS), MNIST paper split (4 users), HF, beta 0.05, 2 silos a "
        f"round, {rounds} rounds; rank 4 (user 3) lies. Accuracy is the personalized accuracy of the final "
        f"model; 'honest users' is users 0-2's mean (user 3's figure is the liar's own report).\n",
        "| scenario | status, rounds | accuracy | honest users | against honest | rejected (by silo) | lowered counts "
        "| silos lost | refusals | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        base = {"weight": runs["honest, sample_weighted"], "twin": runs["honest, 200 rounds"]}.get(name, runs["honest"])
        base = r if name.startswith("honest") else base
        mean = r["honest_users_accuracy"]
        diff = (
            ""
            if mean is None or base["honest_users_accuracy"] is None
            else f"{mean - base['honest_users_accuracy']:+.4f}"
        )
        lines.append(
            f"| {name} | {r['status']}, {r['rounds']} | {r['accuracy']:.4f} | "
            f"{'-' if mean is None else f'{mean:.4f}'} | {diff} | {r['rejected_updates']} "
            f"{json.dumps(r['rejected_clients'])} | {json.dumps(r['lowered_counts'])} | "
            f"{json.dumps([(x['rank'], x['why'][:60]) for x in r['lost_silos']])} | {json.dumps(r['refusals'])} | "
            f"{r['seconds']:.0f} |"
        )
    lines.append(
        f"\nThe twin's announcement (silo 4's key, a new process, once training started): {runs['twin'].get('twin')}."
    )
    text = "\n".join(lines) + "\n"
    with open(out + "_liars.md", "w") as stream:
        stream.write(text)
    with open(out + "_liars.json", "w") as stream:
        json.dump({"when": when, "rounds": rounds, "honest_users_accuracy": honest, **runs}, stream, indent=2)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mnist-root", required=True)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--liar-rounds", type=int, default=20)
    parser.add_argument("--part", choices=("transport", "liars", "all"), default="all")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "silo_attack"))
    args = parser.parse_args()
    if args.part in ("liars", "all"):
        liars(os.path.abspath(args.mnist_root), args.liar_rounds, args.out)
    if args.part == "liars":
        return
    with tempfile.TemporaryDirectory() as work:
        runs = {
            name: one_run(os.path.abspath(args.mnist_root), args.rounds, work, name)
            for name in ("undisturbed", "outsiders", "insider", "own-address")
        }
    calm = runs["undisturbed"]
    when = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        "# What a cross-silo TLS run withstands\n",
        f"`python benchmarks/silo_attack.py --mnist-root {args.mnist_root} --rounds {args.rounds}`, {when}: "
        f"launch-silo, 2 silos, mutual TLS, 1024 open files per process; each attack from round 0 to the end.\n",
        "| | undisturbed | outsiders | insider | outsider on the silos' address |",
        "| --- | --- | --- | --- | --- |",
    ]
    row = lambda label, f: lines.append(f"| {label} | " + " | ".join(f(r) for r in runs.values()) + " |")  # noqa: E731
    row("status, rounds", lambda r: f"{r['status']}, {r['rounds']}")
    row("every silo online, s after the server listened", lambda r: f"{r['silos_online_seconds']:.1f}")
    row("rounds lasted, s", lambda r: f"{r['seconds']:.1f}")
    row("ms per round", lambda r: f"{r['ms_per_round']:.1f}")
    row("silos lost", lambda r: str(len(r["lost_silos"])))
    row(
        "server log growth, bytes (per s)",
        lambda r: f"{r['log_growth_bytes']} ({r['log_growth_bytes'] / r['seconds']:.0f})",
    )
    row(
        "largest difference to the undisturbed final model",
        lambda r: f"{max(float((r['model'][k] - calm['model'][k]).abs().max()) for k in calm['model']):.3g}",
    )
    out, ins, own = runs["outsiders"], runs["insider"], runs["own-address"]
    a, i = out["attack"], ins["attack"]
    refused = sum(v for k, v in ins["refusals"].items() if k not in CONNECTION_REASONS)
    lines += [
        "",
        "| attacker | what it did | rate |",
        "| --- | --- | --- |",
        f"| idle connections, 118 addresses | {a['opened']} opened, at most {a['most_held']} open at once on its "
        f"side | {a['opened'] / out['seconds']:.0f} connections/s |",
        f"| handshakes without a certificate | {a['handshakes']} | {a['handshakes'] / out['seconds']:.0f}/s |",
        "| insider (silo 2's key), 60 KB junk messages | "
        f"{json.dumps({k: v for k, v in i.items() if k.startswith('insider')})} "
        f"| {refused / ins['seconds']:.0f} refused/s |",
        "",
        f"| idle connections from the silos' address, every port | {own['attack']['opened']} opened, at most "
        f"{own['attack']['most_held']} open at once on its side | "
        f"{own['attack']['opened'] / (own['seconds'] + own['silos_online_seconds']):.0f} connections/s |",
        "",
        f"Refused by the server, by reason (summary.json): outsiders {json.dumps(out['refusals'], sort_keys=True)}; "
        f"insider {json.dumps(ins['refusals'], sort_keys=True)}; outsider on the silos' address "
        f"{json.dumps(own['refusals'], sort_keys=True)}\n",
    ]
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as stream:
        stream.write(text)
    with open(args.out + ".json", "w") as stream:
        json.dump(
            {
                "when": when,
                "rounds": args.rounds,
                **{name: {k: v for k, v in r.items() if k != "model"} for name, r in runs.items()},
            },
            stream,
            indent=2,
        )
    print(text)


if __name__ == "__main__":
    main()
