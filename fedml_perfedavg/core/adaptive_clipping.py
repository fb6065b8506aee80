"""Private adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021, "Differentially
Private Learning with Adaptive Clipping"), for DP-SGD's per-sample clip bound C.

A fixed C decides the accuracy and nobody can know it in advance. Here each user's C follows a
target quantile gamma of its own per-sample norms: at every use of the mechanism (one Poisson
minibatch) the user also releases how many of its samples had a norm of at most C, noised,
and moves C geometrically toward the quantile,

    b = (sum over the minibatch of (1[|g_i| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2
    C <- C * exp(-eta * (b - gamma))

(m: the expected minibatch size, public; the centred indicator has sensitivity 1/2 under adding
or removing a sample). Both releases read the same Poisson sample, so together they are one
Gaussian mechanism on a joint vector whose noise multiplier z satisfies
z^-2 = z_grad^-2 + (2 sigma_b)^-2 (the paper's Theorem 1): the gradient's noise is raised to
z_grad and the accountant counts the same uses at the run's ``noise_multiplier`` z, in the same ledger.

Each user keeps one bound per minibatch role (D, D', D'': a Per-FedAvg step's gradients at w and
at the adapted point, and its second-order term, which has a scale of its own), as its own state
from one of its rounds to its next (algorithms/client_states.py): in a data owner's silo it never
leaves the silo. The evaluation's personalization step clips at the user's D bound and releases no
count (noise z). FedML-free.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: A client state's key for the user's bounds, one per minibatch role.
STATE_KEY = "dp_clip_bounds"
FIXED, ADAPTIVE = "fixed", "adaptive"
MODES = (FIXED, ADAPTIVE)
#: The count's default noise, as a multiple of the noise multiplier: (2 sigma_b)^-2 = z^-2 / 16,
#: a sixteenth of the privacy budget, so the gradient's noise grows by 3.3% at every sigma. At the
#: paper's sigma 1 and batches of 40 it is Andrew et al.'s own choice, sigma_b = m / 20 = 2.
DEFAULT_COUNT_STDDEV_PER_SIGMA = 2.0
DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_LEARNING_RATE = 0.2  # eta, the paper's geometric step


def gradient_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_grad, the gradient's noise multiplier, so that the gradient and the count released
    together cost one use at ``noise_multiplier`` z: (z^-2 - (2 sigma_b)^-2)^(-1/2)."""
    share = noise_multiplier**-2 - (2.0 * count_stddev) ** -2
    if share <= 0:
        raise ValueError(f"a count noise of {count_stddev} leaves the gradient no budget at sigma {noise_multiplier}")
    return 1.0 / math.sqrt(share)


def initial_bounds(roles: int, max_grad_norm: float) -> Tensor:
    """A user's bounds before its first round: ``max_grad_norm`` for every role."""
    return torch.full((roles,), float(max_grad_norm), dtype=torch.float64)


def updated_bounds(
    bounds: Tensor,
    norms: Tensor,
    mask: Tensor,
    count_noise: Tensor,
    expected: Tensor,
    count_stddev: float,
    target_quantile: float,
    learning_rate: float,
) -> Tensor:
    """The bounds after one use: ``bounds`` (...), the use's per-sample ``norms`` and ``mask``
    (..., B), its standard normal ``count_noise`` (...) and expected minibatch size (...)."""
    below = (norms <= bounds.unsqueeze(-1).to(norms.dtype)).to(torch.float64) - 0.5
    released = (below * mask.to(torch.float64)).sum(-1) + count_stddev * count_noise.to(torch.float64)
    fraction = released / expected.to(torch.float64) + 0.5
    return bounds * torch.exp(-learning_rate * (fraction - target_quantile))
