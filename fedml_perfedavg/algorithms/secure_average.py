"""The new global model from a securely aggregated average (the server never sees one update):
the update checks become each silo's clipping, and the round's hooks after aggregation (central
DP's noise) still apply, as :meth:`FederatedAlgorithm.aggregate` applies them to a plain average."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..core.types import StateDict
from ..secagg.vectors import unflatten
from .base import FederatedAlgorithm


def secure_average(
    algorithm: FederatedAlgorithm, round_idx: int, average_delta: np.ndarray, global_state: StateDict
) -> StateDict:
    """``global_state`` moved by ``average_delta`` (the average of the silos' parameter deltas,
    flattened in ``algorithm.parameter_names``' order); buffers stay the global model's, as
    :meth:`FederatedAlgorithm.combine` keeps them."""
    delta = unflatten(average_delta, global_state, algorithm.parameter_names)
    combined = OrderedDict((k, (v + delta[k]) if k in delta else v.clone()) for k, v in global_state.items())
    algorithm.aggregate_calls += 1
    return algorithm.hooks.after_aggregation(round_idx, combined, global_state)


def keep(algorithm: FederatedAlgorithm, round_idx: int, global_state: StateDict) -> StateDict:
    """A round that could not finish securely keeps the global model and counts as skipped
    (``train_args.max_skipped_rounds`` such rounds stop the run, as rounds with no acceptable update)."""
    algorithm.screen.skip(round_idx)
    return OrderedDict((k, v.clone()) for k, v in global_state.items())
