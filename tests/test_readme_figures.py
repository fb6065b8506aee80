"""README's figures are generated (benchmarks/readme.py) from benchmarks/results, never typed: Table 1
from the recorded runs, the at-a-glance costs from their result files, the suite's fresh-clone runs
from results/suite.json. A stale figure fails here."""

import importlib.util

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.fast


def _script(name):
    spec = importlib.util.spec_from_file_location(f"test_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # by path: opacus installs a top-level package named benchmarks
    return module


def test_the_readmes_generated_figures_are_the_recorded_results():
    readme = (REPO / "README.md").read_text()
    assert _script("readme").generated(readme) == readme, "run: python benchmarks/readme.py"
    assert "| tau=10, alpha=0.01 | 88.66 ± 1.77 (75.96) |" in readme  # the CSV's five seeds, as RESULTS.md has them
    assert "49.7 ms against 722 ms: 14.5x faster" in readme  # results/flbench_hf.json


def test_pytests_summary_line_is_read_and_the_suite_figures_name_commit_date_and_load():
    suite = _script("suite")
    out = "....\n= 1009 passed, 4 skipped, 5 warnings in 419.51s (0:06:59) =\n"
    assert suite.pytest_counts(out) == {"passed": 1009, "skipped": 4, "warnings": 5, "seconds": 419.51}
    assert suite.pytest_counts("nothing ran") is None

    def ran(commit, loops, seconds, code=0):
        counts = {"passed": 1009, "skipped": 4, "seconds": seconds}
        fast = {"exit_code": 0, "wall_seconds": 27.7, "pytest": {"passed": 718, "seconds": 24.6}}
        ci = {"exit_code": code, "wall_seconds": seconds + 80, "pytest": counts}
        return {"commit": commit, "date": "2026-12-04", "cpu": "AMD EPYC", "cores": 2, "busy_loops": loops} | {
            "ci": ci,
            "fast": fast,
        }

    text = suite.figures([ran("aaa", 0, 419.5), ran("bbb", 2, 823.0), ran("ccc", 0, 500.0, code=2)])
    assert "**6:60" not in text and "in **7:00 of pytest, 8:20 for `.ci/run`" in text
    assert "fresh clone of aaa on 2026-12-04" in text
    assert "**13:43 of pytest (15:03 in all) beside 2 busy loops** at bbb" in text
    assert "718 tests in 24.6 s (27.7 s wall)" in text and "ccc" not in text  # a failed run is no figure


def test_what_make_run_prints_comes_from_the_newest_run_that_measured_it():
    suite = _script("suite")
    assert "no fresh-clone run of it is recorded yet" in suite.quick_start([{"commit": "a", "busy_loops": 0}])
    runs = [
        {"commit": "a", "date": "d1", "busy_loops": 0, "make_run": {"personalized_accuracy": 0.5, "wall_seconds": 30}},
        {
            "commit": "b",
            "date": "d2",
            "busy_loops": 2,
            "make_run": {"personalized_accuracy": 0.5491, "wall_seconds": 41},
        },
        {"commit": "c", "date": "d3", "busy_loops": 0, "make_run": {"personalized_accuracy": None}},
    ]
    text = suite.quick_start(runs)
    assert "`personalized_accuracy=0.5491`" in text and "fresh clone of b on d2, 41 s" in text
    assert "beside 2 busy loops" in text
