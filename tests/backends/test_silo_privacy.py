"""DP-SGD across silos, run as a user runs it (one process per rank, mutual TLS on loopback):
the model and every user's epsilon equal the single-process run's; in data-owner mode each silo
accounts for its own user and reports it (the same epsilons; its noise is keyed by a secret of its
own, so not sp's model), and a silo whose user would pass the budget stays out."""

import json

import torch

from fedml_perfedavg.run.config import load_yaml, resolve
from fedml_perfedavg.run.runner import run

from tests.backends.test_silo_own import OWN, _export, _sp
from tests.helpers import SILO_YAML, finish_all, needs_mnist, start_by_hand

DP = {
    "dp_args.enable_dp": True,
    "dp_args.dp_solution_type": "dpsgd",
    "dp_args.noise_multiplier": 1.0,
    "dp_args.max_grad_norm": 1.0,
    "dp_args.delta": 1e-5,
}


ADAPTIVE = {"dp_args.clip": "adaptive"}


def _summary(tmp_path):
    return json.loads((tmp_path / "run" / "summary.json").read_text())


@needs_mnist
def test_shared_mode_gives_the_single_process_model_and_epsilons(mnist_root, tmp_path):
    settings = {
        "data_cache_dir": mnist_root,
        "client_num_in_total": 6,
        "client_num_per_round": 2,
        "comm_round": 4,
        "frequency_of_the_test": 2,
        "show_progress": False,
        **DP,
    }
    outs = finish_all(start_by_hand(tmp_path, settings, 2), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 4, outs[0][-4000:]
    sp = run(
        resolve(load_yaml(SILO_YAML), {**settings, "training_type": "simulation", "backend": "sp"}),
        str(tmp_path / "sp"),
    )
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.equal(model[k], v) for k, v in sp.final_state.items())
    # Under DP-SGD a silo reports figures only of a model the server evaluated (keyed as that
    # evaluation: the same release), so every user's epsilon is the single-process run's.
    assert summary["privacy"] == sp.summary["privacy"]
    reported = {m["round"] for entry in summary.get("silo_evaluation", []) for m in entry["silos"].values()}
    assert reported and reported <= {1, 3, 4}, reported  # models after rounds 0, 2 and 3 (the final one)


@needs_mnist
def test_data_owner_silos_account_for_their_own_users_under_secure_aggregation_as_sp_does(mnist_root, tmp_path, capsys):
    """Each silo's noise is its own; the server only sums (secagg_args.enable_secagg). With
    adaptive clipping each user's bounds are its silo's state: in its own record, never the server's."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**OWN, "client_num_in_total": 4, "client_num_per_round": 3, "comm_round": 3, "enable_secagg": True}
    outs = finish_all(start_by_hand(tmp_path, {**settings, **DP, **ADAPTIVE}, 4, folders), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    privacy = summary["privacy"]
    assert privacy["reported_by"].startswith("silos")
    sp = _sp(mnist_root, tmp_path, 4, 3, client_num_per_round=3, **DP, **ADAPTIVE)
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert "dp_clip_bounds" not in summary and len(sp.summary["dp_clip_bounds"]) == 4
    for rank in range(1, 5):
        own = torch.load(tmp_path / "run" / f"silo-rank-{rank}" / "client_state.pt", weights_only=True)
        assert own["dp_clip_bounds"].shape == (3,) and bool((own["dp_clip_bounds"] != 1.0).all()), own
    # Each data owner keys its noise with a secret of its own (its data's noise key, in its account,
    # and the run's): the server, which knows the seed, cannot draw it; so the model is not sp's.
    assert max(float((model[k] - v).abs().max()) for k, v in sp.final_state.items()) > 1e-4
    keys = list((tmp_path / "home" / ".fedml_perfedavg" / "accounts").glob("*/noise.key"))
    assert len(keys) == 4 and all(key.stat().st_size == 32 for key in keys)  # one per organization's data
    assert summary["secure_aggregation"]["rounds"] == 3 and summary["secure_aggregation"]["failed_rounds"] == 0
    expected = sp.summary["privacy"]["per_user"]
    assert privacy["per_user"].keys() == expected.keys()
    for user, entry in expected.items():
        assert privacy["per_user"][user]["uses"] == entry["uses"]
        assert abs(privacy["per_user"][user]["epsilon"] - entry["epsilon_rdp"]) < 1e-9
    # each silo sends its user's RDP bound with its evaluations (sp's running records carry the same)
    assert privacy["epsilon_from"] == "opacus.rdp"
    assert privacy["epsilon"] == max(e["epsilon_rdp"] for e in sp.summary["privacy"]["per_user"].values())
    assert [h["epsilon"] for h in summary["history"]] == [h["epsilon"] for h in sp.summary["history"]]
    # Where an organization looks: its own record, `fedml-perfedavg show` on it, its last log line.
    from fedml_perfedavg.run.show import main as show

    record = json.loads((tmp_path / "run" / "silo-rank-2" / "summary.json").read_text())
    spent = f"epsilon {record['privacy']['epsilon']:.4g} over {record['privacy']['uses']} uses of its data"
    # its own record: the tight figure, sp's final one for that user
    assert record["privacy"]["epsilon"] == expected["1"]["epsilon"] and spent in outs[2], outs[2][-2000:]
    # its personalized model is the one whose accuracy it reported: adapted at the user's own bound
    from fedml_perfedavg.core.functional import logits_of
    from fedml_perfedavg.core.types import model_inputs
    from fedml_perfedavg.data.silo_folder import read_silo_folder

    personalized = torch.load(tmp_path / "run" / "silo-rank-2" / "personalized.pt", weights_only=True)
    user = read_silo_folder(folders[2]["data_cache_dir"]).user
    with torch.no_grad():
        correct = (
            logits_of(sp.algorithm.network, personalized, model_inputs(user.test_x)).argmax(1) == user.test_y
        ).sum()
    assert abs(int(correct) / len(user.test_y) - record["personalized_accuracy"]) < 1e-6
    capsys.readouterr()
    assert show([str(tmp_path / "run" / "silo-rank-2")]) == 0
    shown = capsys.readouterr().out
    assert "silo rank 2 (user 1), finished" in shown and spent in shown, shown


@needs_mnist
def test_a_silo_whose_user_would_pass_the_budget_stays_out_and_the_run_records_why(mnist_root, tmp_path):
    folders = _export(mnist_root, tmp_path, 4)
    # user 3 is sampled in every round of this seed's plan and reaches 5.61 (PRV; 6.27 by RDP); the
    # others stay under 4.3
    settings = {**OWN, "client_num_in_total": 4, "comm_round": 3, "min_clients_per_round": 1, **DP}
    settings["dp_args.max_epsilon"] = 5.0
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders), timeout=300)
    summary = _summary(tmp_path)
    assert summary["status"] == "finished" and summary["rounds"] == 3, outs[0][-4000:]
    assert [entry["rank"] for entry in summary["lost_silos"]] == [4]
    assert (
        "user 3 cannot take part: dp_args.max_epsilon=5.0: this run would reach epsilon 5.606"
        in (summary["lost_silos"][0]["why"])
    )
    privacy = summary["privacy"]
    assert set(privacy["per_user"]) == {"0", "1", "2"}
    assert privacy["epsilon"] <= 5.0 and all(e["epsilon"] <= 5.0 for e in privacy["per_user"].values())


@needs_mnist
def test_a_server_that_sends_every_silo_every_round_spends_no_budget_past_the_keyed_plan(mnist_root, tmp_path):
    """The server sends every round's model to every silo (the keyed schedule samples 2 of 4),
    DP-SGD with max_epsilon 5: a silo trains only in a round the schedule samples it in and
    refuses the others, logged with the server's session and told to the server, so its user's
    epsilon stays within the plan (a silo that trained all 3 rounds would reach 6.27). The silo's
    own record holds its account."""
    from fedml_perfedavg.core.sampling import sample_clients

    folders = _export(mnist_root, tmp_path, 4)
    settings = {**OWN, "client_num_in_total": 4, "comm_round": 3, "min_clients_per_round": 1, **DP}
    settings.update({"dp_args.max_epsilon": 5.0, "round_timeout": 3})
    outs = finish_all(start_by_hand(tmp_path, settings, 4, folders, liars={0: "server-sample-all"}), timeout=300)
    summary = _summary(tmp_path)
    # The refusing silos say so (DECLINED, with their reason): the server goes on without them at once.
    assert summary["status"] in ("finished", "stopped") and summary["rounds"] >= 1, outs[0][-4000:]
    assert "declined round 0: silo rank" in outs[0] and "does not sample this silo in round 0" in outs[0]
    first = [u + 1 for u in sample_clients(0, 0, 4, 2)]
    assert 4 in first  # silo 4 (user 3, past its budget in this plan) is refused at start; one silo trains round 0
    (trained,) = [rank for rank in first if rank != 4]
    for rank in (1, 2, 3):
        refused = "refuses round 0 from the server (session " in outs[rank]
        assert refused == (rank != trained), (rank, outs[rank][-3000:])
        if refused:
            assert f"does not sample this silo in round 0; it samples silo rank(s) {first}" in outs[rank]
        record = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        privacy = record["privacy"]
        assert privacy["user"] == rank - 1 and privacy["epsilon"] <= 5.0, privacy
        # the rounds it trained (its account grows by more than an evaluation's one use): only
        # rounds the keyed schedule samples it in; a silo that declined round 0 is taken back for
        # later ones (it announces itself again once told it was left out)
        uses = [0] + [entry["privacy"]["uses"] for entry in record["history"]]
        trained_rounds = [
            entry["round"] for entry, before, after in zip(record["history"], uses, uses[1:]) if after - before > 1
        ]
        scheduled = [r for r in range(3) if rank - 1 in sample_clients(0, r, 4, 2)]
        assert set(trained_rounds) <= set(scheduled), (trained_rounds, scheduled, record["history"])
        assert (0 in trained_rounds) == (rank == trained), (trained_rounds, record["history"])


@needs_mnist
def test_a_server_that_asks_for_more_evaluations_gets_only_the_scheduled_ones_each_once(mnist_root, tmp_path):
    """Issue 75, rule 1, as processes: with the evaluation after round 0 the server also asks every
    silo for round 0 again on a model moved by 1e-6, for rounds 1, 5 and 7, and sends a final model
    mid-run. Before, each silo answered all (fresh DP noise per round index, the same noise on two
    models) and left on the final model. Now each refuses them, says why, and evaluates only after
    rounds 0 and 2 (frequency_of_the_test 2 over 3 rounds), each once: its own record's uses are
    those of the honest run."""
    folders = _export(mnist_root, tmp_path, 2)
    settings = {**OWN, "client_num_in_total": 2, "comm_round": 3, "frequency_of_the_test": 2, **DP}
    settings.update({"min_clients_per_round": 1, "round_timeout": 5})
    outs = finish_all(start_by_hand(tmp_path, settings, 2, folders, liars={0: "server-evaluate-more"}), timeout=300)
    honest = tmp_path / "honest"
    honest.mkdir()
    honest_outs = finish_all(start_by_hand(honest, settings, 2, _export(mnist_root, honest, 2)), timeout=300)
    for rank in (1, 2):
        out = outs[rank]
        assert "does not evaluate after round 1" in out, out[-3000:]
        assert "never used on two models" in out or "the same personalization noise" in out, out[-3000:]
        assert "there is no final model" in out and "the server ended the run early" not in out
        record = json.loads((tmp_path / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        again = json.loads((honest / "run" / f"silo-rank-{rank}" / "summary.json").read_text())
        assert record["status"] == "finished", (record["status"], out[-3000:])
        assert [e["round"] for e in record["history"]] == [0, 2], record["history"]
        assert record["privacy"]["uses"] == again["privacy"]["uses"], (record["privacy"], again["privacy"])
        # the organization's record says which accountant and delta its epsilon is (issue 76)
        assert (record["privacy"]["epsilon_from"], record["privacy"]["delta"]) == ("opacus.prv", 1e-5)
    assert honest_outs[0] and _summary(tmp_path)["status"] == "finished"


@needs_mnist
def test_a_second_run_of_the_same_data_counts_the_first_and_draws_fresh_noise(mnist_root, tmp_path):
    """Issue 75, rule 4, as the dishonest server did it: the same --run-dir with another --run_id
    (and --overwrite). On 6001daa each silo's account restarted at zero uses and its noise key
    stayed, so both runs released bit-identical models. Now each organization's account of its
    data spans both runs and each run draws its own secret: other noise, every use counted."""
    folders = _export(mnist_root, tmp_path, 4)
    settings = {**OWN, "client_num_in_total": 4, "comm_round": 2, "min_clients_per_round": 1, **DP}
    runs = {}
    for run_id in ("first", "second"):
        extra = {"overwrite": True} if run_id == "second" else {}
        outs = finish_all(start_by_hand(tmp_path, {**settings, **extra}, 4, folders, run_id=run_id), timeout=300)
        summary = _summary(tmp_path)
        assert summary["status"] == "finished" and summary["rounds"] == 2, outs[0][-4000:]
        records = {
            r: json.loads((tmp_path / "run" / f"silo-rank-{r}" / "summary.json").read_text())["privacy"]
            for r in range(1, 5)
        }
        runs[run_id] = (torch.load(tmp_path / "run" / "model.pt", weights_only=True), records, outs)
    (first, before, _), (second, after, outs) = runs["first"], runs["second"]
    assert max(float((first[k] - v).abs().max()) for k, v in second.items()) > 1e-4  # fresh noise
    for rank in range(1, 5):
        assert before[rank]["uses"] > 0 and "earlier_uses" not in before[rank]
        assert after[rank]["earlier_uses"] == before[rank]["uses"], (before, after)
        assert after[rank]["uses"] > before[rank]["uses"] and after[rank]["epsilon"] > before[rank]["epsilon"]
        assert "earlier use(s) of the data by 1 other run(s)" in outs[rank], outs[rank][-3000:]
