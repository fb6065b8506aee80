"""benchmarks/cuda_check.py runs its GPU checks on the CPU too (CI has no GPU)."""

import importlib.util
import json

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("cuda_check", REPO / "benchmarks" / "cuda_check.py")
cuda_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cuda_check)


@pytest.mark.backend  # a benchmark's smoke run: about 20 s
def test_cuda_check_runs_on_the_cpu_and_finds_the_paths_equal(tmp_path):
    assert (
        cuda_check.main(["--device", "cpu", "--synthetic", "--rounds", "2", "--repeats", "1", "--out", str(tmp_path)])
        == 0
    )
    results = json.loads((tmp_path / "cpu_check.json").read_text())
    for method in cuda_check.METHODS:
        for path in ("default", "vmap"):
            assert results[f"train_{method}_{path}_max_abs_diff"] < 1e-10
            assert results[f"training_figures_{method}_{path}_max_abs_diff"] < 1e-10
            assert results[f"train_{method}_{path}_ms_per_round"] > 0
    assert results["evaluation_per_user_accuracy_equal"] is True
    assert results["full_run_rounds"] == 2 and 0 <= results["full_run_personalized_accuracy"] <= 1
    assert (tmp_path / "cpu_check.md").exists()


@pytest.mark.backend  # a benchmark's smoke run
def test_the_captured_round_prototype_runs_its_steps_on_the_cpu_and_matches_the_engine(tmp_path):
    spec = importlib.util.spec_from_file_location("cuda_graph_round", REPO / "benchmarks" / "cuda_graph_round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--synthetic", "--rounds", "2", "--blocks", "1", "--block-rounds", "1"]
    assert module.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cuda_graph_round.json").read_text())
    assert results["captured"] is False and results["rounds_compared"] == 2
    assert 0 < results["max_abs_diff_after_rounds"] < 1e-6  # the average's order of sums, no more
    assert results["eager_ms"] > 0 and results["graph_block_ms"] > 0
