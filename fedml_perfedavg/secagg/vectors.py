"""A model's parameters as the one vector secure aggregation sums, and back."""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional, Sequence

import numpy as np
import torch
from torch import Tensor


def length(state: Dict[str, Tensor], names: Sequence[str]) -> int:
    """Words in the vector of ``names`` (the model's parameters, in their order)."""
    return sum(state[name].numel() for name in names)


def delta(received: Dict[str, Tensor], trained: Dict[str, Tensor], names: Sequence[str]) -> np.ndarray:
    """``trained - received`` over ``names``, flattened in order, as float64."""
    parts = [(trained[n].detach().double().cpu() - received[n].detach().double().cpu()).reshape(-1) for n in names]
    return torch.cat(parts).numpy() if parts else np.zeros(0)


def unflatten(vector: np.ndarray, like: Dict[str, Tensor], names: Sequence[str]) -> "OrderedDict[str, Tensor]":
    """The tensors of ``names`` (shapes, dtypes and devices of ``like``'s) that ``vector`` holds."""
    out: "OrderedDict[str, Tensor]" = OrderedDict()
    start = 0
    for name in names:
        ref = like[name]
        count = ref.numel()
        out[name] = (
            torch.from_numpy(vector[start : start + count].copy()).reshape(ref.shape).to(ref.dtype).to(ref.device)
        )
        start += count
    if start != len(vector):
        raise ValueError(f"a vector of {len(vector)} words for parameters of {start}")
    return out


def bound(
    state: Dict[str, Tensor], names: Sequence[str], max_update_ratio: Optional[float], max_update_norm: Optional[float]
) -> float:
    """The L2 bound on an update from ``state`` that the server enforces in the clear
    (core/guards.py ``update_problem``): the tighter of the two keys given."""
    from ..core.guards import update_bound

    limits = [float(max_update_norm)] if max_update_norm is not None else []
    if max_update_ratio is not None:
        limits.append(update_bound(state, max_update_ratio, list(names)))
    if not limits:
        raise ValueError("secure aggregation needs train_args.max_update_ratio or max_update_norm")
    return min(limits)
