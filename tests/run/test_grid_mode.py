"""Grid mode through the run layer: each run's outputs are what it writes alone."""

import json

import pytest
import torch

from fedml_perfedavg.run.runner import run, run_grid

from tests.helpers_tiny import tiny_config, tiny_data


pytestmark = pytest.mark.backend  # whole grids of runs through FedML's entry points


def _strip(history):
    return [{k: v for k, v in e.items() if not k.endswith("_seconds")} for e in history]


def test_seeds_in_grid_mode_write_what_separate_runs_write(tmp_path):
    configs = [tiny_config(random_seed=s, checkpoint_every=0, stationarity_every=2) for s in (0, 1, 2)]
    data = [tiny_data(seed=s) for s in (0, 1, 2)]
    together = run_grid(configs, [str(tmp_path / "grid" / f"seed{s}") for s in (0, 1, 2)], data)
    for seed, config, split, joint in zip((0, 1, 2), configs, data, together):
        alone = run(config, str(tmp_path / "alone" / f"seed{seed}"), data=split)
        for k in alone.final_state:
            torch.testing.assert_close(joint.final_state[k], alone.final_state[k], rtol=1e-6, atol=1e-7)
        written = json.loads((tmp_path / "grid" / f"seed{seed}" / "summary.json").read_text())
        assert written["status"] == "finished" and written["rounds"] == 6
        for mine, reference in zip(_strip(written["history"]), _strip(alone.summary["history"])):
            assert mine == pytest.approx(reference, rel=1e-5)
        assert written["per_user_accuracy"] == alone.summary["per_user_accuracy"]
        assert (tmp_path / "grid" / f"seed{seed}" / "model.pt").exists()


def test_runs_that_cannot_share_a_computation_run_one_after_the_other(tmp_path, caplog):
    configs = [tiny_config(perfedavg_variant=v, checkpoint_every=0) for v in ("hf", "fo")]
    with caplog.at_level("WARNING"):
        results = run_grid(configs, [str(tmp_path / v) for v in ("hf", "fo")], [tiny_data(), tiny_data()])
    assert "grid: runs one after the other (run 1 has other client maths" in caplog.text
    assert [r.summary["status"] for r in results] == ["finished", "finished"]


def test_an_interrupted_grid_ends_every_run_as_an_interrupted_run_alone(tmp_path, monkeypatch):
    from fedml_perfedavg.engine.grid import GridSimulation

    original = GridSimulation.train_round

    def interrupted_at_round_3(self, round_idx):
        if round_idx == 3:
            raise KeyboardInterrupt
        return original(self, round_idx)

    monkeypatch.setattr(GridSimulation, "train_round", interrupted_at_round_3)
    configs = [tiny_config(random_seed=s, checkpoint_every=0) for s in (0, 1)]
    with pytest.raises(KeyboardInterrupt):
        run_grid(configs, [str(tmp_path / f"seed{s}") for s in (0, 1)], [tiny_data(seed=s) for s in (0, 1)])
    for seed in (0, 1):
        written = json.loads((tmp_path / f"seed{seed}" / "summary.json").read_text())
        assert written["status"] == "interrupted" and written["headline_round"] == 2
        assert (tmp_path / f"seed{seed}" / "model.pt").exists()
