"""A cross-silo run as the plugin's command line starts it (launch-silo: mutual TLS with its own
run CA), attacked while it trains, and a silo frozen mid-run (SIGSTOP)."""

import csv
import json
import os
import pickle
import shutil
import signal
import threading
import time

import grpc
import torch

from fedml_perfedavg.net import wire
from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.run.config import load_yaml, resolve

from tests.helpers import (
    HF_YAML,
    assert_same_bits,
    failure_tail,
    launch_silo,
    launched_threads,
    lost_round_cost,
    needs_mnist,
    raw_send,
    single_process_at,
)

SETTINGS = {"client_num_per_round": 2, "frequency_of_the_test": 1, "show_progress": False, "beta": 0.05}


class WritesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('owned')",))


def _launch(mnist_root, run_dir, settings):
    return launch_silo(run_dir, {**SETTINGS, "data_cache_dir": mnist_root, **settings})


def _wait_for(path, process, text=None, seconds=120):
    deadline = time.monotonic() + seconds
    while not (path.exists() and (text is None or text in path.read_text())):
        assert time.monotonic() < deadline and process.poll() is None, f"never saw {text or path}"
        time.sleep(0.05)


def _attack(run_dir, other, marker, stop, tally):
    """Every outsider's and wrong-certificate attack, at every port, until ``stop``."""
    with open(run_dir / "grpc_ipconfig.csv") as stream:
        addresses = {int(r["rank"]): (r["grpc_server_ip"], int(r["grpc_server_port"])) for r in csv.DictReader(stream)}
    tls = run_dir.parent / "stolen-tls"  # silo 2's key as an insider would keep it (launch-silo removes its copy)
    shutil.copytree(run_dir / "tls", tls)
    payload = pickle.dumps(WritesAFile(marker))
    claim_silo_1 = wire.encode(
        wire.Envelope(
            type=wire.CLIENT_STATUS,
            sender=1,
            receiver=0,
            run_id="?",
            round=0,
            seq=10**9,
            params={"client_status": "FINISHED"},
        )
    )
    finish = wire.encode(
        wire.Envelope(
            type=wire.FINISH, sender=0, receiver=1, run_id="?", round=0, seq=10**9, params={"client_idx": "0"}
        )
    )
    huge = wire.encode(
        wire.Envelope(
            type=wire.UPLOAD,
            sender=2,
            receiver=0,
            run_id="?",
            round=0,
            seq=10**9,
            params={"num_samples": 1},
            model={"w": torch.zeros(2_000_000)},
        )
    )
    while not stop.is_set():
        for rank, address in addresses.items():
            tally.append(("plaintext pickle", raw_send(address, payload, timeout=2)))
            tally.append(
                ("TLS pickle, no certificate", raw_send(address, payload, ca_dir=tls, to_rank=rank, timeout=2))
            )
        tally.append(("silo 2 claims rank 1", raw_send(addresses[0], claim_silo_1, tls, 2, tls, timeout=2)))
        tally.append(("silo 2 sends finish", raw_send(addresses[1], finish, tls, 2, tls, to_rank=1, timeout=2)))
        tally.append(("silo 2 sends a pickle", raw_send(addresses[0], payload, tls, 2, tls, timeout=2)))
        tally.append(("over the cap", raw_send(addresses[0], huge, tls, 2, tls, timeout=2)))
        tally.append(("another CA's rank 1", raw_send(addresses[0], claim_silo_1, other, 1, tls, timeout=2)))
        stop.wait(0.3)


@needs_mnist
def test_attacks_during_a_tls_run_change_nothing(mnist_root, tmp_path):
    run_dir, marker, other = tmp_path / "silo", tmp_path / "owned", tmp_path / "other-ca"
    make_certificates(str(other), 2)
    process = _launch(mnist_root, run_dir, {"comm_round": 12})
    _wait_for(run_dir / "tls" / "rank-2.key", process)
    _wait_for(run_dir / "grpc_ipconfig.csv", process)
    stop, tally = threading.Event(), []
    attacker = threading.Thread(target=_attack, args=(run_dir, other, marker, stop, tally), daemon=True)
    attacker.start()
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        stop.set()
        attacker.join(timeout=30)
    assert process.returncode == 0, failure_tail(out)
    assert not marker.exists()
    # launch-silo never wrote the CA's key (nobody can issue another certificate) and removed the rest
    assert not (tmp_path / "stolen-tls" / "ca.key").exists() and not (run_dir / "tls").exists()
    codes = {}
    for what, code in tally:
        codes.setdefault(what, set()).add(code)
    assert "delivered" not in set().union(*codes.values()), codes
    assert codes["silo 2 claims rank 1"] >= {grpc.StatusCode.PERMISSION_DENIED}, codes
    assert codes["silo 2 sends finish"] >= {grpc.StatusCode.PERMISSION_DENIED}, codes
    assert codes["another CA's rank 1"] == {grpc.StatusCode.UNAVAILABLE}, codes  # refused in the handshake
    assert "claims sender rank 1, but the peer's certificate is rank 2's" in out
    assert "rank 1 refused a message from" in out  # the forged finish, at silo 1
    assert "claims sender rank 0, but the peer's certificate is rank 2's" in out
    assert "(a pickle" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 12 and "lost_silos" not in summary
    config = resolve(
        load_yaml(HF_YAML), {**SETTINGS, "comm_round": 12, "data_cache_dir": mnist_root, "simulation_engine": "fedml"}
    )
    # at the silos' thread count, the same maths in the same order: the same bits (docs/backends.md)
    sp = single_process_at(launched_threads(2), config, tmp_path / "sp")
    assert_same_bits(torch.load(run_dir / "model.pt", weights_only=True), sp.final_state)


@needs_mnist
def test_a_frozen_silo_costs_one_round_its_deadline_and_the_healthy_one_stays(mnist_root, tmp_path):
    run_dir, rounds = tmp_path / "silo", 30
    process = _launch(mnist_root, run_dir, {"comm_round": rounds, "min_clients_per_round": 1})
    _wait_for(run_dir / "run.log", process, "round 2: personalized accuracy")
    frozen = json.loads((run_dir / "silo_processes.json").read_text())["2"]
    os.kill(frozen, signal.SIGSTOP)
    try:
        _wait_for(run_dir / "summary.json", process, '"status": "finished"', seconds=180)
    finally:
        os.kill(frozen, signal.SIGKILL)
    out, _ = process.communicate(timeout=120)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["aggregate_calls"] == rounds
    lost, waited, took = lost_round_cost(summary)
    assert lost["rank"] == 2 and lost["round"] >= 2
    assert waited - 1 < took < waited + 10, (took, waited, lost)
    assert "going on without silo rank(s) [2]" in out


@needs_mnist
def test_in_shared_mode_a_silos_false_figures_are_refused_and_the_mean_is_not_moved(mnist_root, tmp_path):
    """The issue's case: a silo reported user 424242 with every answer right, and the recorded
    mean over silos moved from 0.20 to 0.60. Now the figures are refused and named; the mean is
    the honest silo's."""
    from tests.helpers import finish_all, start_by_hand

    settings = {**SETTINGS, "comm_round": 3, "data_cache_dir": mnist_root}
    outs = finish_all(start_by_hand(tmp_path, settings, 2, liars={2: "false-figures"}))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished", outs[0][-3000:]
    assert summary["refusals"] == {"bad-figures": 4}  # 3 rounds and the final model
    assert "reported round 0, user 424242; it was asked for round 0, user" in outs[0]
    for entry in summary["silo_evaluation"]:
        assert list(entry["silos"]) == ["1"] and entry["mean_accuracy"] == entry["silos"]["1"]["accuracy"] < 1.0
    config = resolve(load_yaml(HF_YAML), {**settings, "simulation_engine": "fedml"})
    sp = single_process_at(1, config, tmp_path / "sp")  # start_by_hand's OMP_NUM_THREADS
    assert_same_bits(torch.load(tmp_path / "run" / "model.pt", weights_only=True), sp.final_state)
