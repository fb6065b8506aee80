"""Checks that keep one bad client or a diverging run from corrupting the global model.

Plain PyTorch; used by every algorithm object, whatever runs its rounds.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Tuple, cast

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
    return UpdateCheck(reference, max_update_norm, norm_keys, max_update_ratio).examine(update)[0]


class UpdateCheck:
    """:func:`update_problem` for many updates against one ``reference``: what depends on the
    reference alone (its parameters in float64, the ratio's bound) is computed once, and an
    update's distance once, over its parameters flattened (a handful of kernels, not a few per
    tensor: a round's screen took 6 ms of a 72 ms HF round, now about 1). A finite distance proves
    every tensor it covers finite (a NaN or an infinity in the update makes it one too); where it is
    not, and for floating-point tensors outside ``norm_keys``, the tensors are checked one by one in
    the reference's order, so the problem names the first non-finite one, as before."""

    def __init__(
        self,
        reference: Dict[str, Tensor],
        max_update_norm: Optional[float] = None,
        norm_keys: Optional[List[str]] = None,
        max_update_ratio: Optional[float] = None,
    ) -> None:
        self.reference = reference
        self.keys = list(norm_keys if norm_keys is not None else reference)
        self.max_update_norm, self.max_update_ratio = max_update_norm, max_update_ratio
        covered = set(self.keys)
        self._unchecked = [k for k, v in reference.items() if k not in covered and v.is_floating_point()]
        self._flat_reference = self._flat(reference) if self.keys else None
        # each update's flat copy, written in turn into one buffer
        self._scratch = None if self._flat_reference is None else torch.empty_like(self._flat_reference)
        self.bound = None if max_update_ratio is None else update_bound(reference, max_update_ratio, self.keys)

    def _flat(self, tensors: Dict[str, Tensor], out: Optional[Tensor] = None) -> Tensor:
        """The tensors of :attr:`keys`, one after another, in float64 on the reference's device
        (written into ``out`` where given)."""
        if out is None:
            first = self.reference[self.keys[0]]
            total = sum(self.reference[k].numel() for k in self.keys)
            out = torch.empty(total, dtype=torch.float64, device=first.device)
        flat, offset = out, 0
        for k in self.keys:
            count = tensors[k].numel()
            flat[offset : offset + count].copy_(tensors[k].reshape(-1))
            offset += count
        return flat

    def examine(self, update: Dict[str, Tensor]) -> Tuple[Optional[str], Optional[float]]:
        """(why ``update`` cannot be averaged into the reference, or None; its distance from the
        reference over :attr:`keys` where that was measured, NaN where a reference value is not finite)."""
        problem = _structure_problem(update, self.reference)
        if problem is not None:
            return problem, None
        norm = 0.0
        if self._flat_reference is not None:
            difference = self._flat(update, self._scratch).sub_(self._flat_reference)
            norm = float(torch.sqrt(torch.dot(difference, difference)))
        suspects = self._unchecked if math.isfinite(norm) else list(self.reference)
        for name in suspects:
            if update[name].is_floating_point() and not tensor_is_finite(update[name]):
                return f"{name}: non-finite values", None
        if self.max_update_norm is not None and norm > self.max_update_norm:
            return f"update norm {norm:.4g} exceeds train_args.max_update_norm={self.max_update_norm}", norm
        if self.bound is not None and norm > self.bound:
            return (
                f"update norm {norm:.4g} exceeds train_args.max_update_ratio={self.max_update_ratio} x max(||w||, 1) "
                f"= {self.bound:.4g}"
            ), norm
        return None, norm


def _structure_problem(update: Dict[str, Tensor], reference: Dict[str, Tensor]) -> Optional[str]:
    """Why ``update`` does not have ``reference``'s keys, tensor types, shapes and dtypes, or None."""
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
    return None


def apply_divergence_policy(on_divergence: str, round_idx: int, client: int, label: str) -> None:
    """``train_args.on_divergence`` for a client whose local training went non-finite: raise
    (``stop``), or log it and let the aggregation drop its update (``skip_client``)."""
    where = f"round {round_idx}, client {client}, {label}: non-finite parameters after local training"
    if on_divergence == "stop":
        raise DivergenceError(f"{where}; stopping (train_args.on_divergence=stop; the last checkpoint is kept)")
    logger.warning("%s; its update will be dropped (train_args.on_divergence=skip_client)", where)
