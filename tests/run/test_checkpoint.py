"""Checkpoints: a damaged one falls back, a resumed run equals an uninterrupted one, and a
seed gives bit-identical results."""

import json

import pytest
import torch

from fedml_perfedavg.run.config import ConfigError
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import killed_at_round, tiny_config, tiny_data


def test_a_damaged_checkpoint_falls_back_to_the_previous_one_or_names_the_files(tmp_path, caplog):
    from fedml_perfedavg.run import checkpoint

    model = {"w": torch.ones(2)}
    checkpoint.save(str(tmp_path), 2, model, {"algorithm": {}})
    checkpoint.save(str(tmp_path), 4, model, {"algorithm": {}})
    (tmp_path / "checkpoint.pt").write_bytes((tmp_path / "checkpoint.pt").read_bytes()[:100])  # truncated
    with caplog.at_level("WARNING"):
        assert checkpoint.load(str(tmp_path))["next_round"] == 2
    assert "is damaged; resuming from the previous one" in caplog.text
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"no readable checkpoint: .*checkpoint.pt .*checkpoint.prev.pt"):
        checkpoint.load(str(tmp_path))


def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, monkeypatch):
    data = tiny_data()
    full = run(tiny_config(), str(tmp_path / "full"), data=data)
    restore = killed_at_round(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(), str(tmp_path / "resumed"), data=data)
    assert (tmp_path / "resumed" / "checkpoint.pt").exists()
    assert not list((tmp_path / "resumed").glob("*.tmp"))
    restore()
    resumed = run(tiny_config(), str(tmp_path / "resumed"), data=data, resume=True)
    a, b = full.final_state, resumed.final_state
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda h: [{k: v for k, v in e.items() if not k.endswith("_seconds")} for e in h]  # noqa: E731
    assert strip(full.summary["history"]) == strip(resumed.summary["history"])
    assert resumed.summary["per_user_accuracy"] == full.summary["per_user_accuracy"]
    # the rounds' training figures before the checkpoint come back with it, none counted twice
    assert [t["round"] for t in full.summary["train_history"]] == list(range(6))
    assert resumed.summary["train_history"] == full.summary["train_history"]


def test_same_config_and_seed_give_bit_identical_results(tmp_path):
    a = run(tiny_config(), str(tmp_path / "a"), data=tiny_data())
    b = run(tiny_config(), str(tmp_path / "b"), data=tiny_data())
    pa, pb = a.final_state, b.final_state
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    c = run(tiny_config(random_seed=1), str(tmp_path / "c"), data=tiny_data())
    assert not all(torch.equal(pa[k], c.final_state[k]) for k in pa)


class _HardKill(BaseException):
    """Stands in for SIGKILL: no handler in the run gets to write anything more."""


def test_a_run_that_crashes_mid_round_is_recorded_failed_with_every_evaluation(tmp_path, monkeypatch):
    import json

    killed_at_round(monkeypatch, 5, _HardKill())
    with pytest.raises(_HardKill):
        run(tiny_config(), str(tmp_path), data=tiny_data())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("_HardKill") and summary["headline_round"] == 4
    assert (tmp_path / "model.pt").exists()
    assert [h["round"] for h in summary["history"]] == [0, 2, 4]
    assert summary["per_user_accuracy"] and not list(tmp_path.glob("*.tmp"))


class _WritesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('owned')",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    """A checkpoint is data: one written by someone else cannot run code when a run resumes."""
    from fedml_perfedavg.run import checkpoint

    marker = tmp_path / "owned"
    torch.save(
        {"next_round": 1, "model": {}, "states": _WritesAFile(marker), "torch_rng": torch.zeros(1)},
        tmp_path / "checkpoint.pt",
    )
    with pytest.raises(ConfigError, match="checkpoint.pt"):
        checkpoint.load(str(tmp_path))
    assert not marker.exists()


def test_a_stopped_runs_last_line_says_how_many_of_its_rounds_ran(tmp_path, monkeypatch, caplog):
    """A 6-round run stopped in round 2 once said "at round 1 of 2": the 2 was the rounds run."""
    killed_at_round(monkeypatch, 2)
    with caplog.at_level("INFO", logger="fedml_perfedavg"), pytest.raises(KeyboardInterrupt):
        run(tiny_config(frequency_of_the_test=1), str(tmp_path / "run"), data=tiny_data())
    assert "evaluated after round 1; 2 of 6 rounds run (interrupted)" in caplog.text, caplog.text[-2000:]


def test_an_error_raised_in_place_of_the_stop_signal_ends_the_run_as_stopped(tmp_path, monkeypatch):
    """The signal's KeyboardInterrupt landed in a library's cleanup, which raised an error of its
    own (torch's vmap nesting asserts as the interrupt unwinds it): the run is interrupted, with
    the stop's exit and one line, not failed with a traceback."""
    from fedml_perfedavg import stopping
    from fedml_perfedavg.engine.batched import BatchedSimulation

    stopped = [True]
    original = BatchedSimulation.train_round

    def train_round(self, current):
        if current == 2:
            if stopped[0]:
                stopping.STOP_SIGNALLED.set()  # what the signal's handler did, just before
            raise RuntimeError("layer.key() == TransformType::Vmap INTERNAL ASSERT FAILED")
        return original(self, current)

    monkeypatch.setattr(BatchedSimulation, "train_round", train_round)
    monkeypatch.setattr(stopping, "_RECORDED_STOP", [])
    monkeypatch.setattr(stopping.STOP_SIGNALLED, "_set", False)  # and cleared after the test, whatever happens
    with pytest.raises(KeyboardInterrupt) as stop:
        run(tiny_config(frequency_of_the_test=1), str(tmp_path / "run"), data=tiny_data())
    assert isinstance(stop.value.__cause__, RuntimeError)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds"] == 2
    assert stopping._RECORDED_STOP[0].startswith("fedml-perfedavg: interrupted")
    stopping.STOP_SIGNALLED.clear()
    stopped[0] = False  # without a stop, the same error fails the run
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
        run(tiny_config(frequency_of_the_test=1), str(tmp_path / "failed"), data=tiny_data())
    assert json.loads((tmp_path / "failed" / "summary.json").read_text())["status"] == "failed"


def test_the_record_names_the_device_and_the_torch_threads_the_run_used(tmp_path):
    result = run(tiny_config(comm_round=1), str(tmp_path / "run"), data=tiny_data())
    process = json.loads((tmp_path / "run" / "summary.json").read_text())["process"]
    assert process["device"] == "cpu" and process["torch_threads"] == torch.get_num_threads()
    assert result.summary["process"] == process
