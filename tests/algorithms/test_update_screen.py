"""The update screen's bounds relative to honest updates (issue 44): a liar far above the others
is rejected from the first round, recorded and named; honest updates within the factor never
are; zero updates and a poisoned reference cannot empty a round; declared counts are capped."""

import logging
from collections import OrderedDict

import pytest
import torch

from fedml_perfedavg.algorithms.update_screen import NAMED_AFTER, UpdateScreen

pytestmark = pytest.mark.fast

NAMES = ["w"]
GLOBAL = OrderedDict(w=torch.full((100,), 10.0))  # ||w|| = 100: the fixed bound (ratio 1) is 100


def _moved(norm: float, seed: int) -> "OrderedDict[str, torch.Tensor]":
    direction = torch.randn(100, generator=torch.Generator().manual_seed(seed))
    return OrderedDict(w=GLOBAL["w"] + norm * direction / direction.norm())


def _screen(**kw) -> UpdateScreen:
    return UpdateScreen(NAMES, None, 1.0, 3, kw.pop("factor", 8.0), kw.pop("weight_ratio", 3.0), **kw)


def test_a_liar_far_above_the_honest_updates_is_rejected_from_the_first_round_and_named(caplog):
    """What the issue's shrink and boundmax liars send: an update near the fixed bound (here 60
    of 100), against honest ones of about 1. Without the relative bound all were accepted."""
    screen = _screen()
    with caplog.at_level(logging.WARNING):
        for round_idx in range(NAMED_AFTER):
            kept = screen.accept(
                round_idx,
                [(10, _moved(60.0, round_idx)), (10, _moved(1.0, 100 + round_idx))],
                GLOBAL,
                ["user 3", "user 1"],
            )
            assert len(kept) == 1 and torch.equal(kept[0][1]["w"], _moved(1.0, 100 + round_idx)["w"])
    assert screen.record()["rejected_clients"] == {"user 3": NAMED_AFTER}
    assert screen.rejected == {0: 1, 1: 1, 2: 1}
    assert "exceeds train_args.update_norm_factor=8 x the median" in caplog.text
    assert f"user 3: {NAMED_AFTER} of its updates rejected so far" in caplog.text
    fixed_only = _screen(factor=None)
    assert len(fixed_only.accept(0, [(10, _moved(60.0, 0)), (10, _moved(1.0, 100))], GLOBAL)) == 2


def test_honest_updates_within_the_factor_are_never_rejected():
    screen = _screen()
    norms = torch.rand(200, generator=torch.Generator().manual_seed(0)) * 6 + 1  # within 7x of each other
    for round_idx in range(100):
        pair = [(10, _moved(float(norms[2 * round_idx + k]), 2 * round_idx + k)) for k in range(2)]
        assert len(screen.accept(round_idx, pair, GLOBAL, ["user 0", "user 1"])) == 2
    assert screen.rejected == {} and screen.record() == {"rejected_updates": {}}


def test_zero_updates_do_not_set_the_scale_and_a_round_the_bound_would_empty_keeps_its_updates(caplog):
    screen = _screen()
    same = OrderedDict(w=GLOBAL["w"].clone())  # a client that did not move
    assert len(screen.accept(0, [(10, same), (10, _moved(1.0, 1))], GLOBAL)) == 2
    for round_idx in range(1, 6):  # tiny updates fill the history (a liar that barely moves)
        screen.accept(round_idx, [(10, _moved(1e-4, round_idx))], GLOBAL)
    with caplog.at_level(logging.WARNING):
        kept = screen.accept(6, [(10, _moved(1.0, 7)), (10, _moved(1.2, 8))], GLOBAL)
    assert len(kept) == 2  # not a skipped round, which would count towards stopping the run
    assert "would reject all 2 updates: its reference is not the honest clients'" in caplog.text


def test_declared_counts_over_the_ratio_are_lowered_under_sample_weighted_only(caplog):
    weighted = _screen(weigh_by_samples=True)
    with caplog.at_level(logging.WARNING):
        kept = weighted.accept(0, [(500, _moved(1.0, 0)), (2**31 - 1, _moved(1.0, 1))], GLOBAL, ["user 0", "user 3"])
    assert [n for n, _ in kept] == [500, 1500]  # 3 x the lower median of the counts
    assert weighted.record()["lowered_counts"] == {"user 3": 1}
    assert "user 3 declared 2147483647 samples, over train_args.max_weight_ratio=3" in caplog.text
    uniform = _screen()
    kept = uniform.accept(0, [(500, _moved(1.0, 0)), (2**31 - 1, _moved(1.0, 1))], GLOBAL)
    assert [n for n, _ in kept] == [500, 2**31 - 1]  # the counts weigh nothing under the plain average


def test_the_screens_record_survives_a_checkpoint():
    screen = _screen(weigh_by_samples=True)
    for round_idx in range(4):
        screen.accept(round_idx, [(10, _moved(60.0, round_idx)), (10, _moved(1.0, 50 + round_idx))], GLOBAL, ["a", "b"])
    again = _screen(weigh_by_samples=True)
    again.load_state_dict(screen.state_dict())
    assert again.state_dict() == screen.state_dict()
    assert again.relative_bound([1.0]) == screen.relative_bound([1.0])
