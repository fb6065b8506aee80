"""Secure aggregation across data-owner silos (secagg_args.enable_secagg), run as a user runs it:
one process per rank with its own folder, mutual TLS on loopback. The model equals the plaintext
run's within the stated error; a silo killed mid-run is recovered from the others' shares."""

import json
import os
import signal

import pytest
import torch

from fedml_perfedavg.run.config import ConfigError, load_yaml, resolve
from fedml_perfedavg.secagg import figures

from tests.backends.test_silo_own import OWN, _export, _sp
from tests.helpers import HF_YAML, SILO_YAML, finish_all, needs_mnist, silo_draw_secrets, start_by_hand

SECURE = {**OWN, "enable_secagg": True, "comm_round": 4, "client_num_per_round": 4}


def _summary(tmp_path):
    return json.loads((tmp_path / "run" / "summary.json").read_text())


@needs_mnist
def test_four_silos_every_one_sampled_give_the_plaintext_model_within_1e_5(mnist_root, tmp_path):
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "client_num_per_round": 4}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders), timeout=400)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 4, outs[0][-4000:]
    secure = summary["secure_aggregation"]
    assert secure["rounds"] == 4 and secure["failed_rounds"] == 0
    for record in secure["per_round"]:
        assert record["summed"] == [1, 2, 3, 4] and record["dropped"] == {} and record["threshold"] == 3
        assert all(size > 4 * 68_270 for size in record["bytes_per_silo"].values())  # the masked words and more
    sp = _sp(mnist_root, tmp_path, 4, 4, silo_draw_secrets(tmp_path / "run", 4), client_num_per_round=4)
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    worst = max(float((model[k] - v).abs().max()) for k, v in sp.final_state.items())
    assert worst <= 1e-5
    plain = sp.summary["personalized_accuracy"]
    # the evaluation is a secure sum too: sp's figure within its fixed point's stated error
    assert abs(summary["personalized_accuracy"] - plain) <= figures.worst_error(4), (
        summary["personalized_accuracy"],
        plain,
    )
    for rank in range(1, 5):
        assert "sends no update" not in outs[rank] and "leaves this round" not in outs[rank]


@needs_mnist
@pytest.mark.parametrize("stage, silos", [("shares", 6), ("masked", 4)])
def test_a_silo_killed_after_sharing_its_keys_is_recovered_and_the_run_finishes_securely(
    mnist_root, tmp_path, stage, silos
):
    """The last silo SIGKILLs itself in round 1 once the server has its key shares (before its
    masked input; 6 silos, so 5 finish: the paper's split needs an even count) or its masked input
    (before unmasking; 4 silos); the others finish the round and the run."""
    folders = _export(mnist_root, tmp_path, silos)
    settings = {
        **SECURE,
        "client_num_in_total": silos,
        "client_num_per_round": silos,
        "min_clients_per_round": silos - 1,
        "round_timeout": 60,
        "round_timeout_factor": 3,
    }
    processes = start_by_hand(tmp_path, settings, silos, folders, liars={silos: f"vanish:1:{stage}"})
    outs = finish_all(processes, timeout=400)
    assert processes[silos].returncode == -signal.SIGKILL
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 4, outs[0][-4000:]
    secure = summary["secure_aggregation"]
    assert secure["rounds"] == 4 and secure["failed_rounds"] == 0
    everyone, survivors = list(range(1, silos + 1)), list(range(1, silos))
    round_1 = secure["per_round"][1]
    assert round_1["threshold"] == silos // 2 + 1
    if stage == "shares":  # its input never came: its pairwise masks are taken out with its key's shares
        assert round_1["summed"] == survivors and round_1["recovered"] == [silos]
        assert round_1["dropped"] == {str(silos): "masked"}
    else:  # its input is in the sum: its seed is rebuilt from the others' shares
        assert round_1["summed"] == everyone and round_1["recovered"] == []
        assert round_1["dropped"] == {str(silos): "unmask"}  # every silo that shared summed: no list to sign
    assert [r["summed"] for r in secure["per_round"][2:]] == [survivors, survivors]
    assert [entry["rank"] for entry in summary["lost_silos"]] == [silos]
    accuracy = [h["personalized_accuracy"] for h in summary["history"]]
    # the model went on moving after the loss, far above chance (10 classes). Not "higher than
    # before": a secure run's draws are keyed by each silo's secret of this run, so its rounds differ
    # from run to run, and the users evaluated change with the loss (seen: 0.4917 then 0.4792 with 4
    # silos; 0.5073 then 0.3150 with 6); the rounds' sums are what the lines above hold exactly
    assert len(set(accuracy[1:])) > 1 and min(accuracy) > 0.2, accuracy
    secrets = silo_draw_secrets(tmp_path / "run", silos)  # each silo drew its minibatches with its own secret
    sp = _sp(mnist_root, tmp_path, silos, 1, secrets, client_num_per_round=silos)  # round 0 had every silo: sp's model
    # the evaluation is a secure sum too: sp's figure within its fixed point's stated error
    assert abs(accuracy[0] - sp.summary["personalized_accuracy"]) <= figures.worst_error(silos)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"silo_data": "shared"}, "only across data-owner silos"),
        ({"tls_dir": None, "insecure": True}, "needs comm_args.tls_dir"),
        ({"max_update_ratio": None}, "needs train_args.max_update_ratio or train_args.max_update_norm"),
        ({"reconstruction_threshold": 5}, "must be <= train_args.client_num_per_round \\(4\\)"),
        ({"reconstruction_threshold": 1}, "secagg_args.reconstruction_threshold=1.*>= 2"),
        ({"reconstruction_threshold": 2}, r"reconstruction_threshold=2: must be above .* Allowed: 3 to 4"),
        ({"reconstruction_threshold": 3, "max_colluding_silos": 2}, r"threshold=3: must be above .* Allowed: 4 to 4"),
        ({"max_colluding_silos": 4}, r"max_colluding_silos=4: .* Allowed: max_colluding_silos <= 3"),
        ({"client_num_per_round": 2}, r"client_num_per_round=2: .*min_summed_silos=3 .*each would learn the other"),
        ({"min_summed_silos": 2}, r"secagg_args.min_summed_silos=2.*>= 3"),
        ({"federated_optimizer": "FedAvgARUBA"}, "FedAvgARUBA"),
    ],
)
def test_what_secure_aggregation_cannot_run_with_is_refused_at_start_naming_the_key(change, message):
    values = {**SECURE, "client_num_in_total": 4, "client_num_per_round": 4, "tls_dir": "/nonexistent", **change}
    with pytest.raises(ConfigError, match=message):
        resolve(load_yaml(SILO_YAML), values)


def test_fedml_defenses_and_model_attacks_are_refused_with_secure_aggregation():
    sections = load_yaml(SILO_YAML)
    values = {**SECURE, "client_num_in_total": 4, "tls_dir": "/nonexistent"}
    defended = {**sections, "defense_args": {"enable_defense": True, "defense_type": "krum", "krum_param_m": 1}}
    with pytest.raises(ConfigError, match="defense_args.enable_defense=True .*krum.* secure aggregation hides"):
        resolve(defended, values)
    attacked = {**sections, "attack_args": {"enable_attack": True, "attack_type": "byzantine"}}
    with pytest.raises(ConfigError, match="attack_args.attack_type='byzantine' with secagg_args.enable_secagg"):
        resolve(attacked, values)
    assert resolve(load_yaml(HF_YAML), {"enable_secagg": False}).secagg.enable_secagg is False
    # An algorithm whose clients send back more than parameters (declared, not named here).
    with pytest.raises(ConfigError, match="'FedAvgARUBA' sends back more than its parameters"):
        resolve(sections, {**values, "federated_optimizer": "FedAvgARUBA"})


@needs_mnist
def test_fedml_stock_main_with_one_import_aggregates_securely_across_data_owner_silos(mnist_root, tmp_path):
    """FedML's own step-by-step main script and its cross-silo YAML, switched to data-owner silos
    and secure aggregation by YAML keys alone, one process per rank, offline."""
    import subprocess
    import sys

    from fedml_perfedavg.run.runner import load_split
    from fedml_perfedavg.run.silo_data import export_split

    from tests.backends.test_fedml_user import SCRIPT, _check, _env
    from tests.helpers import NETWORK_GUARD, example_yaml, make_tls, offline

    (tmp_path / "ipconfig.csv").write_text(
        "eid,rank,grpc_server_ip,grpc_server_port\n" + "".join(f"{r},{r},127.0.0.1,{19470 + r}\n" for r in range(5))
    )
    keys = {  # three silos summed at least (secagg_args.min_summed_silos); the paper's split wants an even count
        "grpc_ipconfig_path": str(tmp_path / "ipconfig.csv"),
        "silo_data": "own",
        "client_num_in_total": 4,
        "client_num_per_round": 4,
        "enable_secagg": True,
        "tls_dir": make_tls(tmp_path / "tls", 4),
    }
    base = example_yaml(tmp_path, "fedml_config_silo.yaml", mnist_root, "secure", tmp_path / "runs", **keys)
    export_split(resolve(load_yaml(base), {}), str(tmp_path / "export"), load_split)
    (tmp_path / "server-data").mkdir()
    folders = {0: tmp_path / "server-data", **{r: tmp_path / "export" / f"rank-{r}" for r in range(1, 5)}}
    paths = {
        r: example_yaml(tmp_path, "fedml_config_silo.yaml", mnist_root, "secure", tmp_path / "runs", **keys)
        for r in range(5)
    }
    for rank, path in paths.items():  # each organization's copy names its own folder
        text = open(path).read().replace(f"data_cache_dir: {mnist_root}", f"data_cache_dir: {folders[rank]}")
        path = str(tmp_path / f"rank-{rank}.yaml")
        open(path, "w").write(text)
        paths[rank] = path
    script = (
        " & ".join(
            f'{sys.executable} -c "$GUARD" --script {SCRIPT} --cf {paths[r]} --rank {r} --role '
            f"{'server' if r == 0 else 'client'} --run_id 7"
            for r in range(5)
        )
        + " & wait"
    )
    out = subprocess.run(
        offline(["sh", "-c", script]),
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(tmp_path), "GUARD": NETWORK_GUARD},
        cwd=tmp_path,
    )
    _check(out, processes=5)
    summary = json.loads((tmp_path / "runs" / "secure" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 3
    assert summary["secure_aggregation"]["rounds"] == 3
    assert [r["summed"] for r in summary["secure_aggregation"]["per_round"]] == [[1, 2, 3, 4]] * 3


MEDIAN = """# An algorithm that aggregates its own way, registered as a user's script does.
import sys

import fedml_perfedavg
from fedml_perfedavg.algorithms.perfedavg import PerFedAvg
from fedml_perfedavg.run.cli import main


class MedianPerFedAvg(PerFedAvg):
    def combine(self, round_idx, accepted, global_state):
        return super().combine(round_idx, accepted[:1], global_state)


fedml_perfedavg.register("MedianPerFedAvg", MedianPerFedAvg)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("algorithm", ["MedianPerFedAvg", "PerFedAvg"])
def test_an_algorithm_with_its_own_combine_is_refused_under_secure_aggregation(tmp_path, algorithm):
    """The server holds only the weighted sum: an algorithm that aggregates its own way (a median,
    a trimmed mean) would silently become the mean, so the server's process refuses it at start
    (exit 2), naming it; the same script with PerFedAvg gets past that check (and stops at the
    next: this test's TLS folder does not exist)."""
    import subprocess
    import sys

    from tests.helpers import REPO, rank_command

    script = tmp_path / "median_main.py"
    script.write_text(MEDIAN)
    sets = {**SECURE, "client_num_in_total": 4, "tls_dir": tmp_path / "no-tls", "federated_optimizer": algorithm}
    command = rank_command([sys.executable, str(script)], SILO_YAML, tmp_path / "run", sets, 0, "median")
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    refusal = "train_args.federated_optimizer='MedianPerFedAvg' overrides combine"
    assert (refusal in out.stderr) == (algorithm == "MedianPerFedAvg"), out.stderr[-2000:]
    assert "MedianPerFedAvg.combine" in out.stderr or algorithm == "PerFedAvg"
    assert "Traceback" not in out.stderr


@needs_mnist
def test_two_runs_of_the_same_silos_never_send_the_same_inputs(mnist_root, tmp_path):
    """Issue 75, rule 4: each silo keys its minibatches with a secret of this run's beside (seed,
    round, user), so a second run (a new --run_id: the server's to ask for) trains on other batches
    and one run's sum taken from another's is noise, not an update. On 6001daa both runs sent the
    same inputs (the models equal bit for bit), so a second run leaving silo 2 out gave its update
    as 4 avg(A) - 3 avg(B) to 7.8e-8."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 1}
    models, secrets = {}, {}
    for run_id in ("first", "second"):
        (tmp_path / run_id).mkdir()
        outs = finish_all(start_by_hand(tmp_path / run_id, settings, 4, folders, run_id=run_id), timeout=300)
        summary = _summary(tmp_path / run_id)
        assert summary["status"] == "finished" and summary["rounds"] == 1, outs[0][-4000:]
        models[run_id] = torch.load(tmp_path / run_id / "run" / "model.pt", weights_only=True)
        secrets[run_id] = silo_draw_secrets(tmp_path / run_id / "run", 4)
    assert all(secrets["first"][user] != secrets["second"][user] for user in range(4)), secrets
    keyed = _sp(mnist_root, tmp_path, 4, 1, secrets["second"], client_num_per_round=4)
    gap = lambda a, b: float(torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in b)))  # noqa: E731
    assert gap(models["second"], keyed.final_state) <= 1e-4  # sp given the silos' secrets draws their batches
    # The issue's attack, from each silo's own record of what it sent: silo 2's input estimated as
    # 4 avg(first) - (the second run's inputs of silos 1, 3, 4). Measured: off by 0.12-0.16 where silo 2
    # lies 0.40 from the mean (1 round, no DP: the minibatch noise of an update, no more; with
    # DP-SGD the Gaussian noise too); on 6001daa off by the fixed point's error alone (1e-7).
    sent = {
        run_id: {rank: torch.load(tmp_path / run_id / "run" / f"silo-rank-{rank}" / "progress.pt")["answer"]["weights"]
                 for rank in range(1, 5)}
        for run_id in models
    }  # fmt: skip
    first = models["first"]
    estimate = {k: 4 * first[k] - sum(sent["second"][rank][k] for rank in (1, 3, 4)) for k in sent["first"][2]}
    mean = {k: sum(sent["first"][rank][k] for rank in range(1, 5)) / 4 for k in sent["first"][2]}
    assert gap(mean, first) <= 1e-5  # what each silo recorded is what was summed
    error, spread = gap(estimate, sent["first"][2]), gap(sent["first"][2], mean)
    assert error > 0.1 * spread and error > 1e-2, (error, spread)


@needs_mnist
def test_a_silo_that_lies_inside_its_clip_bound_moves_the_model_no_further_than_its_weight_times_the_bound(
    mnist_root, tmp_path
):
    """Under secure aggregation the server sees only the sum: silo 2 stepping against its honest
    update (-0.99 ||w||, the issue's -0.8 w kind) is summed, unseen (docs/security.md says so). What
    bounds it is the clip each silo's own process applies, max_update_ratio x max(||w||, 1): the
    model differs from the honest one by at most silo 2's weight x twice the bound."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 1, "max_update_ratio": 0.5}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={2: "boundmax"}), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished", outs[0][-4000:]
    (record,) = summary["secure_aggregation"]["per_round"]
    assert record["summed"] == [1, 2, 3, 4] and record["failed"] is None, record
    sp = _sp(
        mnist_root, tmp_path, 4, 1, silo_draw_secrets(tmp_path / "run", 4), client_num_per_round=4, max_update_ratio=0.5
    )
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    moved = float(torch.sqrt(sum(((model[k] - v).double() ** 2).sum() for k, v in sp.final_state.items())))
    assert 0.01 * record["bound"] < moved <= 0.25 * 2 * record["bound"] + 1e-5, (moved, record["bound"])


def _lying_server_run(mnist_root, tmp_path, lie, per_round, per_rank=None):
    """Four data-owner silos, one secure round, a server that lies (tests/backends/lying_silo.py);
    ``per_rank``: settings of some ranks' own (rank -> key -> value)."""
    folders = _export(mnist_root, tmp_path, 4)
    for rank, own in (per_rank or {}).items():
        folders[rank] = {**folders[rank], **own}
    settings = {
        **SECURE,
        "client_num_in_total": 4,
        "client_num_per_round": per_round,
        "comm_round": 1,
        "round_timeout": 3,  # the silos refuse at once and say so; a silent one would be given up on here
        "min_clients_per_round": 1,
    }
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={0: lie}), timeout=200)
    summary = _summary(tmp_path)
    assert all(not r["summed"] for r in summary.get("secure_aggregation", {}).get("per_round", [])), outs[0][-3000:]
    return outs


@needs_mnist
def test_a_dishonest_server_that_skews_the_weights_gets_no_masked_input(mnist_root, tmp_path):
    """The server weights silo 2 by 1 and the others by 1e-300, so that the sum would be silo 2's
    update: every silo checks its weight against the protocol's (equal here) before it masks
    anything, refuses, and the round sums nothing."""
    outs = _lying_server_run(mnist_root, tmp_path, "server-skew-weights", 4)
    for rank in range(1, 5):
        expected = 1.0 if rank == 2 else 1e-300
        assert f"the server's weight {expected!r} for this silo is not the protocol's (0.25)" in outs[rank], outs[rank]
        assert "it sends no update this round" in outs[rank]


@needs_mnist
def test_a_server_that_asks_for_a_threshold_of_two_gets_no_masked_input(mnist_root, tmp_path):
    """A threshold of 2 with 4 silos a round would let the server unmask two survivor lists, [1, 2]
    and [3, 4], and so one silo's update. The server's config refuses it at start; a server patched
    to ask for 2 anyway meets each silo's own threshold (3, from its own config, which refuses less
    than a majority of the round plus secagg_args.max_colluding_silos) and gets no masked input."""
    outs = _lying_server_run(mnist_root, tmp_path, "server-threshold-2", 4)
    for rank in range(1, 5):
        assert "the server's threshold 2 is not this run's (3)" in outs[rank], outs[rank][-3000:]
        assert "it sends no update this round" in outs[rank]
        # and says so: the server's operator reads each silo's reason, at once, not a missed deadline
        declined = f"silo rank {rank} declined round 0: silo rank {rank}: the server's threshold 2"
        assert declined in outs[0], outs[0][-3000:]


@needs_mnist
def test_a_silo_the_keyed_schedule_does_not_sample_refuses_to_train(mnist_root, tmp_path):
    """The server sends every silo the model although the keyed schedule (seed, round) samples 3
    of 4: the unscheduled silo refuses to train (its data is not used), and the scheduled ones
    refuse a round whose silo list is not the schedule's."""
    from fedml_perfedavg.core.sampling import sample_clients

    outs = _lying_server_run(mnist_root, tmp_path, "server-sample-all", 3)
    scheduled = [u + 1 for u in sample_clients(0, 0, 4, 3)]
    (unscheduled,) = [r for r in range(1, 5) if r not in scheduled]
    assert "refuses round 0 from the server (session " in outs[unscheduled], outs[unscheduled]
    assert f"does not sample this silo in round 0; it samples silo rank(s) {scheduled}" in outs[unscheduled]
    for rank in scheduled:
        assert "for round 0 are not of the keyed schedule" in outs[rank], outs[rank]


@needs_mnist
def test_a_silo_with_a_low_order_key_or_a_share_under_another_index_fails_only_itself(mnist_root, tmp_path):
    """Six silos, threshold 4: silo 5 advertises the all-zero mask key, silo 4 sends its unmasking
    shares under silo 1's Shamir index. Each is traced to its sender, given up on for the round and
    named in lost_silos with the reason; every round is recovered from the honest silos."""
    folders = _export(mnist_root, tmp_path, 6)
    settings = {
        **SECURE,
        "client_num_in_total": 6,
        "client_num_per_round": 6,
        "comm_round": 2,
        "min_clients_per_round": 4,
        "round_timeout": 60,
        "round_timeout_factor": 3,
    }
    liars = {5: "zero-key", 4: "share-index"}
    outs = finish_all(start_by_hand(tmp_path, settings, 6, folders, liars=liars), timeout=400)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 2, outs[0][-4000:]
    secure = summary["secure_aggregation"]
    assert secure["failed_rounds"] == 0
    for record in secure["per_round"]:
        assert {1, 2, 3, 6} <= set(record["summed"]) and 5 not in record["summed"], record
    why = {}
    for entry in summary["lost_silos"]:
        why.setdefault(entry["rank"], []).append(entry["why"])
    assert set(why) == {4, 5}, summary["lost_silos"]
    assert all("advertised a low-order key" in w for w in why[5])
    assert all("sent a share with Shamir index 1; its own is" in w for w in why[4])
    assert "round 0: silo rank 5's secure aggregation" in outs[0] and "Traceback" not in outs[0]


@needs_mnist
@pytest.mark.parametrize("lie", ["false-ciphertext", "share-index", "false-signature", "false-terms"])
def test_one_lying_silo_among_four_with_default_settings_costs_only_itself(mnist_root, tmp_path, lie):
    """Issue 75, rule 5, with default settings (four silos, threshold 3, min_clients_per_round what a
    round needs). ``false-ciphertext``: silo 4 sends the lowest other silo random bytes as its shares,
    signed; on 6001daa that silo declined the round, the server dropped it and the run stopped at
    round 0, the liar named nowhere. Now the receiver proves it (it discloses its key for that pair
    alone) and the server names silo 4. ``share-index``: its unmasking shares carry silo 1's Shamir
    index; on 6001daa it was named but the run stopped at round 0 (min_clients_per_round defaulted
    to every silo). ``false-signature`` and ``false-terms``: its advertisement's signature is random
    bytes, or signs other terms; on 6001daa each honest silo declined ("not signed") and the run
    stopped at round 0. Now the server checks each advertisement before relaying it and names silo 4.
    Each way the run now finishes, every round summed without silo 4 once named."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 2}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={4: lie}), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 2, outs[0][-4000:]
    secure = summary["secure_aggregation"]
    assert secure["failed_rounds"] == 0, secure
    first, second = secure["per_round"]
    assert second["summed"] == [1, 2, 3], secure["per_round"]
    assert {entry["rank"] for entry in summary["lost_silos"]} == {4}, summary["lost_silos"]
    (lost,) = [entry for entry in summary["lost_silos"] if entry["rank"] == 4][:1]
    for rank in (1, 2, 3):
        assert "leaves this round's secure aggregation" not in outs[rank], outs[rank][-3000:]
    if lie in ("false-signature", "false-terms"):  # out before any share: round 0 sums the honest three
        assert first["summed"] == [1, 2, 3], first
        expected = {"false-signature": "not signed by its certificate's key", "false-terms": "signs other terms"}[lie]
        assert expected in lost["why"], lost
        return
    if lie == "share-index":  # its input was in round 0's sum, its seed rebuilt from the honest shares
        assert first["summed"] == [1, 2, 3, 4] and "sent a share with Shamir index 1; its own is 4" in lost["why"]
        return
    assert first["summed"] == [1, 2, 3] and list(first["false_ciphertexts"]) == ["4"], first
    assert "its shares for rank 1 do not decrypt (proven: rank 1 disclosed its key" in lost["why"], lost
    assert "the shares rank(s) [4] signed for this silo do not decrypt" in outs[1], outs[1][-3000:]


@needs_mnist
def test_under_secure_aggregation_the_server_learns_each_evaluation_only_as_means_over_the_organizations(
    mnist_root, tmp_path
):
    """Issue 75, rule 2: each organization's evaluation counts went to the server in the clear, also
    under secure aggregation (196 crafted models read each silo's test images through them). Now
    they leave a silo only inside the evaluation's secure sum: the server's record has, per
    evaluation, the means over the four organizations (equal to the mean of their own records
    within the fixed point's error), no user's own figure, and no per-user line in its log; each
    organization's record keeps its own."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 2}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished", outs[0][-4000:]
    own = {
        rank: json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())["history"]
        for rank in range(1, 5)
    }
    assert len(summary["history"]) == 2 and summary["per_user_accuracy"] == []
    for entry in summary["history"]:
        assert entry["evaluation"] == "secure sum" and entry["evaluated_users"] == 4, entry
        theirs = [h["personalized_accuracy"] for rank in own for h in own[rank] if h["round"] == entry["round"]]
        assert len(theirs) == 4
        assert abs(entry["personalized_accuracy"] - sum(theirs) / 4) <= figures.worst_error(4), (entry, theirs)
        assert entry["personalized_accuracy_std"] > 0
    evaluations = summary["secure_aggregation"]["per_evaluation"]
    assert [e["summed"] for e in evaluations] == [[1, 2, 3, 4]] * 2 and summary["secure_aggregation"][
        "evaluations"
    ] == 2
    log = (tmp_path / "run" / "run.log").read_text()
    assert "per-user accuracy" not in log and "the secure sum of 4 users" in log


@needs_mnist
def test_a_server_that_asks_for_an_evaluation_in_the_clear_gets_no_organizations_figures(mnist_root, tmp_path):
    """Rule 2 against a lying server: it trains securely, then asks each silo for its evaluation
    without the secure sum's terms (as every server did on 6001daa, which each silo answered with its
    counts). Each silo declines, saying why; the server's record of the evaluation has no figure."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 1}
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={0: "server-evaluate-plain"}), timeout=200)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["secure_aggregation"]["rounds"] == 1, outs[0][-3000:]
    for rank in range(1, 5):
        assert "the server's evaluation request came without terms" in outs[rank], outs[rank][-3000:]
        assert f"silo rank {rank} declined the evaluation after round 0" in outs[0], outs[0][-3000:]
        own = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        assert own["history"] == [], own["history"]  # nothing evaluated: no use of its data either
    assert summary["per_user_accuracy"] == [] and summary["personalized_accuracy"] is None, summary
    assert summary["history"] and all(e["evaluated_users"] == 0 for e in summary["history"]), summary["history"]
    assert "personalized_accuracy=none accuracy_before_adaptation=none" in outs[0], outs[0][-2000:]


@needs_mnist
def test_a_silo_that_keeps_sending_unclipped_inputs_is_named_and_refused(mnist_root, tmp_path):
    """Silo 2 scales its input to 6 times the bound it should clip to, every round. The server sees
    only the sums: each round with silo 2 is over the bound and dropped. Once three or more such
    rounds leave silo 2 alone in all of them and in no good round (the keyed schedule samples 4 of 6:
    silo 6 shares its first three), it is named and refused, and the rounds after sum the honest silos."""
    import re

    folders = _export(mnist_root, tmp_path, 6)
    settings = {
        **SECURE,
        "client_num_in_total": 6,
        "client_num_per_round": 4,
        "comm_round": 10,
        "min_clients_per_round": 3,
        "max_skipped_rounds": 10,
    }
    outs = finish_all(start_by_hand(tmp_path, settings, 6, folders, liars={2: "unclipped"}), timeout=400)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 10, outs[0][-4000:]
    per_round = summary["secure_aggregation"]["per_round"]
    over = [r["round"] for r in per_round if r["failed"] and "over the bound" in r["failed"]]
    found = re.search(r"round (\d+): silo rank 2 was summed in every one of the last rounds", outs[0])
    assert found and len(over) >= 3, (per_round, outs[0][-4000:])
    named_at = int(found.group(1))
    assert named_at == over[-1] and "silo rank 6 was summed" not in outs[0]
    assert [entry["rank"] for entry in summary["lost_silos"] if "does not clip" in entry["why"]] == [2]
    after = [r for r in per_round if r["round"] > named_at]
    assert after and all(r["failed"] is None and 2 not in r["summed"] for r in after), after


def _replayed(mnist_root, tmp_path, lie, **extra):
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**SECURE, "client_num_in_total": 4, "comm_round": 3, "min_clients_per_round": 3, "round_timeout": 30}
    settings.update(extra)
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={0: lie}), timeout=300)
    summary = _summary(tmp_path)
    # The silos that refuse send nothing more that round: the server gives up on them at its
    # deadline and, too few left, stops the run (a refusal, not a failure of the silos).
    assert summary["status"] in ("finished", "stopped"), outs[0][-4000:]
    return outs, summary


@needs_mnist
def test_a_server_that_runs_a_round_again_without_one_silo_gets_no_second_sum(mnist_root, tmp_path):
    """Round 1 summed over silos 1-4, the server runs it again on the same model without silo 2:
    silos 1, 3, 4 send their stored answers (no retraining) but will not reveal their shares for a
    second survivor list of round 1, so the server gets no sum to subtract from the first."""
    outs, summary = _replayed(mnist_root, tmp_path, "server-replay")
    records = [r for r in summary["secure_aggregation"]["per_round"] if r["round"] == 1]
    assert [r["summed"] for r in records if r["summed"]] == [[1, 2, 3, 4]], records
    for rank in (1, 3, 4):
        assert "round 1 again, on the model it trained it on" in outs[rank], outs[rank][-3000:]
        assert "round 1 was already unmasked for the survivors [1, 2, 3, 4]; a second sum over [1, 3, 4]" in outs[rank]
    assert "round 1 again" not in outs[2]


@needs_mnist
def test_a_server_that_sends_a_trained_round_again_with_another_model_is_refused(mnist_root, tmp_path):
    """With DP-SGD, training round 1 again on another model would draw the round's noise a second
    time for a second release (and count one training of two); every silo refuses the round it
    trained already, naming why, and its account holds the trainings it ran."""
    from tests.backends.test_silo_privacy import DP

    outs, summary = _replayed(mnist_root, tmp_path, "server-other-model", **DP)
    for rank in range(1, 5):
        assert "refuses round 1 from the server (session" in outs[rank], outs[rank][-3000:]
        assert "it trained round 1 already, on another model; a round is trained once" in outs[rank]
        record = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        reported = [entry["privacy"] for entry in record["history"]]
        assert record["privacy"]["uses"] > reported[-1]["uses"], (record["privacy"], reported)  # round 1's training
    records = [r for r in summary["secure_aggregation"]["per_round"] if r["round"] == 1]
    assert [r["summed"] for r in records if r["summed"]] == [[1, 2, 3, 4]], records


@needs_mnist
@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"client_num_per_round": 2},
            "train_args.client_num_per_round=2: with secagg_args.enable_secagg each round sums at least",
        ),
        (
            {"reconstruction_threshold": 2},
            "secagg_args.reconstruction_threshold=2: must be above (client_num_per_round 4 + "
            "secagg_args.max_colluding_silos 0) / 2, or a server (with that many silos) could rebuild both secrets",
        ),
    ],
)
def test_a_silo_started_with_terms_that_expose_one_update_refuses_at_start_saying_why(
    mnist_root, tmp_path, change, message
):
    """`client_num_per_round: 2` (the deployment example's): two silos summed each learn the
    other's update from the new model. `reconstruction_threshold: 2` with 4 silos a round: the
    server could unmask two survivor lists, [1, 2] and [3, 4], and subtract. The organization's own
    process refuses either at start (exit 2), naming the key, whatever the server's config says."""
    import subprocess
    import sys

    from tests.helpers import REPO, make_tls, rank_command

    folders = _export(mnist_root, tmp_path, 4)
    sets = {**SECURE, "client_num_in_total": 4, "tls_dir": make_tls(tmp_path / "tls", 4), **change}
    sets.update(folders[1])
    command = rank_command([sys.executable, "-m", "fedml_perfedavg"], SILO_YAML, tmp_path / "run", sets, 1, "two")
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    if "client_num_per_round" in change:
        assert "each would learn the other's update" in out.stderr


@needs_mnist
def test_a_server_holding_ca_key_that_mints_an_organizations_certificate_gets_no_masked_input(mnist_root, tmp_path):
    """Issue 75, rule 3, as the coordinator did it on 6001daa: it holds ca.key, signs a certificate
    for organization 3's rank on a key of its own and runs a process with it (with a roster that
    names that key), and its server takes it (its roster checks patched out). There the impostor's
    advertisement was taken and the round summed with it (the server rebuilt silo 4's clipped
    update with three such certificates). Every honest silo pins the run's roster: each refuses the
    round, naming rank 3's key, and the round sums nothing."""
    import shutil

    from fedml_perfedavg.net.key_roster import key_fingerprint
    from fedml_perfedavg.run.certs import main as certs

    from tests.helpers import make_tls

    tls = tmp_path / "tls"
    make_tls(tls, 4)  # the run's files (start_by_hand hands them to every honest rank)
    minted = tmp_path / "minted"
    assert certs(["request", "--out", str(minted), "--rank", "3"]) == 0
    assert certs(["sign", "--ca", str(tls), "--request", str(minted / "rank-3.csr"), "--out", str(minted)]) == 0
    shutil.copy(tls / "ca.pem", minted)
    forged = json.loads((tls / "roster.json").read_text())
    forged["ranks"]["3"] = key_fingerprint((minted / "rank-3.pem").read_bytes())
    (minted / "roster.json").write_text(json.dumps(forged))
    outs = _lying_server_run(mnist_root, tmp_path, "server-ignore-roster", 4, per_rank={3: {"tls_dir": str(minted)}})
    for rank in (1, 2, 4):
        assert "not rank 3's on the run's key roster" in outs[rank], outs[rank][-3000:]
        assert "a certificate the run's CA signed outside the roster" in outs[rank]
