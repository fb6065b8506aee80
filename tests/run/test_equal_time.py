"""benchmarks/equal_time.py: both methods at equal training-time budgets."""

import importlib.util
import json

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("equal_time", REPO / "benchmarks" / "equal_time.py")
equal_time = importlib.util.module_from_spec(spec)
spec.loader.exec_module(equal_time)


def _summary(points):
    """A finished run's summary with evaluations (round, train_seconds, accuracy)."""
    history = [{"round": r, "train_seconds": t, "personalized_accuracy": a} for r, t, a in points]
    return {"status": "finished", "personalized_accuracy": history[-1]["personalized_accuracy"], "history": history}


HF = _summary([(9, 2.0, 0.30), (19, 4.0, 0.50), (29, 6.0, 0.70), (39, 8.0, 0.90)])
FEDAVG = _summary(
    [
        (9, 0.5, 0.40),
        (19, 1.0, 0.55),
        (29, 1.5, 0.60),
        (39, 2.5, 0.62),
        (49, 3.5, 0.64),
        (59, 5.0, 0.66),
        (69, 7.9, 0.68),
        (79, 9.0, 0.69),
    ]
)


def test_each_budget_takes_the_last_evaluation_within_it():
    rows = equal_time.compare(HF, FEDAVG)
    # budgets: 25/50/75/100% of HF's 8.0 s = 2, 4, 6, 8 s
    assert [r["budget_seconds"] for r in rows] == [2.0, 4.0, 6.0, 8.0]
    assert [r["hf_accuracy"] for r in rows] == [0.30, 0.50, 0.70, 0.90]
    assert [r["fedavg_accuracy"] for r in rows] == [0.60, 0.64, 0.66, 0.68]
    assert [r["fedavg_round"] for r in rows] == [29, 49, 59, 69]
    assert [r["hf_minus_fedavg"] for r in rows] == pytest.approx([-0.30, -0.14, 0.04, 0.22])
    assert equal_time.at_budget(HF["history"], 1.9) is None


def test_report_pairs_seeds_and_writes_table_csv_and_plot(tmp_path):
    cell = "mnist_tau4_alpha0.01"
    for seed, shift in ((0, 0.0), (1, 0.02)):
        for method, summary in (("hf", HF), ("fedavg", FEDAVG)):
            run = tmp_path / "runs" / cell / method / f"seed{seed}"
            run.mkdir(parents=True)
            moved = {
                **summary,
                "history": [
                    {**e, "personalized_accuracy": e["personalized_accuracy"] + shift} for e in summary["history"]
                ],
            }
            moved["personalized_accuracy"] = moved["history"][-1]["personalized_accuracy"]
            (run / "summary.json").write_text(json.dumps(moved))
    markdown = equal_time.report(tmp_path, "cmd", seeds=2, hf_rounds=40, fedavg_rounds=80)
    # 100% budget: HF 90 and 92, FedAvg 68 and 70; the paired difference is 22 for both seeds
    assert f"| {cell} | 100% | 8.0 | 91.00 ± 12.71 | 69.00 ± 12.71 | 70 | 22.00 ± 0.00 |" in markdown
    assert f"| {cell} | 2 | 91.00 ± 12.71 | 70.00 ± 12.71 | 8.0 | 9.0 |" in markdown
    assert (tmp_path / f"{cell}.png").exists()
    assert len((tmp_path / "equal_time.csv").read_text().splitlines()) == 1 + 2 * 4
