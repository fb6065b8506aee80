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
  :func:`_reused_rdp`), so a run still computes it where it is asked for: a budget check that the
  RDP bound already passes needs no PRV call (:func:`within`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Iterable, Iterator, List, Mapping, Tuple

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


_UNPATCHED: dict = {}  # Opacus' own compute_rdp, taken before _reused_rdp ever stands in for it


def _compute_rdp() -> Any:
    return _UNPATCHED.setdefault("compute_rdp", _opacus("rdp").compute_rdp)


@functools.lru_cache(maxsize=4096)
def _rdp_of_one_use(rate: float, noise_multiplier: float) -> Tuple[float, ...]:
    """The RDP of one use at every order (Opacus' compute_rdp is ``steps`` times this): computed
    once per sample rate, which a run has a handful of."""
    return tuple(_compute_rdp()(q=rate, noise_multiplier=noise_multiplier, steps=1, orders=_orders()))


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _reused_rdp() -> Iterator[None]:
    """Opacus' PRV accountant sizes its domain with RDP accountants (compute_safe_domain_size)
    that compute one use's RDP at its 60 orders afresh for every rate, several times an epsilon:
    nine tenths of a PRV call, a third of a second each. Meanwhile its ``compute_rdp`` at the
    default orders is :func:`_rdp_of_one_use` (cached) times ``steps``, as compute_rdp itself
    computes it: the same numbers. Other orders go to Opacus' own."""
    module = _opacus("rdp")
    original, default_orders = _compute_rdp(), tuple(_orders())

    def compute_rdp(*, q: float, noise_multiplier: float, steps: int, orders: Any) -> Any:
        if not isinstance(orders, (int, float)) and tuple(orders) == default_orders:
            import numpy as np

            return np.asarray(_rdp_of_one_use(float(q), float(noise_multiplier))) * steps
        return original(q=q, noise_multiplier=noise_multiplier, steps=steps, orders=orders)

    with _PATCH_LOCK:
        module.compute_rdp = compute_rdp
        try:
            yield
        finally:
            module.compute_rdp = original


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


@functools.lru_cache(maxsize=4096)
def _prv(uses: Tuple[Tuple[float, int], ...], noise_multiplier: float, delta: float) -> float:
    bound = rdp_epsilon(dict(uses), noise_multiplier, delta)
    accountant = _opacus("PRVAccountant")()
    accountant.history = [(noise_multiplier, rate, count) for rate, count in uses if count]
    from threadpoolctl import threadpool_limits

    # one BLAS thread: its dot product's sum order (and the last bit of epsilon) would follow the
    # process's thread count, and a silo, an MPI worker and the single process must agree
    with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"), _reused_rdp():
        warnings.simplefilter("ignore")  # its notes on the domain it chose: nothing a user acts on
        tight = float(accountant.get_epsilon(delta, eps_error=max(PRV_RELATIVE_ERROR * bound, 1e-6)))
    return min(tight, bound)


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
