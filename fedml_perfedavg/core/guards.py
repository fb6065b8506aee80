"""Checks that keep one bad client or a diverging run from corrupting the global model.

Plain PyTorch; used by every algorithm object, whatever runs its rounds.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, cast

import torch
from torch import Tensor

from .errors import DivergenceError

logger = logging.getLogger(__name__)


# A NaN or an infinity times 0 is NaN, a finite value times 0 is 0, and a sum of zeros cannot
# overflow: so sum(v * 0) == 0 exactly when v is finite, in two kernels where isfinite().all()
# takes five (ten times slower on a round's stacked models).
def nonfinite_clients(stacked: Dict[str, Tensor]) -> List[int]:
    """Indices (along dim 0) of the stacked client models that hold a NaN or an infinity."""
    ok = torch.stack([(v * 0).flatten(1).sum(dim=1) == 0 for v in stacked.values()]).all(dim=0)
    return torch.nonzero(~ok).flatten().tolist()


def tensor_is_finite(value: Tensor) -> bool:
    """True when every value of the floating-point tensor ``value`` is finite."""
    return bool((value * 0).sum() == 0)


def is_finite(params: Dict[str, Tensor]) -> bool:
    """True when every tensor of ``params`` is finite."""
    return all(tensor_is_finite(v) for v in params.values() if v.is_floating_point())


def l2_norm(tensors: Dict[str, Tensor], keys: List[str]) -> float:
    """The L2 norm of ``tensors[k]`` over ``keys``, accumulated in float64."""
    return float(torch.sqrt(cast(Tensor, sum((tensors[k].double() ** 2).sum() for k in keys)))) if keys else 0.0


def update_bound(reference: Dict[str, Tensor], max_update_ratio: float, norm_keys: Optional[List[str]] = None) -> float:
    """The largest distance an update may move ``reference``: ``max_update_ratio`` times the
    model's own norm over ``norm_keys``, or times 1 for a model whose norm is below 1 (a model
    initialized at zero can still be trained)."""
    keys = list(norm_keys if norm_keys is not None else reference)
    return max_update_ratio * max(l2_norm(reference, keys), 1.0)


def update_distance(update: Dict[str, Tensor], reference: Dict[str, Tensor], keys: List[str]) -> float:
    """||update - reference|| over ``keys``, accumulated in float64."""
    if not keys:
        return 0.0
    squares = sum(((update[k].double() - reference[k].double().to(update[k].device)) ** 2).sum() for k in keys)
    return float(torch.sqrt(cast(Tensor, squares)))


def update_problem(
    update: Dict[str, Tensor],
    reference: Dict[str, Tensor],
    max_update_norm: Optional[float] = None,
    norm_keys: Optional[List[str]] = None,
    max_update_ratio: Optional[float] = None,
) -> Optional[str]:
    """Why a received client model cannot be averaged into ``reference``, or None if it can;
    ``max_update_norm`` and ``max_update_ratio`` (see :func:`update_bound`) bound the distance
    over ``norm_keys`` (default: every key)."""
    if not isinstance(update, dict):
        return f"expected a state dict, got {type(update).__name__}"
    if set(update) != set(reference):
        missing, extra = sorted(set(reference) - set(update)), sorted(set(update) - set(reference))
        return f"keys differ from the global model (missing {missing}, unexpected {extra})"
    for name, ref in reference.items():
        value = update[name]
        if not isinstance(value, Tensor):
            return f"{name}: not a tensor ({type(value).__name__})"
        if value.shape != ref.shape or value.dtype != ref.dtype:
            return f"{name}: shape/dtype {tuple(value.shape)}/{value.dtype}, expected {tuple(ref.shape)}/{ref.dtype}"
        if value.is_floating_point() and not tensor_is_finite(value):
            return f"{name}: non-finite values"
    if max_update_norm is None and max_update_ratio is None:
        return None
    keys = list(norm_keys if norm_keys is not None else reference)
    norm = update_distance(update, reference, keys)
    if max_update_norm is not None and norm > max_update_norm:
        return f"update norm {norm:.4g} exceeds train_args.max_update_norm={max_update_norm}"
    if max_update_ratio is not None:
        bound = update_bound(reference, max_update_ratio, keys)
        if norm > bound:
            return (
                f"update norm {norm:.4g} exceeds train_args.max_update_ratio={max_update_ratio} x max(||w||, 1) "
                f"= {bound:.4g}"
            )
    return None


def apply_divergence_policy(on_divergence: str, round_idx: int, client: int, label: str) -> None:
    """``train_args.on_divergence`` for a client whose local training went non-finite: raise
    (``stop``), or log it and let the aggregation drop its update (``skip_client``)."""
    where = f"round {round_idx}, client {client}, {label}: non-finite parameters after local training"
    if on_divergence == "stop":
        raise DivergenceError(f"{where}; stopping (train_args.on_divergence=stop; the last checkpoint is kept)")
    logger.warning("%s; its update will be dropped (train_args.on_divergence=skip_client)", where)
