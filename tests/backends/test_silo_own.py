"""Data-owner cross-silo (comm_args.silo_data: own): each silo holds its own user's folder alone,
the server holds no data, and the run gives the single-process model and evaluation. A silo that
disagrees, whose data does not fit, or that lies (huge values, false counts, false figures) is
refused and named, and the model is unharmed; a silo frozen for a while comes back."""

import json
import os
import re
import signal
import time

import pytest
import torch

from fedml_perfedavg.algorithms.base import FederatedAlgorithm
from fedml_perfedavg.core.types import UserSplit, model_inputs
from fedml_perfedavg.data.silo_folder import write_silo_folder
from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import load_split, run
from fedml_perfedavg.run.silo_data import export_split, main as export_main, split_keys

from tests.helpers import (
    HF_YAML,
    drawing_with,
    failure_tail,
    finish_all,
    launch_silo,
    needs_mnist,
    start_by_hand,
)

OWN = {"silo_data": "own", "client_num_per_round": 2, "frequency_of_the_test": 1, "show_progress": False, "beta": 0.05}


def _sp(mnist_root, tmp_path, users, rounds, secrets=None, **extra):
    """The single-process run (FedML's sp loop: client by client, so a test can change one client);
    with ``secrets`` (:func:`silo_draw_secrets`), drawing each user's minibatches as its silo did."""
    config = resolve(
        load_yaml(HF_YAML),
        {
            **OWN,
            "silo_data": "shared",
            "client_num_in_total": users,
            "comm_round": rounds,
            "data_cache_dir": mnist_root,
            "simulation_engine": "fedml",
            **extra,
        },
    )
    if secrets is None:
        return run(config, str(tmp_path / "sp"))
    with drawing_with(secrets):
        return run(config, str(tmp_path / "sp"))


def _export(mnist_root, tmp_path, users):
    config = resolve(
        load_yaml(HF_YAML), {"client_num_in_total": users, "client_num_per_round": 2, "data_cache_dir": mnist_root}
    )
    export_split(config, str(tmp_path / "export"), load_split)
    empty = tmp_path / "server-data"
    empty.mkdir()
    return {
        0: {"data_cache_dir": str(empty)},
        **{r: {"data_cache_dir": str(tmp_path / "export" / f"rank-{r}")} for r in range(1, users + 1)},
    }


def _summary(tmp_path):
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def _assert_same_model(tmp_path, reference, tolerance=1e-6):
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for k, v in reference.items():
        assert float((model[k] - v).abs().max()) <= tolerance, k


@needs_mnist
def test_each_silo_with_only_its_folder_and_a_server_without_data_give_the_single_process_run(mnist_root, tmp_path):
    """The issue's bar: MNIST paper split, 4 users, 2 per round, HF, seed 0."""
    folders = _export(mnist_root, tmp_path, 4)
    assert os.listdir(folders[0]["data_cache_dir"]) == []
    outs = finish_all(start_by_hand(tmp_path, {**OWN, "client_num_in_total": 4, "comm_round": 3}, 4, folders))
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    assert os.listdir(folders[0]["data_cache_dir"]) == []
    assert "the server does not read" not in outs[0]  # it was handed no clients at all
    for rank in range(1, 5):
        assert f"silo rank {rank}: user {rank - 1}'s data from {folders[rank]['data_cache_dir']}" in outs[rank]
    sp = _sp(mnist_root, tmp_path, 4, 3)
    _assert_same_model(tmp_path, sp.final_state)
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]
    assert [h["personalized_accuracy"] for h in summary["history"]] == [
        h["personalized_accuracy"] for h in sp.summary["history"]
    ]
    assert all(h["evaluated_users"] == 4 and h["missing_users"] == [] for h in summary["history"])
    for rank in range(1, 5):  # each organization keeps its own record and models
        _assert_silo_record(tmp_path / "run" / f"silo-rank-{rank}", rank, folders[rank]["data_cache_dir"], sp)
    # Organization 2 started again in the same folder: refused at start (exit 2), naming its
    # record, which stays byte for byte (it used to wait for a server and write `stopped` over it).
    import subprocess
    import sys

    from tests.helpers import REPO, SILO_YAML, make_tls, rank_command

    own = tmp_path / "run" / "silo-rank-2"
    files = {p: p.read_bytes() for p in own.rglob("*") if p.is_file()}
    sets = {**OWN, "client_num_in_total": 4, "comm_round": 3, "grpc_ipconfig_path": tmp_path / "ip.csv"}
    sets.update({"tls_dir": make_tls(tmp_path / "tls", 4), **folders[2]})
    command = rank_command([sys.executable, "-m", "fedml_perfedavg"], SILO_YAML, tmp_path / "run", sets, 2, "by-hand")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{own / 'summary.json'}: this organization's record of a run that finished" in again.stderr
    assert {p: p.read_bytes() for p in own.rglob("*") if p.is_file()} == files


def _assert_silo_record(own, rank, folder, sp, rounds=3):
    """Silo ``rank``'s record: its user's accuracy as sp measured it, the final global model, and
    the personalized model whose test accuracy is the one reported."""
    from fedml_perfedavg.core.functional import logits_of
    from fedml_perfedavg.data.silo_folder import read_silo_folder

    record = json.loads((own / "summary.json").read_text())
    assert (record["status"], record["user"], record["evaluated_round"]) == ("finished", rank - 1, rounds - 1)
    assert record["personalized_accuracy"] == sp.summary["per_user_accuracy"][rank - 1]
    assert [h["round"] for h in record["history"]] == list(range(rounds))
    final = torch.load(own / "model.pt", weights_only=True)
    assert all(float((final[k] - v).abs().max()) <= 1e-6 for k, v in sp.final_state.items())
    personalized = torch.load(own / "personalized.pt", weights_only=True)
    assert any(not torch.equal(personalized[k], final[k]) for k in final)  # adapted
    user = read_silo_folder(folder).user
    with torch.no_grad():
        correct = (
            logits_of(sp.algorithm.network, personalized, model_inputs(user.test_x)).argmax(1) == user.test_y
        ).sum()
    assert abs(int(correct) / len(user.test_y) - record["personalized_accuracy"]) < 1e-6


@needs_mnist
def test_launch_silo_hands_each_silo_its_own_folder(mnist_root, tmp_path):
    process = launch_silo(
        tmp_path / "run",
        {**OWN, "client_num_in_total": 4, "comm_round": 2, "data_cache_dir": mnist_root},
        ["--clients", "4"],
    )
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, failure_tail(out)
    run_dir = tmp_path / "run"
    for rank in range(1, 5):
        assert f"user {rank - 1}'s data from {run_dir / 'silo-data' / f'rank-{rank}'}" in out
    assert _summary(tmp_path)["history"][-1]["evaluated_users"] == 4


@needs_mnist
def test_a_silo_that_disagrees_is_refused_at_once_naming_the_key_and_both_values(mnist_root, tmp_path):
    folders = _export(mnist_root, tmp_path, 2)
    folders[2]["alpha"] = 0.05
    started = time.monotonic()
    outs = finish_all(start_by_hand(tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": 3}, 2, folders))
    said = "silo rank 2 disagrees with the server on train_args.alpha: the server has 0.01, the silo has 0.05"
    assert said in outs[0] and f"refused by the server: {said}" in outs[2]
    summary = _summary(tmp_path)
    assert summary["status"] == "stopped" and said in summary["error"], summary
    assert summary["refusals"] == {"disagreement": 1}
    assert time.monotonic() - started < 50  # at once, not after connect_timeout (60 s)
    assert "Traceback" not in outs[0] + outs[2]


@needs_mnist
def test_an_organization_whose_address_file_gives_another_port_is_refused_at_once_on_both_sides(mnist_root, tmp_path):
    """Issue 55 item 5: organization 2's copy of the address file gives it another port. The server
    cannot reach it there, so the refusal comes in the answer to its announcement: it stops at
    once naming both rows, and the server names the same (on 6b34a60 the server said "nothing
    listens there: it has ended" and the organization hung)."""
    from fedml_perfedavg.net.addresses import free_ports, read_ipconfig, write_ipconfig

    folders = _export(mnist_root, tmp_path, 2)
    ports = free_ports(4)
    write_ipconfig(str(tmp_path / "ip.csv"), 3, ports=ports[:3])
    write_ipconfig(str(tmp_path / "ip-org2.csv"), 3, ports=[ports[0], ports[1], ports[3]])
    assert read_ipconfig(str(tmp_path / "ip-org2.csv"))[2] != read_ipconfig(str(tmp_path / "ip.csv"))[2]
    folders[2]["grpc_ipconfig_path"] = str(tmp_path / "ip-org2.csv")
    started = time.monotonic()
    outs = finish_all(start_by_hand(tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": 3}, 2, folders))
    took = time.monotonic() - started
    said = (
        f"silo rank 2's address file (comm_args.grpc_ipconfig_path) differs from the server's: rank 2 is "
        f"'127.0.0.1:{ports[3]}' there and 127.0.0.1:{ports[2]} here"
    )
    assert f"refused by the server: {said}" in outs[2], outs[2][-3000:]
    assert said in outs[0], outs[0][-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "stopped" and said in summary["error"], summary
    assert summary["refusals"] == {"disagreement": 1}
    assert took < 50  # at once, not after connect_timeout (60 s)
    assert "Traceback" not in outs[0] + outs[2]


@needs_mnist
def test_a_run_whose_round_would_sample_only_refused_organizations_is_stopped_at_start(mnist_root, tmp_path):
    """Issue 55 item 8: organizations 3 and 4 cannot take part (their data does not fit the model;
    a spent DP budget is refused the same way) and the keyed schedule samples exactly them in
    round 2 of 3. The server stops the run before round 0, naming round 2 and the silos, and every
    organization is told; it ran rounds 0 and 1 and stopped in round 2 before. Then organizations 3
    and 4 set their data right and everybody starts the same commands again: nothing the stopped
    start left in the run folders trips the retry (issue 55 item 7), and it finishes."""
    folders = _export(mnist_root, tmp_path, 4)
    own = {rank: dict(folders[rank]) for rank in (3, 4)}
    config = resolve(
        load_yaml(HF_YAML), {"client_num_in_total": 4, "client_num_per_round": 2, "data_cache_dir": mnist_root}
    )
    for rank in (3, 4):
        wrong = tmp_path / f"rgb-{rank}"
        x, y = torch.rand(40, 3, 32, 32), torch.arange(40) % 5
        write_silo_folder(str(wrong), UserSplit(x, y, x[:10], y[:10]), rank, "mnist", 10, split_keys(config))
        folders[rank]["data_cache_dir"] = str(wrong)
    settings = {**OWN, "client_num_in_total": 4, "comm_round": 3, "min_clients_per_round": 1}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders))
    summary = _summary(tmp_path)
    assert summary["status"] == "stopped" and summary["rounds"] == 0, outs[0][-4000:]
    said = "the keyed schedule samples silo rank(s) [3, 4] for round 2, of which 0 can take part ([]), fewer than"
    assert "silo rank(s) [3, 4] were refused at start" in summary["error"] and said in summary["error"]
    for rank in (1, 2):
        assert said in outs[rank], outs[rank][-3000:]  # told why the run stopped
    assert "round 0: personalized accuracy" not in outs[0]
    folders.update(own)
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders))
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    assert "replacing the record of a start that failed" in outs[0]
    for rank in (1, 2, 3, 4):
        record = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        assert record["status"] == "finished", (rank, outs[rank][-3000:])


@needs_mnist
def test_a_silo_still_starting_when_the_server_stops_the_run_is_told(mnist_root, tmp_path):
    """A closed port means "ended" only for a silo that was heard from: one that starts listening
    after the server stopped the run (here 1 s after) still hears why, not after connect_timeout."""
    folders = _export(mnist_root, tmp_path, 2)
    folders[2]["alpha"] = 0.05
    started = time.monotonic()
    late = {1: f"late:{tmp_path / 'run' / 'run.log'}"}
    outs = finish_all(
        start_by_hand(tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": 3}, 2, folders, liars=late)
    )
    assert "the server stopped the run: round 0: silo rank(s) [2] refused" in outs[1], outs[1][-3000:]
    assert "was not told" not in outs[0], outs[0][-3000:]
    assert time.monotonic() - started < 50  # not after connect_timeout (60 s)


@needs_mnist
def test_a_silo_whose_data_does_not_fit_the_model_is_refused_naming_it(mnist_root, tmp_path):
    folders = _export(mnist_root, tmp_path, 2)
    config = resolve(
        load_yaml(HF_YAML), {"client_num_in_total": 2, "client_num_per_round": 2, "data_cache_dir": mnist_root}
    )
    wrong = tmp_path / "rgb"
    x, y = torch.rand(40, 3, 32, 32), torch.arange(40) % 5
    write_silo_folder(str(wrong), UserSplit(x, y, x[:10], y[:10]), 2, "mnist", 10, split_keys(config))
    folders[2]["data_cache_dir"] = str(wrong)
    outs = finish_all(
        start_by_hand(
            tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": 2, "min_clients_per_round": 1}, 2, folders
        )
    )
    # the silo's own probe finds it and announces it; the server refuses the silo at once, naming it
    said = (
        "silo rank 2 cannot train on its own data: the model (MLP; model_args.model='mlp') does not fit "
        "data_args.dataset='mnist': it cannot compute a loss and its gradient on a batch of 40 samples of shape "
        "(3, 32, 32)"
    )
    assert said in outs[0] and said in outs[2]
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["lost_silos"][0]["rank"] == 2  # min_clients 1: goes on
    assert "refused" in summary["lost_silos"][0]["why"] and summary["refusals"] == {"disagreement": 1}
    assert all(h["missing_users"] == [1] for h in summary["history"])
    assert summary["per_user_accuracy"][1] is None and summary["per_user_accuracy"][0] is not None


def _client_one_lies_in_sp(monkeypatch, rounds):
    """In the single-process run, user 1's update is replaced by one the bound refuses in
    ``rounds``: the model the cross-silo run must reach when silo 2's update is refused there."""
    honest = FederatedAlgorithm.client_update

    def client_update(self, round_idx, client_id, global_state, x, y):
        update = honest(self, round_idx, client_id, global_state, x, y)
        if client_id == 1 and round_idx in rounds:
            return type(update)(update.num_samples, {k: torch.full_like(v, 1e30) for k, v in update.state.items()})
        return update

    monkeypatch.setattr(FederatedAlgorithm, "client_update", client_update)


@needs_mnist
@pytest.mark.parametrize("lie,settings", [("huge-once", {}), ("false-count", {"aggregation": "sample_weighted"})])
def test_a_silo_with_a_valid_certificate_that_lies_about_its_update_is_refused(
    mnist_root, tmp_path, monkeypatch, lie, settings
):
    folders = _export(mnist_root, tmp_path, 2)
    rounds = 4
    outs = finish_all(
        start_by_hand(
            tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": rounds, **settings}, 2, folders, liars={2: lie}
        )
    )
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == rounds, outs[0][-4000:]
    if lie == "huge-once":
        assert summary["rejected_updates"] == {"1": 1}
        assert re.search(
            r"round 1: rejected silo rank 2: update norm 2\.6\d*e\+32 exceeds train_args\."
            r"max_update_ratio=1\.0 x max\(\|\|w\|\|, 1\) = \d",
            outs[0],
        ), outs[0][-3000:]
        refused_rounds = {1}
    else:
        assert summary["rejected_updates"] == {str(r): 1 for r in range(rounds)}
        assert summary["refusals"]["sample-count"] == rounds
        assert "silo rank 2 sent num_samples=490000 for user 1, who has 490 training samples" in outs[0]
        refused_rounds = set(range(rounds))
    _client_one_lies_in_sp(monkeypatch, refused_rounds)
    sp = _sp(mnist_root, tmp_path, 2, rounds, **settings)
    _assert_same_model(tmp_path, sp.final_state)
    assert summary["personalized_accuracy"] == sp.summary["personalized_accuracy"]


@needs_mnist
def test_a_silo_that_reports_false_figures_is_refused_and_its_user_listed_missing(mnist_root, tmp_path):
    folders = _export(mnist_root, tmp_path, 2)
    outs = finish_all(
        start_by_hand(
            tmp_path, {**OWN, "client_num_in_total": 2, "comm_round": 3}, 2, folders, liars={2: "false-figures"}
        )
    )
    summary = _summary(tmp_path)
    assert summary["status"] == "finished", outs[0][-4000:]
    assert summary["refusals"] == {"bad-figures": 3}
    assert "silo rank 2 reported round 0, user 424242; it was asked for round 0, user 1" in outs[0]
    assert all(h["missing_users"] == [1] and h["evaluated_users"] == 1 for h in summary["history"])
    assert summary["per_user_accuracy"][1] is None
    assert summary["personalized_accuracy"] == summary["per_user_accuracy"][0] < 1.0
    sp = _sp(mnist_root, tmp_path, 2, 3)
    _assert_same_model(tmp_path, sp.final_state)  # its training was honest: the model is the sp model
    assert summary["per_user_accuracy"][0] == sp.summary["per_user_accuracy"][0]


@needs_mnist
def test_a_silo_frozen_for_a_while_is_missing_then_comes_back(mnist_root, tmp_path):
    """Organization 1 takes 0.2 s a round at least: the 130 rounds after the freeze last 26 s or
    more whatever the load, for silo 2 to be given up on, woken and taken back (300 unpaced rounds
    were this test's time budget: 45 s of CPU)."""
    folders = _export(mnist_root, tmp_path, 2)
    processes = start_by_hand(
        tmp_path,
        {**OWN, "client_num_in_total": 2, "comm_round": 150, "frequency_of_the_test": 5, "min_clients_per_round": 1},
        2,
        folders,
        liars={1: "pace:0.2"},
    )
    log = tmp_path / "run" / "run.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "round 20: personalized accuracy" in log.read_text()):
        assert time.monotonic() < deadline and processes[0].poll() is None
        time.sleep(0.05)
    os.kill(processes[2].pid, signal.SIGSTOP)
    while "going on without silo rank(s) [2]" not in log.read_text():
        assert time.monotonic() < deadline + 60 and processes[0].poll() is None
        time.sleep(0.05)
    # frozen 3 s at least, and until an evaluation has fallen while it is out: counted in rounds,
    # not seconds, since a loaded machine's rounds are slower than the pace (a fixed 3 s once saw
    # no evaluation fall: d0071c0)
    given_up = time.monotonic()
    while time.monotonic() < given_up + 3 or not any(
        h["missing_users"] == [1] for h in _summary(tmp_path).get("history", [])
    ):
        assert time.monotonic() < deadline + 120 and processes[0].poll() is None
        time.sleep(0.1)
    os.kill(processes[2].pid, signal.SIGCONT)  # it sees it was not running (or the server's silence): it announces
    outs = finish_all(processes)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 150, outs[0][-4000:]
    [lost] = summary["lost_silos"]
    [back] = summary["rejoined_silos"]
    assert lost["rank"] == back["rank"] == 2 and lost["round"] <= back["round"] < 149
    missing = [h["round"] for h in summary["history"] if h["missing_users"] == [1]]
    assert missing and all(lost["round"] <= r <= back["round"] for r in missing)
    assert summary["history"][-1]["missing_users"] == [] and summary["per_user_accuracy"][1] is not None
    # frozen while it waited, it sees the gap in its own clock; while it trained, it sends its late
    # update and the server tells it that it was given up on; while it sent, the server's silence
    assert any(
        why in outs[2]
        for why in ("this silo was not running for", "the server gave up on this silo", "nothing from the server for")
    )
    assert "announcing itself again" in outs[2]
    assert "the server answered; the silo is back in the run" in outs[2]
    assert processes[2].returncode == 0


@needs_mnist
def test_an_algorithm_with_server_state_beside_the_model_gives_the_single_process_run(mnist_root, tmp_path):
    """FedAvgARUBA's learned rates (and each silo's squared gradients) cross the wire in the global
    state beside the model, never registered on it: the silos' run gives sp's model and rates."""
    folders = _export(mnist_root, tmp_path, 2)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 3, "federated_optimizer": "FedAvgARUBA"}
    outs = finish_all(start_by_hand(tmp_path, settings, 2, folders))
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    sp = _sp(mnist_root, tmp_path, 2, 3, federated_optimizer="FedAvgARUBA")
    assert any(k.startswith("aruba_lr__") for k in sp.final_state)
    _assert_same_model(tmp_path, sp.final_state)
    rates = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert float(rates["aruba_tasks"]) == 6.0  # 2 silos' tasks a round for 3 rounds
    for k in (k for k in rates if k.startswith(("aruba_lr__", "aruba_b__", "aruba_g__"))):  # to each one's scale
        scale = float(sp.final_state[k].abs().max())
        torch.testing.assert_close(rates[k], sp.final_state[k], rtol=1e-5, atol=1e-6 * scale)
        assert not torch.equal(rates[k], torch.full_like(rates[k], float(rates[k].flatten()[0]))), k  # learned


@needs_mnist
def test_a_killed_silo_started_again_carries_on_with_its_record_and_dp_account(mnist_root, tmp_path):
    """SIGKILL, then the same command: the silo's record keeps the evaluations from before, and its
    DP-SGD account counts every use of its user's data, before the kill as well (a fresh account
    would report a smaller epsilon than the data gave)."""
    import subprocess

    from tests.helpers import REPO

    folders = _export(mnist_root, tmp_path, 2)
    dp = {"dp_args.enable_dp": True, "dp_args.dp_solution_type": "dpsgd", "dp_args.noise_multiplier": 1.1}
    dp.update({"dp_args.max_grad_norm": 1.0, "dp_args.delta": 1e-5})
    # round_timeout short: the server gives up on the killed process's seat after at most 10 s
    # (the adaptive deadline, 3 x the median of the recent rounds but 5 s at least, usually less), and the new
    # process, refused while the seat is held, announces itself again every 5 s. 2 s, then 4 s,
    # were too short on a loaded machine: both silos missed a round's deadline. Organization 1
    # takes 0.25 s a round at least, so the 160 rounds after the kill last 40 s or more, whatever
    # the load, for the new process to start and be taken back (800 unpaced rounds were 174 s of
    # a fresh-clone run and, on a loaded machine, over the 240 s the test waits)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 200, "min_clients_per_round": 1, **dp}
    # connect_timeout 30: at load 8 (a profiled suite beside other tests) both silos once took over
    # 10 s to come up, and the server, done waiting, ended the run before round 0
    settings.update({"round_timeout": 10, "connect_timeout": 30})
    processes = start_by_hand(tmp_path, {**settings, "frequency_of_the_test": 20}, 2, folders, liars={1: "pace:0.25"})
    log, progress = tmp_path / "run" / "run.log", tmp_path / "run" / "silo-rank-2" / "progress.pt"
    deadline = time.monotonic() + 180
    while not (log.exists() and "round 40: personalized accuracy" in log.read_text()):
        running = time.monotonic() < deadline and processes[0].poll() is None
        assert running, log.read_text()[-4000:] if log.exists() else "no run.log"
        time.sleep(0.05)
    os.kill(processes[2].pid, signal.SIGKILL)
    processes[2].wait()
    before = torch.load(progress, weights_only=True)
    uses_before = before["evaluations"][-1]["privacy"]["uses"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    processes[2] = subprocess.Popen(
        processes[2].args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    outs = finish_all(processes)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 200, outs[0][-4000:]
    assert "silo rank 2: carries on from its earlier process" in outs[2] and "its DP-SGD account" in outs[2], outs[2]
    record = json.loads((tmp_path / "run" / "silo-rank-2" / "summary.json").read_text())
    assert [h["round"] for h in record["history"][: len(before["evaluations"])]] == [
        e["round"] for e in before["evaluations"]
    ]
    assert record["history"][-1]["round"] == 199, outs[2][-3000:]
    # its first evaluation after the restart counts on from its account before the kill, not from zero
    after = record["history"][len(before["evaluations"])]
    assert after["round"] > before["evaluations"][-1]["round"] and after["privacy"]["uses"] > uses_before
    assert record["privacy"]["uses"] > after["privacy"]["uses"]
    assert progress.exists()  # the run is over; its account stays (a rerun of this run carries on from it)


@needs_mnist
def test_a_silo_given_up_on_that_sends_a_late_update_is_told_and_comes_back_at_once(mnist_root, tmp_path):
    """Its late update shows it does not know it is out: the server says so, and the silo announces
    itself at once rather than after the server's silence. Organization 1 takes 0.2 s a round at
    least: the 96 rounds after silo 2's stall last 19 s or more, whatever the load (300 unpaced
    rounds were this test's time budget: 108 s of a fresh-clone run). A fixed 5 s deadline, which
    the 12 s stall passes whatever the load (the adaptive one, then 10 x the slowest round, grew to
    10.5 s in a fresh-clone run and nobody was given up on)."""
    folders = _export(mnist_root, tmp_path, 2)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 100, "frequency_of_the_test": 50}
    settings.update({"round_timeout": 5, "round_timeout_factor": 0})
    liars = {1: "pace:0.2", 2: "slow:3:12"}
    outs = finish_all(start_by_hand(tmp_path, {**settings, "min_clients_per_round": 1}, 2, folders, liars=liars))
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 100, outs[0][-4000:]
    assert [(s["rank"], s["round"]) for s in summary["lost_silos"]] == [(2, 3)]
    [back] = summary["rejoined_silos"]
    assert back["rank"] == 2 and back["round"] < 99
    assert "silo rank 2 was given up on and still sends work; it is told to announce itself" in outs[0]
    assert "silo rank 2: the server gave up on this silo" in outs[2]
    assert "nothing from the server for" not in outs[2]
    assert summary["history"][-1]["missing_users"] == []


@needs_mnist
def test_a_silo_given_up_on_in_the_last_round_is_told_that_the_run_is_over(mnist_root, tmp_path):
    """Given up on in the last round, it would otherwise send its update to a server that has
    ended and stop after connect_timeout, failing; told, it ends with the run."""
    folders = _export(mnist_root, tmp_path, 2)
    started = time.monotonic()
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 3, "min_clients_per_round": 1}
    # a fixed 6 s deadline, which the silo's 12 s stall passes whatever the load (the adaptive
    # one grew past a 10 s stall beside two busy loops, and nobody was given up on)
    settings.update({"round_timeout": 6, "round_timeout_factor": 0})
    processes = start_by_hand(tmp_path, settings, 2, folders, liars={2: "slow:2:12"})
    outs = finish_all(processes)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    assert [(s["rank"], s["round"]) for s in summary["lost_silos"]] == [(2, 2)]
    assert "silo rank 2: the server ended the run" in outs[2], outs[2][-3000:]
    assert "was not told" not in outs[0]
    assert [p.returncode for p in processes.values()] == [0, 0, 0]
    assert time.monotonic() - started < 50  # not after connect_timeout (60 s)


@needs_mnist
def test_export_split_refuses_what_it_cannot_do(mnist_root, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    base = [
        "--cf",
        HF_YAML,
        "--set",
        f"data_cache_dir={mnist_root}",
        "--set",
        "client_num_in_total=4",
        "--set",
        "client_num_per_round=2",
    ]
    assert export_main([*base, "--out", str(tmp_path / "full")]) == 2
    assert f"--out {str(tmp_path / 'full')!r}: not empty" in capsys.readouterr().err
    assert export_main([*base, "--out", str(tmp_path / "x"), "--set", "partition_method=hetero"]) == 2
    assert "export-split cuts the paper's split" in capsys.readouterr().err
    assert export_main([*base, "--out", str(tmp_path / "ok")]) == 0
    assert sorted(os.listdir(tmp_path / "ok")) == ["rank-1", "rank-2", "rank-3", "rank-4"]


@needs_mnist
def test_fedmls_own_main_script_runs_data_owner_silos(mnist_root, tmp_path):
    """FedML's step-by-step main with the one import: each process its own YAML, as on its own host."""
    import subprocess
    import sys

    from tests.helpers import EXAMPLE, REPO, example_yaml

    folders = _export(mnist_root, tmp_path, 2)
    (tmp_path / "ip.csv").write_text(
        "eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(f"{r},{r},127.0.0.1,{19470 + r}\n" for r in range(3))
    )
    processes = []
    for rank in range(3):
        path = example_yaml(
            tmp_path,
            "fedml_config_silo.yaml",
            mnist_root,
            "own",
            tmp_path / "runs",
            silo_data="own",
            client_num_in_total=2,
            grpc_ipconfig_path=str(tmp_path / "ip.csv"),
            data_cache_dir=folders[rank]["data_cache_dir"],
        )
        os.rename(path, tmp_path / f"rank{rank}.yaml")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(EXAMPLE / "torch_perfedavg_mnist_lr_step_by_step_example.py"),
                    "--cf",
                    str(tmp_path / f"rank{rank}.yaml"),
                    "--rank",
                    str(rank),
                    "--role",
                    "server" if rank == 0 else "client",
                    "--run_id",
                    "own",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")},
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outs[0][-3000:]
    summary = json.loads((tmp_path / "runs" / "own" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["history"][-1]["evaluated_users"] == 2
    assert "silo rank 1: user 0's data from" in outs[1] and "silo rank 2: user 1's data from" in outs[2]
    config = resolve(
        load_yaml(str(tmp_path / "rank0.yaml")),
        {
            "silo_data": "shared",
            "training_type": "simulation",
            "backend": "sp",
            "data_cache_dir": mnist_root,
            "tls_dir": None,
            "grpc_ipconfig_path": None,
        },
    )
    sp = run(config, str(tmp_path / "sp"))
    model = torch.load(tmp_path / "runs" / "own" / "model.pt", weights_only=True)
    for k, v in sp.final_state.items():
        assert float((model[k] - v).abs().max()) <= 1e-6
    assert summary["per_user_accuracy"] == sp.summary["per_user_accuracy"]


@needs_mnist
def test_a_silo_whose_own_code_fails_tells_the_server_which_goes_on_at_once(mnist_root, tmp_path):
    """Issue 44: a silo that fails mid-round says why before it exits; the server records it and
    goes on without waiting out the round deadline (300 s here)."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {
        **OWN,
        "client_num_in_total": 4,
        "client_num_per_round": 4,
        "comm_round": 3,
        "min_clients_per_round": 1,
        "round_timeout": 300,
    }
    started = time.monotonic()
    processes = start_by_hand(tmp_path, settings, 4, folders, liars={4: "fail:1"})
    outs = finish_all(processes, timeout=250)
    assert time.monotonic() - started < 150, "the server waited for the failed silo"
    assert processes[4].returncode not in (0, None) and "RuntimeError: a crash in the silo's own code" in outs[4]
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    (lost,) = summary["lost_silos"]
    assert lost["rank"] == 4 and lost["round"] == 1
    assert lost["why"] == "failed: silo rank 4: RuntimeError: a crash in the silo's own code in round 1"


@needs_mnist
def test_a_run_the_server_stops_itself_ends_every_silo_within_seconds(mnist_root, tmp_path):
    """Every update is over train_args.max_update_norm, so the server stops the run at
    max_skipped_rounds: each silo is told why and ends within seconds of the server."""
    import threading

    folders = _export(mnist_root, tmp_path, 2)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 50, "max_update_norm": 1e-9, "max_skipped_rounds": 2}
    processes = start_by_hand(tmp_path, settings, 2, folders)
    outs, ended = {}, {}

    def wait(rank, process):
        try:
            outs[rank] = process.communicate(timeout=240)[0]
        finally:
            ended[rank] = time.monotonic()

    threads = [threading.Thread(target=wait, args=item) for item in processes.items()]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(260)
    finally:
        for process in processes.values():
            process.kill()
    # the server stopped the run early: exit code 3 on every side, not a silo's 0 (README, "Exit codes")
    assert [p.returncode for p in processes.values()] == [3, 3, 3], outs[0][-3000:]
    summary = _summary(tmp_path)
    assert summary["status"] == "stopped" and "train_args.max_skipped_rounds=2" in summary["error"]
    for rank in (1, 2):
        assert "Traceback" not in outs[rank], outs[rank][-3000:]
        assert "the server ended the run early: the server stopped the run: 2 rounds had no acceptable" in outs[rank]
        record = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        assert record["status"] == "stopped" and "train_args.max_skipped_rounds=2" in record["error"]
        assert ended[rank] - ended[0] < 10, (rank, ended)


@needs_mnist
def test_a_silo_started_with_another_run_id_stops_at_once_naming_it(mnist_root, tmp_path):
    """Issue 55 item 5: organization 2 types another ``--run_id``. The server refuses its
    announcement as another run's; the silo stops within seconds with the server's words (it
    used to log one WARNING and wait out its idle limit), and the run goes on with silo 1."""
    import subprocess

    from tests.helpers import REPO

    folders = _export(mnist_root, tmp_path, 2)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 3, "min_clients_per_round": 1, "connect_timeout": 15}
    processes = start_by_hand(tmp_path, settings, 2, folders)
    processes[2].kill()  # started again, by its organization, with another run id
    processes[2].wait()
    command = list(processes[2].args)
    command[command.index("--run_id") + 1] = "pilot-2"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    processes[2] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    silo_out = processes[2].communicate(timeout=120)[0]
    took = time.monotonic() - started
    outs = finish_all(processes)
    assert processes[2].returncode == 1 and took < 30, (took, silo_out[-3000:])
    assert "silo rank 2: the server refused its announcement" in silo_out, silo_out[-3000:]
    assert "is for run 'pilot-2', not this run ('by-hand')" in silo_out and "--run_id" in silo_out
    assert processes[0].returncode == 0  # the run went on with silo 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-3000:]
