"""A data owner's evaluation figures as secure aggregation sums them (issue 75, rule 2): with
secure aggregation on, a silo's personalized evaluation leaves it only inside a secure sum over the
evaluation's silos, so the server learns means over at least ``min_summed_silos`` users, never one
user's counts. Each silo's vector holds its user's accuracy after the personalization step, that
accuracy squared (the mean of squares gives the spread over users), the accuracy before the step
and the loss after it, capped at :data:`LOSS_CAP` (a model that bad is reported at the cap)."""

from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np

from ..core.evaluation import accuracy_of
from . import fixed_point

FIGURES = ("accuracy", "accuracy_squared", "accuracy_before", "loss")
LOSS_CAP = 50.0
BOUND = math.sqrt(3.0 + LOSS_CAP**2)  # the vector's largest norm: every entry at its cap
PURPOSE = "evaluation"  # what the secure sum's signatures are bound to, beside the run and the round


def figures_vector(counts: Dict[str, Any]) -> np.ndarray:
    """One user's figures (its silo's counts of its test split) as the vector it adds to the sum."""
    total = int(counts["total"])  # the accuracies as the clear evaluation computes them (evaluation.accuracy_of)
    accuracy = accuracy_of(int(counts["correct"]), total)
    before = accuracy_of(int(counts["correct_before"]), total)
    loss = min(max(float(counts["loss"]), 0.0), LOSS_CAP)
    return np.array([accuracy, accuracy * accuracy, before, loss], dtype=np.float64)


def fraction_bits() -> int:
    """The fixed point's fraction bits for the figures: the most that the sum of weighted vectors
    within :data:`BOUND` cannot wrap (the weights add up to 1)."""
    return fixed_point.fraction_bits(BOUND)


def worst_error(summed: int) -> float:
    """The largest error of each mean the sum gives (``summed`` users, equal weights): the fixed
    point's rounding, :func:`fixed_point.worst_error` (about 1e-7 for 6 users)."""
    return fixed_point.worst_error(fraction_bits(), summed)


def metrics_of(mean: np.ndarray, summed: int) -> Dict[str, Any]:
    """The evaluation's record from the securely summed mean of ``summed`` users' vectors: the
    means over users, and the spread of the accuracy (population standard deviation, as a per-user
    evaluation reports it)."""
    accuracy, squared, before, loss = (float(v) for v in mean)
    return {
        "personalized_accuracy": accuracy,
        "personalized_accuracy_std": math.sqrt(max(0.0, squared - accuracy * accuracy)),
        "accuracy_before_adaptation": before,
        "personalized_loss": loss,
        "evaluated_users": int(summed),
    }
