"""Accountants for the subsampled Gaussian mechanism: a user's uses (sample rate -> count) with
noise multiplier sigma, stated as (epsilon, delta)-DP.

Two, as Opacus keeps its accountants apart from the mechanism:

- ``rdp``: Opacus' Renyi-DP accountant (``compute_rdp`` per rate, composed by adding, then
  ``get_privacy_spent``). Milliseconds, and an upper bound; loose where its orders stop (Opacus'
  go to 63: at sigma 100 it says 12x Google's figure) and by 5-20% at the usual sigmas.
- ``prv``: Opacus' PRV accountant (Gopi, Lee, Wutschitz, NeurIPS 2021: the privacy loss random
  variables composed numerically by FFT), its upper estimate. Tight: within ``PRV_RELATIVE_ERROR``
  of the RDP figure above the true epsilon (Google dp-accounting's PLD accountant agrees, tests),
  and never above the RDP bound (both are upper bounds, so the smaller holds). Hundredths of a
  second a call once each rate's RDP is known (Opacus' own call takes a tenth to a second:
  :func:`_safe_domain_size`), so a run still computes it where it is asked for: a budget check that the
  RDP bound already passes needs no PRV call (:func:`within`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Iterable, List, Mapping, Tuple

from .errors import ConfigError

RDP, PRV = "rdp", "prv"
ACCOUNTANTS = {PRV: "opacus.prv", RDP: "opacus.rdp"}  # dp_args.accountant -> what summary.json names
DEFAULT = PRV
PRV_RELATIVE_ERROR = 0.01  # PRV's eps_error, as a fraction of the RDP bound


def _opacus(what: str) -> Any:
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant
        from opacus.accountants.analysis import rdp
    except ImportError as err:  # pragma: no cover - the package's 'dp' extra installs it
        raise ConfigError(
            "dp_args.dp_solution_type='dpsgd': needs Opacus' accountants (pip install 'fedml-perfedavg[dp]')"
        ) from err
    return {"rdp": rdp, "RDPAccountant": RDPAccountant, "PRVAccountant": PRVAccountant}[what]


def _orders() -> List[float]:
    return list(_opacus("RDPAccountant").DEFAULT_ALPHAS)  # the orders Opacus' own accountant uses


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_use(rate: float, noise_multiplier: float) -> Tuple[float, ...]:
    """The RDP of one use at every order (Opacus' compute_rdp is ``steps`` times this): computed
    once per sample rate, which a run has a handful of."""
    compute_rdp = _opacus("rdp").compute_rdp
    return tuple(compute_rdp(q=rate, noise_multiplier=noise_multiplier, steps=1, orders=_orders()))


def prepare(rates: Iterable[float], noise_multiplier: float) -> None:
    """Import the accountants and compute one use's RDP at each of ``rates`` now: the first call
    imports Opacus and SciPy (about 2 s of CPU, 10 s on a loaded machine), which a silo must not
    spend inside a round's deadline (its first evaluation's report)."""
    for rate in sorted(set(rates)):
        _rdp_of_one_use(float(rate), float(noise_multiplier))
    _opacus("PRVAccountant")


def rdp_epsilon(uses: Mapping[float, int], noise_multiplier: float, delta: float) -> float:
    """The RDP accountant's epsilon of ``uses``; 0 with no use."""
    if not any(uses.values()):
        return 0.0
    import numpy as np

    # by rate, so that the float sum (and every figure from it) is the same however the uses were
    # gathered: a silo's, an MPI worker's and the single process's records agree to the bit
    total = sum(
        count * np.asarray(_rdp_of_one_use(float(rate), float(noise_multiplier)))
        for rate, count in sorted(uses.items())
    )
    epsilon, _ = _opacus("rdp").get_privacy_spent(orders=_orders(), rdp=total, delta=delta)
    return float(epsilon)


def _safe_domain_size(
    uses: Tuple[Tuple[float, int], ...], noise_multiplier: float, eps_error: float, delta_error: float
) -> float:
    """Opacus' ``compute_safe_domain_size`` (analysis/prv/domain.py, remark 5.6 of Gopi et al.), from
    the cached RDP of one use: Opacus' own builds RDP accountants that compute it afresh at every call,
    nine tenths of a PRV call. The same numbers in the same order (tests/core/test_privacy.py)."""
    total = sum(count for _, count in uses)
    largest = rdp_epsilon(dict(uses), noise_multiplier, delta_error / 4)
    for rate, _ in uses:
        largest = max(largest, rdp_epsilon({rate: 1}, noise_multiplier, delta_error / (8 * total)))
    return max(largest, eps_error) + 3


@functools.lru_cache(maxsize=4096)
def _prv(uses: Tuple[Tuple[float, int], ...], noise_multiplier: float, delta: float) -> float:
    """Opacus' ``PRVAccountant.get_epsilon`` (accountants/prv.py) of ``uses``, through its public
    analysis (the PRVs, the domain, discretization and composition) with the domain's size from
    :func:`_safe_domain_size`; at most the RDP bound."""
    import numpy as np

    _opacus("PRVAccountant")  # (the dp extra's check)
    from opacus.accountants.analysis import prv as analysis
    from threadpoolctl import threadpool_limits

    bound = rdp_epsilon(dict(uses), noise_multiplier, delta)
    eps_error, delta_error = max(PRV_RELATIVE_ERROR * bound, 1e-6), delta / 1000
    uses = tuple((rate, count) for rate, count in uses if count)
    counts = [count for _, count in uses]
    # one BLAS thread: its dot product's sum order (and the last bit of epsilon) would follow the
    # process's thread count, and a silo, an MPI worker and the single process must agree
    with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"):
        warnings.simplefilter("ignore")  # its notes on the domain it chose: nothing a user acts on
        size = _safe_domain_size(uses, noise_multiplier, eps_error, delta_error)
        mesh = eps_error / np.sqrt(sum(counts) * np.log(12 / delta_error) / 2)
        domain = analysis.Domain.create_aligned(-size, size, mesh)
        prvs = [analysis.PoissonSubsampledGaussianPRV(rate, noise_multiplier) for rate, _ in uses]
        truncated = [analysis.TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max) for p in prvs]
        composed = analysis.compose_heterogeneous(
            dprvs=[analysis.discretize(t, domain) for t in truncated], num_self_compositions=counts
        )
        _, _, tight = composed.compute_epsilon(delta, delta_error, eps_error)
    return min(float(tight), bound)


def prv_epsilon(uses: Mapping[float, int], noise_multiplier: float, delta: float) -> float:
    """The PRV accountant's epsilon of ``uses`` (its upper estimate, at most the RDP bound); 0 with
    no use. Cached by the uses."""
    if not any(uses.values()):
        return 0.0
    key = tuple(sorted((float(rate), int(count)) for rate, count in uses.items() if count))
    return _prv(key, float(noise_multiplier), float(delta))


def epsilon(accountant: str, uses: Mapping[float, int], noise_multiplier: float, delta: float) -> float:
    """``accountant``'s (``"prv"`` or ``"rdp"``) epsilon of ``uses``."""
    return (prv_epsilon if accountant == PRV else rdp_epsilon)(uses, noise_multiplier, delta)


def within(accountant: str, uses: Mapping[float, int], noise_multiplier: float, delta: float, budget: float) -> bool:
    """Whether ``uses`` stay within ``budget`` by ``accountant``'s figure; the RDP bound answers
    first (at most ``budget`` there is at most ``budget`` by any tighter figure)."""
    if rdp_epsilon(uses, noise_multiplier, delta) <= budget:
        return True
    return accountant != RDP and epsilon(accountant, uses, noise_multiplier, delta) <= budget
