"""Cross-silo across hosts: the server and each silo in a network namespace of their own, joined
by veth pairs (198.18.0.0/15, the range set aside for network tests; nothing is routed out of
these namespaces). Mutual TLS across them gives the single-process model; a silo whose
certificate comes from another CA is refused and named; a silo whose packets are dropped
(``pfifo limit 0``; this kernel has no netem) costs one round its deadline, and the run goes on."""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from fedml_perfedavg.fedml_bridge.cross_silo.addresses import write_ipconfig
from fedml_perfedavg.fedml_bridge.cross_silo.credentials import make_certificates
from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import run

from tests.helpers import HF_YAML, REPO, SILO_YAML, lost_round_cost, needs_mnist

SETTINGS = {"client_num_per_round": 2, "frequency_of_the_test": 1, "show_progress": False, "beta": 0.05}
SERVER, SILO1, SILO2 = "198.18.1.1", "198.18.1.2", "198.18.2.2"


def _sh(*command):
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"pfa-probe-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "del", name)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False


needs_netns = pytest.mark.skipif(not _netns_works(), reason="needs root and ip netns")


@pytest.fixture
def hosts():
    """Three namespaces: the server's, linked to silo 1's (198.18.1.0/24) and silo 2's (198.18.2.0/24)."""
    tag = uuid.uuid4().hex[:6]
    names = {rank: f"pfa{rank}-{tag}" for rank in (0, 1, 2)}
    for name in names.values():
        _sh("ip", "netns", "add", name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
    links = {}
    for silo, (net, address) in {1: ("198.18.1", SILO1), 2: ("198.18.2", SILO2)}.items():
        server_end, silo_end = f"s{silo}{tag}", f"c{silo}{tag}"
        _sh("ip", "link", "add", server_end, "type", "veth", "peer", "name", silo_end)
        _sh("ip", "link", "set", server_end, "netns", names[0])
        _sh("ip", "link", "set", silo_end, "netns", names[silo])
        _sh("ip", "-n", names[0], "addr", "add", f"{net}.1/24", "dev", server_end)
        _sh("ip", "-n", names[silo], "addr", "add", f"{address}/24", "dev", silo_end)
        _sh("ip", "-n", names[0], "link", "set", server_end, "up")
        _sh("ip", "-n", names[silo], "link", "set", silo_end, "up")
        links[silo] = silo_end
    # Silo 2 reaches the server's address (on the first link) through the server's end of its own.
    _sh("ip", "-n", names[2], "route", "add", "198.18.1.0/24", "via", "198.18.2.1")
    yield names, links
    for name in names.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _start(names, tmp_path, mnist_root, settings, tls_dirs):
    """The server and both silos, each in its namespace, started as a user would (--rank/--role)."""
    ipconfig = write_ipconfig(str(tmp_path / "ip.csv"), 3, hosts=[SERVER, SILO1, SILO2], ports=[50551, 50552, 50553])
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    processes = {}
    for rank in (0, 1, 2):
        sets = {**SETTINGS, "data_cache_dir": mnist_root, "grpc_ipconfig_path": ipconfig, "tls_dir": tls_dirs[rank],
                **settings}
        command = ["ip", "netns", "exec", names[rank], sys.executable, "-m", "fedml_perfedavg", "--cf", SILO_YAML,
                   "--run-dir", str(tmp_path / "run"), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
                   "--rank", str(rank), "--role", "server" if rank == 0 else "client", "--run_id", "hosts"]
        processes[rank] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=env)
    return processes


def _one_ca(tmp_path):
    """A run CA and every rank's certificate from it: each rank's tls_dir."""
    tls = str(tmp_path / "tls")
    make_certificates(tls, 2)
    return {rank: tls for rank in (0, 1, 2)}


def _finish(processes, timeout=240):
    outs = {}
    try:
        for rank, process in processes.items():
            outs[rank] = process.communicate(timeout=timeout)[0]
    finally:
        for process in processes.values():
            process.kill()
    return outs


@needs_mnist
@needs_netns
def test_tls_across_hosts_gives_the_single_process_model(hosts, tmp_path, mnist_root):
    names, _ = hosts
    outs = _finish(_start(names, tmp_path, mnist_root, {"comm_round": 3}, _one_ca(tmp_path)))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-3000:]
    assert f"gRPC rank 0 listening on {SERVER}:50551" in outs[0]
    assert f"gRPC rank 2 listening on {SILO2}:50553" in outs[2]
    config = resolve(load_yaml(HF_YAML), {**SETTINGS, "comm_round": 3, "data_cache_dir": mnist_root,
                                          "simulation_engine": "fedml"})
    sp = run(config, str(tmp_path / "sp"))
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k, v in sp.final_state.items():
        torch.testing.assert_close(model[k], v, rtol=1e-6, atol=1e-7)


@needs_mnist
@needs_netns
@pytest.mark.parametrize("min_clients", [1, 2])
def test_a_silo_with_a_certificate_from_another_ca_is_refused_and_named(hosts, tmp_path, mnist_root, min_clients):
    names, _ = hosts
    tls, other = str(tmp_path / "tls"), str(tmp_path / "other")
    make_certificates(tls, 2)
    make_certificates(other, 2)
    outs = _finish(_start(names, tmp_path, mnist_root, {"comm_round": 3, "connect_timeout": 8,
                                                       "min_clients_per_round": min_clients},
                          {0: tls, 1: tls, 2: other}))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    [lost] = summary["lost_silos"]
    assert lost["rank"] == 2 and "did not come online within comm_args.connect_timeout=8 s" in lost["why"]
    assert "silo rank(s) [2]" in outs[0] and "did not come online" in outs[0]
    assert "CERTIFICATE_VERIFY_FAILED" in outs[2] or "handshake" in outs[2].lower(), outs[2][-3000:]
    if min_clients == 1:
        assert summary["status"] == "finished" and summary["rounds"] == 3 and summary["aggregate_calls"] == 3
    else:
        assert summary["status"] == "stopped" and "fewer than comm_args.min_clients_per_round=2" in summary["error"]


@needs_mnist
@needs_netns
def test_a_silo_whose_packets_are_dropped_costs_one_round_its_deadline(hosts, tmp_path, mnist_root):
    names, links = hosts
    rounds = 30
    processes = _start(names, tmp_path, mnist_root, {"comm_round": rounds, "min_clients_per_round": 1}, _one_ca(tmp_path))
    log = tmp_path / "run" / "run.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "round 3: personalized accuracy" in log.read_text()):
        assert time.monotonic() < deadline and processes[0].poll() is None
        time.sleep(0.05)
    _sh("ip", "netns", "exec", names[2], "tc", "qdisc", "add", "dev", links[2], "root", "pfifo", "limit", "0")
    outs = _finish({0: processes[0], 1: processes[1]})
    processes[2].kill()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == rounds, outs[0][-3000:]
    lost, waited, took = lost_round_cost(summary)
    assert lost["rank"] == 2 and lost["round"] >= 3
    assert waited - 1 < took < waited + 10, (took, waited, lost)
    assert "going on without silo rank(s) [2]" in outs[0]
