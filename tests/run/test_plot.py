"""accuracy.png: drawn at a run's end and by ``fedml-perfedavg show RUN --plot`` from the run's own
history (run/plot.py)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.run import plot
from fedml_perfedavg.run.show import main as show

from tests.helpers import REPO, needs_mnist

PNG = b"\x89PNG\r\n\x1a\n"

HISTORY = [
    {"round": 0, "personalized_accuracy": 0.15, "accuracy_before_adaptation": 0.09, "personalized_loss": 2.3},
    {"round": 5, "personalized_accuracy": 0.55, "accuracy_before_adaptation": 0.31, "personalized_loss": 1.4},
    {"round": 9, "personalized_accuracy": 0.71, "accuracy_before_adaptation": 0.42, "personalized_loss": 0.9},
]


def _summary(status="finished", **more):
    return {"status": status, "rounds": 10, "history": HISTORY, **more}


def _lines(figure):
    accuracy, loss = figure.axes
    return (
        {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in accuracy.get_lines()},
        [(list(line.get_xdata()), list(line.get_ydata())) for line in loss.get_lines()],
        loss.get_ylabel(),
    )


def test_the_figure_holds_the_runs_accuracies_and_loss_by_round():
    accuracy, loss, label = _lines(plot.draw(_summary()))
    assert accuracy == {
        "personalized (after one adaptation step)": ([0, 5, 9], [0.15, 0.55, 0.71]),
        "before adaptation": ([0, 5, 9], [0.09, 0.31, 0.42]),
    }
    assert loss == [([0, 5, 9], [2.3, 1.4, 0.9])] and label == "personalized loss (evaluation)"
    # where the run recorded each round's training loss, that is the right panel
    train = [{"round": r, "train_loss": 2.0 - 0.1 * r} for r in range(10)]
    _, loss, label = _lines(plot.draw(_summary(train_history=train)))
    assert loss == [(list(range(10)), [2.0 - 0.1 * r for r in range(10)])] and label.startswith("training loss")


def test_an_evaluation_without_figures_is_left_out_not_drawn_as_zero():
    history = [*HISTORY, {"round": 12, "personalized_accuracy": None, "missing_users": [1, 2]}]
    accuracy, _, _ = _lines(plot.draw({"status": "running", "history": history}))
    assert accuracy["personalized (after one adaptation step)"][0] == [0, 5, 9]


def test_show_plot_draws_a_running_run_and_says_where(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(_summary(status="running")))
    assert show([str(tmp_path), "--plot"]) == 0
    out = capsys.readouterr().out
    assert f"plotted {tmp_path / 'accuracy.png'}" in out
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == PNG


def test_show_plot_on_a_silos_record_or_a_run_without_evaluations_says_there_is_nothing(tmp_path, capsys):
    silo = tmp_path / "org" / "silo-rank-1"
    silo.mkdir(parents=True)
    (silo / "summary.json").write_text(json.dumps({"role": "silo", "rank": 1, "status": "finished"}))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "summary.json").write_text(json.dumps({"status": "running", "history": []}))
    assert show([str(tmp_path / "org"), "--plot"]) == 2
    assert "nothing to plot (a silo's own record holds no history)" in capsys.readouterr().err
    assert show([str(fresh), "--plot"]) == 2
    assert "nothing to plot (no evaluation yet)" in capsys.readouterr().err
    assert not (fresh / "accuracy.png").exists()


def test_without_matplotlib_the_plot_names_the_extra_and_the_run_is_not_failed(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(ConfigError, match=r"fedml-perfedavg\[bench\]"):
        plot.write_plot(_summary(), str(tmp_path))
    with caplog.at_level("INFO", logger="fedml_perfedavg.run.plot"):
        plot.plot_at_end(_summary(), str(tmp_path))
    assert "accuracy.png not drawn: drawing accuracy.png needs matplotlib" in caplog.text
    assert not os.listdir(tmp_path)


@needs_mnist
def test_a_run_leaves_accuracy_png_of_its_own_history(mnist_root, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "fedml_perfedavg", "--cf", str(REPO / "yaml_configs" / "quickstart_mnist_hf.yaml")]
    sets = {"comm_round": 3, "frequency_of_the_test": 1, "data_cache_dir": mnist_root, "show_progress": False}
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir), *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / "accuracy.png").read_bytes()[:8] == PNG
    summary = json.loads((run_dir / "summary.json").read_text())
    accuracy, _, _ = _lines(plot.draw(summary))
    assert accuracy["personalized (after one adaptation step)"] == (
        [0, 1, 2],
        [entry["personalized_accuracy"] for entry in summary["history"]],
    )
