"""An offline wandb run read back with wandb's own reader: config, tags and group, one history
row per round (the training figures, under the plugin's and FedML's keys) with each evaluation's
figures in its round's row, and the per-user table."""

import json

import pytest

from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import DP_SGD, tiny_config, tiny_data


def _records(path):
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    while True:
        data = store.scan_data()
        if data is None:
            return
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        yield record


@pytest.mark.backend  # wandb's offline writer is a separate process
def test_offline_run_reads_back_with_wandbs_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = tiny_config(
        enable_wandb=True, wandb_group="mnist_tau4_alpha0.01", random_seed=3, stationarity_every=2, checkpoint_every=0
    )
    result = run(config, str(tmp_path / "run"), data=tiny_data())
    (folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    (log,) = folder.glob("*.wandb")
    records = list(_records(log))
    (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert header.run_group == "mnist_tau4_alpha0.01" and header.project == "fedml-perfedavg"
    assert list(header.tags) == ["PerFedAvg-hf", "seed3", "mnist"]
    logged_config = {item.key: json.loads(item.value_json) for item in header.config.update}
    assert logged_config["train_args"]["alpha"] == config.train.alpha
    assert logged_config["common_args"]["random_seed"] == 3

    rows = [
        {item.key: item.value_json for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    # every round: its clients' training figures, as the plugin and FedML name them
    training = result.summary["train_history"]
    assert [int(row["_step"]) for row in rows] == [t["round"] for t in training] == list(range(6))
    for row, expected in zip(rows, training):
        assert int(row["round"]) == expected["round"]
        assert float(row["Train/Loss"]) == float(row["train/loss"]) == pytest.approx(expected["train_loss"])
        assert float(row["Train/Acc"]) == float(row["train/accuracy"]) == pytest.approx(expected["train_accuracy"])
        assert 0.0 < expected["train_loss"] < 10.0 and expected["train_clients"] == config.train.client_num_per_round
    # the evaluations, in their rounds' rows: FedML's Test/* keys are the personalized figures
    evaluated = [row for row in rows if "eval/personalized_accuracy" in row]
    evaluations = result.summary["history"]
    assert [int(row["_step"]) for row in evaluated] == [h["round"] for h in evaluations] == [0, 2, 4, 5]
    for row, expected in zip(evaluated, evaluations):
        for key in ("personalized_accuracy", "accuracy_before_adaptation", "stationarity", "train_seconds"):
            assert float(row[f"eval/{key}"]) == pytest.approx(expected[key])
        assert float(row["Test/Acc"]) == pytest.approx(expected["personalized_accuracy"])
        assert float(row["Test/Loss"]) == pytest.approx(expected["personalized_loss"])

    (table_file,) = (folder / "files").rglob("per_user_accuracy_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["user", "accuracy", "accuracy_before_adaptation"]
    assert [row[1] for row in table["data"]] == pytest.approx(result.summary["per_user_accuracy"])
    assert [row[0] for row in table["data"]] == list(range(6))


@pytest.mark.backend
def test_grid_mode_runs_write_the_same_wandb_records_at_the_end(tmp_path, monkeypatch):
    from fedml_perfedavg.run.runner import run_grid

    monkeypatch.setenv("WANDB_MODE", "offline")
    configs = [tiny_config(enable_wandb=True, wandb_group="cell", random_seed=s, checkpoint_every=0) for s in (0, 1)]
    results = run_grid(configs, [str(tmp_path / f"seed{s}") for s in (0, 1)], [tiny_data(seed=s) for s in (0, 1)])
    for seed, result in zip((0, 1), results):
        (log,) = (tmp_path / f"seed{seed}" / "wandb").glob("offline-run-*/*.wandb")
        records = list(_records(log))
        (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert list(header.tags) == ["PerFedAvg-hf", f"seed{seed}", "mnist"] and header.run_group == "cell"
        rows = [
            {i.key: i.value_json for i in r.history.item} for r in records if r.WhichOneof("record_type") == "history"
        ]
        assert [int(row["_step"]) for row in rows] == list(range(6))
        assert [float(row["Train/Loss"]) for row in rows] == pytest.approx(
            [t["train_loss"] for t in result.summary["train_history"]]
        )
        rows = [row for row in rows if "eval/personalized_accuracy" in row]
        assert [int(row["_step"]) for row in rows] == [0, 2, 4, 5]
        assert [float(row["eval/personalized_accuracy"]) for row in rows] == pytest.approx(
            [h["personalized_accuracy"] for h in result.summary["history"]]
        )


@pytest.mark.backend  # wandb's offline writer is a separate process
def test_the_wandb_group_defaults_to_the_run_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run(tiny_config(enable_wandb=True, checkpoint_every=0, comm_round=1), str(tmp_path / "my-run"), data=tiny_data())
    (folder,) = (tmp_path / "my-run" / "wandb").glob("offline-run-*")
    (log,) = folder.glob("*.wandb")
    (header,) = [r.run for r in _records(log) if r.WhichOneof("record_type") == "run"]
    assert header.run_group == "my-run" and header.display_name == "my-run"


@pytest.mark.backend
def test_fedmls_wandb_name_names_the_wandb_run(tmp_path, monkeypatch):
    """Issue 76: FedML's ``wandb_name`` was "passed to FedML unchecked" and named nothing."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = tiny_config(enable_wandb=True, checkpoint_every=0, comm_round=1, wandb_name="hf-seed0")
    run(config, str(tmp_path / "my-run"), data=tiny_data())
    (log,) = (tmp_path / "my-run" / "wandb").glob("offline-run-*/*.wandb")
    (header,) = [r.run for r in _records(log) if r.WhichOneof("record_type") == "run"]
    assert (header.display_name, header.run_group) == ("hf-seed0", "my-run")


@pytest.mark.backend
def test_a_dp_sgd_run_logs_its_epsilon_at_every_evaluation(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    result = run(tiny_config(enable_wandb=True, checkpoint_every=0, **DP_SGD), str(tmp_path / "run"), data=tiny_data())
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/*.wandb")
    rows = [
        {i.key: i.value_json for i in r.history.item} for r in _records(log) if r.WhichOneof("record_type") == "history"
    ]
    epsilons = [h["epsilon"] for h in result.summary["history"]]
    assert [float(row["eval/epsilon"]) for row in rows] == pytest.approx(epsilons)
    # every evaluation's figure is the RDP bound (cheap, while the run goes); the run's last record
    # has the tight (PRV) figure, below it, and the bound beside it
    final = result.summary["privacy"]
    assert epsilons[-1] == max(e["epsilon_rdp"] for e in final["per_user"].values()) > final["epsilon"] > 0
    # The per-user table carries each user's epsilon and uses, as summary.json's privacy has them.
    (table_file,) = (tmp_path / "run" / "wandb").rglob("per_user_accuracy_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["user", "accuracy", "accuracy_before_adaptation", "epsilon", "dp_uses"]
    per_user = result.summary["privacy"]["per_user"]
    for user, *_, epsilon, uses in table["data"]:
        assert epsilon == pytest.approx(per_user[str(user)]["epsilon"]) and uses == per_user[str(user)]["uses"]
    # ... and so do the run's log (the last evaluation's, the RDP bounds) and `fedml-perfedavg show`.
    from fedml_perfedavg.run.show import main as show

    log_text = (tmp_path / "run" / "run.log").read_text()
    assert f"per-user epsilon: 0:{per_user['0']['epsilon_rdp']:.4g} 1:" in log_text
    capsys.readouterr()
    assert show([str(tmp_path / "run")]) == 0
    table_rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert any(row[-2:] == ["epsilon", "uses"] for row in table_rows), table_rows
    row0 = next(r for r in table_rows if r[0] == "0")
    assert row0[-2:] == [f"{per_user['0']['epsilon']:.4g}", str(per_user["0"]["uses"])]
