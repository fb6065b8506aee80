"""A silo's update as 32-bit fixed point that the round's sum cannot wrap.

Each silo sends ``round(w_i x_i 2^f) mod 2^32``, where ``x_i`` is its delta clipped to the L2
bound ``B`` the server enforces (so every coordinate is within ``[-B, B]``) and ``w_i`` its
aggregation weight, normalised so that the round's weights add up to 1 (uniform: 1/n; sample
weighted: n_i / sum n). Then ``|sum_i w_i x_i 2^f| <= B 2^f`` and the sum read as a signed 32-bit
number is exact as long as ``B 2^f < 2^30`` (one bit of margin): :func:`fraction_bits` picks the
largest such ``f``, at most :data:`MAX_FRACTION_BITS`. Decoding divides by ``2^f`` and by the weight
of the silos whose inputs made it into the sum (those that dropped out take theirs out).

Each silo's rounding error is at most ``2^-(f+1)`` per coordinate, so the average is off by at
most ``n 2^-(f+1) / W`` (:func:`worst_error`); :data:`MIN_FRACTION_BITS` keeps that far below 1e-5
for the silo counts cross-silo runs have.
"""

from __future__ import annotations

import math

import numpy as np

MODULUS_BITS = 32
MAX_FRACTION_BITS = 30
MIN_FRACTION_BITS = 20  # n 2^-(f+1) = 4.8e-6 for 10 silos at W = 1


def fraction_bits(coordinate_bound: float) -> int:
    """The most fraction bits with which a sum of inputs, each within ``coordinate_bound`` per
    coordinate and weighted to add up to 1, cannot wrap modulo 2^32 (``-1`` if none can)."""
    if not math.isfinite(coordinate_bound) or coordinate_bound <= 0:
        return -1
    return min(MAX_FRACTION_BITS, math.floor(MODULUS_BITS - 2 - math.log2(coordinate_bound)))


def worst_error(bits: int, silos: int, weight: float = 1.0) -> float:
    """The largest per-coordinate error of the decoded average of ``silos`` inputs with ``bits``
    fraction bits, the inputs in the sum weighing ``weight`` together."""
    return silos * 2.0 ** -(bits + 1) / weight


def clip(vector: np.ndarray, bound: float) -> np.ndarray:
    """``vector`` scaled down to L2 norm ``bound`` if it is longer (as the server's bound checks)."""
    norm = float(np.linalg.norm(vector))
    return vector * (bound / norm) if norm > bound else vector


def encode(vector: np.ndarray, weight: float, bits: int) -> np.ndarray:
    """``round(weight * vector * 2^bits)`` modulo 2^32, as unsigned 32-bit words."""
    scaled = np.rint(np.asarray(vector, dtype=np.float64) * (weight * 2.0**bits)).astype(np.int64)
    return (scaled & 0xFFFFFFFF).astype(np.uint32)


def decode(total: np.ndarray, bits: int, weight: float) -> np.ndarray:
    """The average a modular sum of :func:`encode` d inputs stands for (``weight``: theirs together)."""
    signed = total.astype(np.int64)
    signed[signed >= 2**31] -= 2**32
    return signed.astype(np.float64) / (2.0**bits * weight)
