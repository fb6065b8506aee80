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

from fedml_perfedavg.net.addresses import write_ipconfig
from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import load_split, run

from tests.helpers import (
    HF_YAML,
    LIAR,
    REPO,
    SILO_YAML,
    assert_same_bits,
    finish_all,
    lost_round_cost,
    needs_mnist,
    rank_command,
    single_process_at,
    wait_for_text,
)

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


def _make_hosts(silos: int):
    """A namespace for the server and one per silo; silo k is linked to the server by a veth pair
    on 198.18.k.0/24 (the server's end .1, the silo's .2) and reaches the server's address on the
    first link through its own."""
    tag = uuid.uuid4().hex[:6]
    names = {rank: f"pfa{rank}-{tag}" for rank in range(silos + 1)}
    for name in names.values():
        _sh("ip", "netns", "add", name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
    links = {}
    for silo in range(1, silos + 1):
        server_end, silo_end = f"s{silo}{tag}", f"c{silo}{tag}"
        _sh("ip", "link", "add", server_end, "type", "veth", "peer", "name", silo_end)
        _sh("ip", "link", "set", server_end, "netns", names[0])
        _sh("ip", "link", "set", silo_end, "netns", names[silo])
        _sh("ip", "-n", names[0], "addr", "add", f"198.18.{silo}.1/24", "dev", server_end)
        _sh("ip", "-n", names[silo], "addr", "add", f"198.18.{silo}.2/24", "dev", silo_end)
        _sh("ip", "-n", names[0], "link", "set", server_end, "up")
        _sh("ip", "-n", names[silo], "link", "set", silo_end, "up")
        if silo > 1:
            _sh("ip", "-n", names[silo], "route", "add", "198.18.1.0/24", "via", f"198.18.{silo}.1")
        links[silo] = silo_end
    return names, links


def _remove_hosts(names):
    for name in names.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def hosts():
    """Three namespaces: the server's, linked to silo 1's (198.18.1.0/24) and silo 2's (198.18.2.0/24)."""
    names, links = _make_hosts(2)
    yield names, links
    _remove_hosts(names)


def _start(names, tmp_path, mnist_root, settings, tls_dirs, liars=None):
    """The server and both silos, each in its namespace, started as a user would (--rank/--role);
    ``liars`` {rank: what it lies about} through tests/backends/lying_silo.py."""
    ipconfig = write_ipconfig(str(tmp_path / "ip.csv"), 3, hosts=[SERVER, SILO1, SILO2], ports=[50551, 50552, 50553])
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    processes = {}
    for rank in (0, 1, 2):
        sets = {
            **SETTINGS,
            "data_cache_dir": mnist_root,
            "grpc_ipconfig_path": ipconfig,
            "tls_dir": tls_dirs[rank],
            **settings,
        }
        entry = _entry(names[rank], (liars or {}).get(rank))
        command = rank_command(entry, SILO_YAML, tmp_path / "run", sets, rank, "hosts")
        processes[rank] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    return processes


def _entry(namespace, liar=None):
    """``python -m fedml_perfedavg`` in ``namespace``, or tests/backends/lying_silo.py's ``liar``."""
    program = [str(LIAR), liar] if liar else ["-m", "fedml_perfedavg"]
    return ["ip", "netns", "exec", namespace, sys.executable, *program]


def _one_ca(tmp_path):
    """A run CA and every rank's certificate from it: each rank's tls_dir."""
    tls = str(tmp_path / "tls")
    make_certificates(tls, 2)
    return {rank: tls for rank in (0, 1, 2)}


@needs_mnist
@needs_netns
def test_tls_across_hosts_gives_the_single_process_model(hosts, tmp_path, mnist_root):
    names, _ = hosts
    outs = finish_all(_start(names, tmp_path, mnist_root, {"comm_round": 3}, _one_ca(tmp_path)))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-3000:]
    assert f"gRPC rank 0 listening on {SERVER}:50551" in outs[0]
    assert f"gRPC rank 2 listening on {SILO2}:50553" in outs[2]
    config = resolve(
        load_yaml(HF_YAML), {**SETTINGS, "comm_round": 3, "data_cache_dir": mnist_root, "simulation_engine": "fedml"}
    )
    sp = single_process_at(1, config, tmp_path / "sp")  # each rank's OMP_NUM_THREADS (_start)
    assert_same_bits(torch.load(tmp_path / "run" / "model.pt", weights_only=True), sp.final_state)


@needs_mnist
@needs_netns
@pytest.mark.parametrize("min_clients", [1, 2])
def test_a_silo_with_a_certificate_from_another_ca_is_refused_and_named(hosts, tmp_path, mnist_root, min_clients):
    """Issue 55 item 5: the organization with another run's CA stops within seconds, exit 1, naming
    the CA (it waited connect_timeout and said "did not take a message ... is it gone?", the cause
    only in an INFO line); the server, which cannot tell a wrong CA from noise on its port until
    its deadline, then names what it saw from that silo's address."""
    names, _ = hosts
    tls, other = str(tmp_path / "tls"), str(tmp_path / "other")
    make_certificates(tls, 2)
    make_certificates(other, 2)
    processes = _start(
        names,
        tmp_path,
        mnist_root,
        {"comm_round": 3, "connect_timeout": 15, "min_clients_per_round": min_clients},
        {0: tls, 1: tls, 2: other},
    )
    silo_out = processes[2].communicate(timeout=120)[0]
    outs = finish_all(processes)
    assert processes[2].returncode == 1, silo_out[-3000:]
    assert f"the TLS handshake with rank 0 at {SERVER}:50551 fails: its certificate is not signed by" in silo_out
    # told by the handshake's failure (2 s of it), not by the end of its wait for the server (the
    # words say which; the wall clock of a silo's start on a loaded machine says little)
    assert "another run's CA?" in silo_out and "did not take a message" not in silo_out, silo_out[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    [lost] = summary["lost_silos"]
    assert lost["rank"] == 2 and "did not come online within comm_args.connect_timeout=15 s" in lost["why"]
    assert f"{SILO2} sent: " in lost["why"] and "closed in the TLS handshake" in lost["why"], lost
    assert "silo rank(s) [2]" in outs[0] and "did not come online" in outs[0]
    # and when it happens, in the server's WARNING of the refused handshake, not only at the deadline
    assert f"refused a connection from {SILO2}:" in outs[0] and "(the address file's row of rank 2)" in outs[0]
    if min_clients == 1:
        assert summary["status"] == "finished" and summary["rounds"] == 3 and summary["aggregate_calls"] == 3
    else:
        assert summary["status"] == "stopped" and "fewer than comm_args.min_clients_per_round=2" in summary["error"]


@needs_mnist
@needs_netns
def test_a_silo_whose_packets_are_dropped_costs_one_round_its_deadline(hosts, tmp_path, mnist_root):
    names, links = hosts
    rounds = 30
    processes = _start(
        names, tmp_path, mnist_root, {"comm_round": rounds, "min_clients_per_round": 1}, _one_ca(tmp_path)
    )
    log = tmp_path / "run" / "run.log"
    wait_for_text(log, "round 3: personalized accuracy", lambda: processes[0].poll() is None)
    _sh("ip", "netns", "exec", names[2], "tc", "qdisc", "add", "dev", links[2], "root", "pfifo", "limit", "0")
    outs = finish_all({0: processes[0], 1: processes[1]})
    processes[2].kill()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == rounds, outs[0][-3000:]
    lost, waited, took = lost_round_cost(summary)
    assert lost["rank"] == 2 and lost["round"] >= 3
    assert waited - 1 < took < waited + 10, (took, waited, lost)
    assert "going on without silo rank(s) [2]" in outs[0]


def _own_tls(tmp_path, silos):
    """Each host's tls_dir holds the CA certificate, the run's key roster and its own certificate and key only."""
    everything = tmp_path / "all-tls"
    make_certificates(str(everything), silos)
    dirs = {}
    for rank in range(silos + 1):
        mine = tmp_path / f"tls-{rank}"
        mine.mkdir()
        for name in ("ca.pem", "roster.json", f"rank-{rank}.pem", f"rank-{rank}.key"):
            shutil.copy2(everything / name, mine / name)
        dirs[rank] = str(mine)
    shutil.rmtree(everything)
    return dirs


@needs_mnist
@needs_netns
def test_data_owner_hosts_that_see_only_their_own_folder_give_the_single_process_model(tmp_path, mnist_root):
    """Four organizations, each a host of its own (a network namespace) in a mount namespace where
    the whole dataset and every other organization's folder are hidden under an empty tmpfs, so
    that reading them would fail; the server sees no data at all. Mutual TLS, each host with its
    own key only."""
    from fedml_perfedavg.run.silo_data import export_split

    from tests.helpers import REPO as repo

    silos = 4
    settings = {**SETTINGS, "silo_data": "own", "client_num_in_total": silos, "comm_round": 3}
    config = resolve(load_yaml(HF_YAML), {**settings, "data_cache_dir": mnist_root, "silo_data": "shared"})
    sp = run(config, str(tmp_path / "sp"))
    export = tmp_path / "export"
    export_split(config, str(export), load_split)
    tls = _own_tls(tmp_path, silos)
    addresses = ["198.18.1.1"] + [f"198.18.{k}.2" for k in range(1, silos + 1)]
    ipconfig = write_ipconfig(
        str(tmp_path / "ip.csv"), silos + 1, hosts=addresses, ports=[50561 + r for r in range(silos + 1)]
    )
    names, _ = _make_hosts(silos)
    processes = {}
    try:
        env = {**os.environ, "PYTHONPATH": str(repo), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
        for rank in range(silos + 1):
            private = tmp_path / "private" / f"rank-{rank}"  # where this host's own folder appears, in its namespace
            private.mkdir(parents=True)
            hide = (
                "mount --make-rprivate / && "
                + (f"mount --bind {export / f'rank-{rank}'} {private} && " if rank else "")
                + f'mount -t tmpfs none {export} && mount -t tmpfs none {mnist_root} && exec "$@"'
            )
            sets = {**settings, "data_cache_dir": private, "grpc_ipconfig_path": ipconfig, "tls_dir": tls[rank]}
            entry = ["ip", "netns", "exec", names[rank], "unshare", "-m", "sh", "-c", hide, "sh"]
            entry += [sys.executable, "-m", "fedml_perfedavg"]
            command = rank_command(entry, SILO_YAML, tmp_path / "run", sets, rank, "owners")
            processes[rank] = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        outs = finish_all(processes)
    finally:
        _remove_hosts(names)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    for rank in range(1, silos + 1):
        assert f"silo rank {rank}: user {rank - 1}'s data from {tmp_path / 'private' / f'rank-{rank}'}" in outs[rank]
        assert f"gRPC rank {rank} listening on 198.18.{rank}.2" in outs[rank]
    assert os.listdir(tmp_path / "private" / "rank-1") == []  # outside its namespace the folder was never there
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k, v in sp.final_state.items():
        assert float((model[k] - v).abs().max()) <= 1e-6
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]


@needs_mnist
@needs_netns
def test_a_hidden_dataset_cannot_be_read_in_those_namespaces(tmp_path, mnist_root):
    """The check behind the test above: under the tmpfs the dataset's files are not there."""
    target = os.path.join(mnist_root, "MNIST", "raw", "train-images-idx3-ubyte")
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --make-rprivate / && mount -t tmpfs none {mnist_root} && ls {target}"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "No such file" in out.stderr
    assert os.path.exists(target)


@needs_mnist
@needs_netns
def test_a_silo_cut_off_for_a_while_comes_back_while_the_run_goes_on(hosts, tmp_path, mnist_root):
    """Silo 2's link drops every packet for longer than the round deadline, then recovers: the
    server goes on without it, and once it can reach the server again it announces itself and
    trains again (it used to give up and exit 1)."""
    names, links = hosts
    # evaluated every 10 rounds, not every round: what is checked is who trained, not the figures
    settings = {"comm_round": 150, "min_clients_per_round": 1, "frequency_of_the_test": 10}
    processes = _start(names, tmp_path, mnist_root, settings, _one_ca(tmp_path))
    log = tmp_path / "run" / "run.log"
    wait_for_text(log, "round 10: personalized accuracy", lambda: processes[0].poll() is None)
    _sh("ip", "netns", "exec", names[2], "tc", "qdisc", "add", "dev", links[2], "root", "pfifo", "limit", "0")
    wait_for_text(log, "going on without silo rank(s) [2]", lambda: processes[0].poll() is None, 60)
    time.sleep(2)
    _sh("ip", "netns", "exec", names[2], "tc", "qdisc", "del", "dev", links[2], "root")
    outs = finish_all(processes)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 150, outs[0][-3000:]
    [lost] = summary["lost_silos"]
    [back] = summary["rejoined_silos"]
    assert lost["rank"] == back["rank"] == 2 and lost["round"] <= back["round"] < 149
    assert "announcing itself again" in outs[2] and "the silo is back in the run" in outs[2]
    assert processes[2].returncode == 0 and "is the server gone?" not in outs[2]


def _silo_lines(log: str, rank: int) -> str:
    """The server's WARNING and ERROR lines about silo ``rank``: what a failure message shows."""
    return "\n".join(
        line for line in log.splitlines() if (" WARNING " in line or " ERROR " in line) and f"rank {rank}" in line
    )[-6000:]


def _owners(names, tmp_path, run_dir, settings, silos, tls, resume=False, liars=None):
    """The server and each data owner in its namespace (each owner with its own exported folder),
    as docs/deployment.md starts them; the server with --resume when ``resume``; ``liars`` as
    :func:`_start`'s."""
    addresses = ["198.18.1.1"] + [f"198.18.{k}.2" for k in range(1, silos + 1)]
    ipconfig = write_ipconfig(
        str(tmp_path / "ip.csv"), silos + 1, hosts=addresses, ports=[50581 + r for r in range(silos + 1)]
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    processes = {}
    for rank in range(silos + 1):
        folder = tmp_path / "export" / f"rank-{rank}" if rank else tmp_path / "server-data"
        sets = {**settings, "data_cache_dir": folder, "grpc_ipconfig_path": ipconfig, "tls_dir": tls[rank]}
        entry = _entry(names[rank], (liars or {}).get(rank))
        if resume and rank == 0:  # the run's own config.yaml, as docs/deployment.md resumes it
            command = rank_command(entry, SILO_YAML, run_dir, {}, rank, "pilot-1") + ["--resume", str(run_dir)]
            at = command.index("--cf")
            del command[at : at + 2]
        else:
            command = rank_command(entry, SILO_YAML, run_dir, sets, rank, "pilot-1")
        processes[rank] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    return processes


@needs_mnist
@needs_netns
def test_a_server_stopped_with_ctrl_c_and_resumed_leaves_every_organizations_dp_account_whole(tmp_path, mnist_root):
    """DP-SGD across four data-owner hosts. The server is stopped with Ctrl-C after round 2 (each
    silo is told, records its run as stopped and exits 3), then every organization starts its silo
    again with the same command and the server resumes, as docs/deployment.md says. Each
    organization's epsilon and uses at the end are an uninterrupted run's: its account carried on
    from its progress file, never from zero (on 6b34a60 user 3 ended at 3.59 / 755 against 4.60 / 1177)."""
    import signal

    from fedml_perfedavg.run.silo_data import export_split

    from tests.backends.test_silo_privacy import DP

    silos = 4
    settings = {
        **SETTINGS,
        "silo_data": "own",
        "client_num_in_total": silos,
        "comm_round": 6,
        "checkpoint_every": 1,
        **DP,
    }
    config = resolve(load_yaml(HF_YAML), {**settings, "data_cache_dir": mnist_root, "silo_data": "shared"})
    export_split(config, str(tmp_path / "export"), load_split)
    (tmp_path / "server-data").mkdir()
    tls = _own_tls(tmp_path, silos)
    names, _ = _make_hosts(silos)
    try:
        # each run with accounts of its own: an organization's account spans its runs (issue 75), and
        # the figures compared are one run's
        calm_settings = {**settings, "account_dir": str(tmp_path / "accounts-calm")}
        calm = finish_all(_owners(names, tmp_path, tmp_path / "calm", calm_settings, silos, tls))
        stopped_dir = tmp_path / "stopped"
        settings["account_dir"] = str(tmp_path / "accounts-stopped")
        processes = _owners(names, tmp_path, stopped_dir, settings, silos, tls)
        wait_for_text(stopped_dir / "run.log", "round 2: personalized accuracy", lambda: processes[0].poll() is None)
        processes[0].send_signal(signal.SIGINT)
        first = finish_all(processes)
        codes = {rank: p.returncode for rank, p in processes.items()}
        resumed = finish_all(_owners(names, tmp_path, stopped_dir, settings, silos, tls, resume=True))
    finally:
        _remove_hosts(names)
    assert codes == {0: 130, 1: 3, 2: 3, 3: 3, 4: 3}, (codes, first[0][-3000:])
    for rank in range(1, silos + 1):
        assert "carries on from its earlier process" in resumed[rank], resumed[rank][-3000:]
    summary = json.loads((stopped_dir / "summary.json").read_text())
    uninterrupted = json.loads((tmp_path / "calm" / "summary.json").read_text())
    assert uninterrupted["status"] == "finished", calm[0][-3000:]
    assert summary["status"] == "finished" and summary["rounds"] == 6, resumed[0][-3000:]
    for user, entry in uninterrupted["privacy"]["per_user"].items():
        again = summary["privacy"]["per_user"][user]
        assert again["uses"] == entry["uses"] and again["epsilon"] == pytest.approx(entry["epsilon"], rel=1e-12)
    assert summary["privacy"]["epsilon"] == pytest.approx(uninterrupted["privacy"]["epsilon"], rel=1e-12)
    # the resumed processes carried on the run's entry in each organization's account: one run each
    accounts = sorted((tmp_path / "accounts-stopped").glob("*/account.json"))
    assert len(accounts) == silos and all(len(json.loads(a.read_text())["runs"]) == 1 for a in accounts)


@needs_mnist
@needs_netns
def test_an_organization_stopped_with_ctrl_c_and_started_again_is_back_and_ends_with_its_figures(tmp_path, mnist_root):
    """Issue 55 item 3: Ctrl-C on organization 2's silo, then the same command at once. The stopped
    silo tells the server it leaves (the server gives it up at once, not at a deadline), so the new
    process is taken back when it announces itself, never refused as a second process with the
    silo's key; it ends finished with its own figures up to the last round (on 6b34a60 it was
    refused, never announced itself again and ended 'finished', exit 0, evaluated_round 0)."""
    import signal

    from fedml_perfedavg.run.silo_data import export_split

    silos = 2
    settings = {**SETTINGS, "silo_data": "own", "client_num_in_total": silos, "comm_round": 120}
    # a fixed 30 s deadline: nothing here waits for one (the stopped silo says it leaves); with the
    # adaptive one (5 s here), a fresh-clone run of bf0ab01 on 4 workers had the restarted silo
    # missing from the last evaluation (its cause not kept); this takes the load out of the test.
    # Organization 1 takes 0.2 s a round at least: the 100 rounds after the Ctrl-C last 20 s or
    # more whatever the load, for the new process to start and be taken back (300 unpaced rounds
    # were this test's time budget: 47 s of CPU)
    settings.update({"frequency_of_the_test": 20, "min_clients_per_round": 1})
    settings.update({"round_timeout": 30, "round_timeout_factor": 0})
    config = resolve(load_yaml(HF_YAML), {**settings, "data_cache_dir": mnist_root, "silo_data": "shared"})
    export_split(config, str(tmp_path / "export"), load_split)
    (tmp_path / "server-data").mkdir()
    tls = _own_tls(tmp_path, silos)
    names, _ = _make_hosts(silos)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    try:
        processes = _owners(names, tmp_path, run_dir, settings, silos, tls, liars={1: "pace:0.2"})
        wait_for_text(run_dir / "run.log", "round 20: personalized accuracy", lambda: processes[0].poll() is None)
        processes[2].send_signal(signal.SIGINT)
        stopped_out = processes[2].communicate(timeout=60)[0]
        stopped_code = processes[2].returncode
        processes[2] = subprocess.Popen(
            processes[2].args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        outs = finish_all(processes)
    finally:
        _remove_hosts(names)
    assert stopped_code == 130, stopped_out[-3000:]
    assert "silo rank 2 was stopped: silo rank 2's process was stopped (SIGINT or SIGTERM)" in outs[0], outs[0][-4000:]
    assert "rank 2 is a new process" in outs[0]
    assert "still seats this silo's earlier process" not in outs[2] and "twin-session" not in outs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 120, outs[0][-3000:]
    [back] = summary["rejoined_silos"]
    assert back["rank"] == 2 and back["round"] < 119
    told = (summary["lost_silos"], summary["rejoined_silos"], _silo_lines(outs[0], 2), outs[2][-3000:])
    assert summary["history"][-1]["missing_users"] == [], told
    assert processes[2].returncode == 0, outs[2][-3000:]
    record = json.loads((run_dir / "silo-rank-2" / "summary.json").read_text())
    assert (record["status"], record["user"], record["evaluated_round"]) == ("finished", 1, 119), record
    assert record["personalized_accuracy"] is not None and record["history"][-1]["round"] == 119


def _secure_dp_owners(tmp_path, mnist_root, change=None):
    """Four organizations, three a round, secure aggregation and DP-SGD across hosts: the settings,
    the exported split, each host's TLS folder, the round in which the keyed schedule first
    samples organization 2 after round 0, and each round's keyed sample (ranks)."""
    from fedml_perfedavg.core.sampling import sample_clients
    from fedml_perfedavg.run.silo_data import export_split

    from tests.backends.test_silo_privacy import DP

    silos, rounds = 4, 5
    settings = {
        **SETTINGS,
        "silo_data": "own",
        "client_num_in_total": silos,
        "client_num_per_round": 3,
        "comm_round": rounds,
        "checkpoint_every": 1,
        "enable_secagg": True,
        "round_timeout": 60,
        "round_timeout_factor": 3,
        **DP,
        **(change or {}),
    }
    exported = {**settings, "data_cache_dir": mnist_root, "silo_data": "shared", "enable_secagg": False}
    config = resolve(load_yaml(HF_YAML), exported)
    sampled = {r: [u + 1 for u in sample_clients(config.common.random_seed, r, silos, 3)] for r in range(rounds)}
    first = next(r for r in range(1, rounds) if 2 in sampled[r])
    export_split(config, str(tmp_path / "export"), load_split)
    (tmp_path / "server-data").mkdir()
    return settings, _own_tls(tmp_path, silos), first, sampled


def _accounts(run_dir, summary, ranks):
    """Each organization's own record: finished, and its DP account as the server was last told it
    (uses, and the RDP bound it sent with its last evaluation); its own figure names its accountant."""
    for rank in ranks:
        record = json.loads((run_dir / f"silo-rank-{rank}" / "summary.json").read_text())
        assert record["status"] == "finished", (rank, record)
        told = summary["privacy"]["per_user"][str(rank - 1)]
        assert record["privacy"]["uses"] == told["uses"] == record["history"][-1]["privacy"]["uses"], (rank, record)
        assert record["history"][-1]["privacy"]["epsilon"] == pytest.approx(told["epsilon"], rel=1e-12), rank
        assert record["privacy"]["delta"] == 1e-5 and record["privacy"]["epsilon_from"], record["privacy"]


@needs_mnist
@needs_netns
def test_an_organization_lost_mid_round_or_refused_at_start_costs_a_secure_dp_run_one_round_or_nothing(
    tmp_path, mnist_root
):
    """Issue 76, item 2 (on 085d686: the run stopped at once, server exit 1, the others exit 3).
    Organization 2 SIGKILLed in a round right after its shares: that round is short (2 silos, 3
    needed) and fails, the global model kept; every later round samples organization 4 in its place
    (next in the round's keyed order: secagg_args.reserve_silos) and the run finishes. Organization 2
    started with another beta instead is refused at its announcement, and costs the run nothing:
    every round is summed."""
    settings, tls, killed_in, sampled = _secure_dp_owners(tmp_path, mnist_root)
    names, _ = _make_hosts(4)
    try:
        killed = _owners(
            names, tmp_path, tmp_path / "killed", settings, 4, tls, liars={2: f"vanish:{killed_in}:shares"}
        )
        killed_out = finish_all(killed)
        wrong = _owners(names, tmp_path, tmp_path / "wrong", settings, 4, tls)
        wrong[2].kill()
        wrong[2].wait()
        command = rank_command(
            _entry(names[2]),
            SILO_YAML,
            tmp_path / "wrong",
            {
                **settings,
                "beta": 0.07,
                "data_cache_dir": tmp_path / "export" / "rank-2",
                "grpc_ipconfig_path": str(tmp_path / "ip.csv"),
                "tls_dir": tls[2],
            },
            2,
            "pilot-1",
        )
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
        wrong[2] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        wrong_out = finish_all(wrong)
    finally:
        _remove_hosts(names)
    codes = {rank: p.returncode for rank, p in killed.items()}
    assert codes == {0: 0, 1: 0, 2: -9, 3: 0, 4: 0}, (codes, killed_out[0][-4000:])
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 5, killed_out[0][-4000:]
    secure = summary["secure_aggregation"]
    assert secure["failed_rounds"] == 1 and secure["rounds"] == 4, secure
    [failed] = [r for r in secure["per_round"] if r.get("failed")]
    assert failed["round"] == killed_in and "fewer than the 3 a secure round needs" in failed["failed"], failed
    for record in secure["per_round"]:
        if record["round"] > killed_in:  # organization 2's place, where the keyed sample has it, goes to the next
            assert 2 not in record["sampled"] and len(record["summed"]) == 3, record
            assert (2 in sampled[record["round"]]) == (record["sampled"] != sampled[record["round"]]), record
    assert "silo rank(s) [2] are lost; their places go to silo rank(s)" in killed_out[0], killed_out[0][-4000:]
    assert [entry["rank"] for entry in summary["lost_silos"]] == [2], summary["lost_silos"]
    _accounts(tmp_path / "killed", summary, (1, 3, 4))
    codes = {rank: p.returncode for rank, p in wrong.items()}
    assert codes[0] == 0 and codes[2] != 0 and all(codes[r] == 0 for r in (1, 3, 4)), (codes, wrong_out[2][-3000:])
    assert "train_args.beta" in wrong_out[2], wrong_out[2][-3000:]
    summary = json.loads((tmp_path / "wrong" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["secure_aggregation"]["failed_rounds"] == 0, summary
    assert all(2 not in r["sampled"] and len(r["summed"]) == 3 for r in summary["secure_aggregation"]["per_round"])


@needs_mnist
@needs_netns
def test_an_organization_killed_mid_round_then_the_server_stopped_and_resumed_and_the_secure_dp_run_finishes(
    tmp_path, mnist_root
):
    """Issue 76: organization 2 SIGKILLed in a round right after its shares (that round fails, the
    run goes on), then the server stopped with Ctrl-C; the three remaining organizations start again
    with the same command and the server resumes: the run finishes without organization 2, every
    remaining organization's epsilon what its own record says (on 085d686's parent the run stopped at
    the loss, and after a resume the survivors declined that round for ever: "already unmasked")."""
    import signal

    settings, tls, killed_in, _ = _secure_dp_owners(tmp_path, mnist_root, {"connect_timeout": 15})
    rounds = settings["comm_round"]
    names, _ = _make_hosts(4)
    run_dir = tmp_path / "run"
    try:
        processes = _owners(names, tmp_path, run_dir, settings, 4, tls, liars={2: f"vanish:{killed_in}:shares"})
        wait_for_text(
            run_dir / "run.log", f"round {killed_in}: personalized accuracy", lambda: processes[0].poll() is None
        )
        processes[0].send_signal(signal.SIGINT)
        first = finish_all(processes)
        codes = {rank: p.returncode for rank, p in processes.items()}
        again = _owners(names, tmp_path, run_dir, settings, 4, tls, resume=True)
        again[2].kill()  # organization 2 stays lost
        again[2].wait()
        resumed = finish_all(again)
        resumed_codes = {rank: p.returncode for rank, p in again.items()}
    finally:
        _remove_hosts(names)
    assert codes == {0: 130, 1: 3, 2: -9, 3: 3, 4: 3}, (codes, first[0][-4000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    told = (resumed_codes, resumed[0][-4000:], {r: resumed[r][-1500:] for r in (1, 3, 4)})
    assert summary["status"] == "finished" and summary["rounds"] == rounds, told
    assert all(resumed_codes[r] == 0 for r in (0, 1, 3, 4)), told
    assert "already unmasked" not in "".join(resumed.values())
    secure = summary["secure_aggregation"]
    assert secure["failed_rounds"] == 1 and secure["rounds"] == rounds - 1, secure
    assert "carries on from its earlier process" in resumed[1], resumed[1][-3000:]
    _accounts(run_dir, summary, (1, 3, 4))
