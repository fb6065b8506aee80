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


@pytest.mark.backend  # a benchmark's smoke run: about 15 s
def test_the_captured_rounds_benchmark_runs_its_steps_on_the_cpu_and_matches_the_eager_engine(tmp_path):
    spec = importlib.util.spec_from_file_location("cuda_graph_round", REPO / "benchmarks" / "cuda_graph_round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--synthetic", "--rounds", "2", "--blocks", "1", "--block-rounds", "1"]
    argv += ["--grid-rounds", "1", "--seeds", "2", "--full-rounds", "11", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    results = json.loads((tmp_path / "cuda_graph_round.json").read_text())
    assert not [k for k in results if k.endswith("_error")]
    for method in module.METHODS:
        row = results["methods"][method]
        assert row["captured"] is False and row["rounds_compared"] == 2  # no CUDA: the same steps uncaptured
        assert row["max_abs_diff_after_rounds"] == 0 and row["training_figures_equal"] is True
        assert results["grid"][method]["max_abs_diff_after_rounds"] == 0
    full = results["full"]["mnist_tau10_alpha0.01_hf"]
    assert full["rounds"] == 11 and full["evaluations"] == 2 and len(full["personalized_accuracy_percent"]) == 2
    assert "| hf | False |" in (tmp_path / "cuda_graph_round.md").read_text()
