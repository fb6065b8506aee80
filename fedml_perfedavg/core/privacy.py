"""Sample-level differential privacy for a user's own data: DP-SGD inside the local steps.

Every gradient computed on a user's private data is one use of the subsampled Gaussian
mechanism (Abadi et al. 2016): a Poisson sample of the user's training data with rate
``q = batch_size / n`` (expected size ``batch_size``), each sample's contribution clipped to
``max_grad_norm`` C, summed, ``N(0, sigma^2 C^2)`` added, divided by the expected size. In a
Per-FedAvg step that is D's gradient, D''s gradient at the adapted point, and (HF, exact) D'''s
per-sample second-order term (HF's finite difference, exact's Hessian-vector product), clipped
and noised as one vector; FedAvg's step is one use, and so is each personalization step of the
evaluation (its accuracy leaves the user). Each user's account of those uses is core/ledger.py's,
stated as epsilon by the accountant ``dp_args.accountant`` names (core/accounting.py: Opacus' PRV,
tight, by default; its RDP bound beside it).

Split as Opacus splits its accountants from its mechanism: this module is the policy, ``dp_args``
read and checked (:class:`DPSGD`, which the rest of the run asks); the draws (Poisson minibatches
and noise, keyed by (seed, round, user) outside the maths, so a vmapped round, one client at a
time, MPI ranks and silos compute the same numbers) are core/private_draws.py's; the mechanism
(per-sample clipping and noise in the local step's arithmetic) core/private_steps.py's; the
adaptive clip bound core/adaptive_clipping.py's; the accountants core/accounting.py's. FedML-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from . import accounting, adaptive_clipping
from .adaptive_clipping import ADAPTIVE, FIXED
from .client_maths import Step
from .errors import ConfigError

SOLUTION = "dpsgd"
NAMED = f"dp_args.dp_solution_type={SOLUTION!r}"  # how a refusal names the setting it comes from
# dp_args keys that belong to FedML's own local/central DP, never to DP-SGD.
FEDML_ONLY_KEYS = ("epsilon", "sensitivity", "mechanism_type", "enable_rdp_accountant", "rdp_alpha")
KEYS = (
    "enable_dp",
    "dp_solution_type",
    "noise_multiplier",
    "max_grad_norm",
    "delta",
    "max_epsilon",
    "accountant",
    "clip",
    "target_quantile",
    "clip_learning_rate",
    "clip_count_stddev",
)
ADAPTIVE_KEYS = ("target_quantile", "clip_learning_rate", "clip_count_stddev")
#: each of :data:`KEYS`: (what is allowed, what it means), for docs/configuration.md's table (run/reference.py;
#: the defaults are :class:`DPSGD`'s); the checks themselves are DPSGD's and :meth:`DPSGD.from_section`'s
KEY_DOCS = {
    "enable_dp": ("bool", "FedML's switch of its DP section: true with dp_solution_type dpsgd"),
    "dp_solution_type": (
        f"{SOLUTION}, or FedML's ldp, cdp",
        f"{SOLUTION}: DP-SGD in every local step (each sample's gradient clipped, Gaussian noise added, each "
        "user's epsilon accounted); ldp, cdp: FedML's own DP, run by FedML's classes",
    ),
    "noise_multiplier": ("> 0, required", "sigma: the noise's standard deviation over the clip bound"),
    "max_grad_norm": ("> 0, required", "C: each sample's gradient is clipped to this norm (clip adaptive: the start)"),
    "delta": ("in (0, 1), required", "the delta every epsilon is stated at"),
    "max_epsilon": (
        "> 0 or null",
        "a budget no user's epsilon may pass: a use that would is refused (a data owner's silo enforces its own)",
    ),
    "accountant": (
        ", ".join(sorted(accounting.ACCOUNTANTS)),
        "what states epsilon: Opacus' PRV accountant (prv: tight) or its RDP bound (rdp); summary.json names it",
    ),
    "clip": (
        ", ".join(adaptive_clipping.MODES),
        "fixed: every sample clipped to max_grad_norm; adaptive: each user's bound follows target_quantile of "
        "its per-sample norms (its bounds are its own state)",
    ),
    "target_quantile": ("in (0, 1)", "clip adaptive: the fraction of samples left unclipped"),
    "clip_learning_rate": ("> 0", "clip adaptive: eta, the geometric step of the bound"),
    "clip_count_stddev": (
        "above noise_multiplier / 2, or null",
        f"clip adaptive: sigma_b, the noise on each use's count (null: "
        f"{adaptive_clipping.DEFAULT_COUNT_STDDEV_PER_SIGMA:g} x noise_multiplier)",
    ),
}


@dataclass(frozen=True)
class DPSGD:
    """``dp_args`` with ``dp_solution_type: dpsgd``: the noise multiplier sigma, the clip bound C
    (with ``clip: adaptive`` each user's starting bound, then following ``target_quantile`` of its
    per-sample norms: core/adaptive_clipping.py), the delta epsilon is stated at, an optional budget
    no user's epsilon may exceed, and the accountant that states epsilon (core/accounting.py)."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    max_epsilon: Optional[float] = None
    accountant: str = accounting.DEFAULT
    clip: str = FIXED
    target_quantile: float = adaptive_clipping.DEFAULT_TARGET_QUANTILE
    clip_learning_rate: float = adaptive_clipping.DEFAULT_LEARNING_RATE
    #: sigma_b, the noise on each use's count (in samples); None: DEFAULT_COUNT_STDDEV_PER_SIGMA x sigma.
    clip_count_stddev: Optional[float] = None
    # A data owner's silo's own secret, in the key of its noise and minibatches beside (seed, round,
    # user): the server, which knows the seed, cannot recompute the noise and take it out.
    secret: Optional[bytes] = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        def number(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"dp_args.{key}={value!r}: must be a finite number")
            return float(value)

        if number("noise_multiplier", self.noise_multiplier) <= 0:
            raise ConfigError(
                f"dp_args.noise_multiplier={self.noise_multiplier!r}: must be > 0 (sigma; the noise's "
                f"standard deviation is sigma * max_grad_norm)"
            )
        if number("max_grad_norm", self.max_grad_norm) <= 0:
            raise ConfigError(
                f"dp_args.max_grad_norm={self.max_grad_norm!r}: must be > 0 (C, the clip bound of each "
                f"sample's gradient)"
            )
        if not 0 < number("delta", self.delta) < 1:
            raise ConfigError(f"dp_args.delta={self.delta!r}: must be in (0, 1) (the delta epsilon is stated at)")
        if self.max_epsilon is not None and number("max_epsilon", self.max_epsilon) <= 0:
            raise ConfigError(f"dp_args.max_epsilon={self.max_epsilon!r}: must be > 0, or null for no budget")
        if self.accountant not in accounting.ACCOUNTANTS:
            raise ConfigError(
                f"dp_args.accountant={self.accountant!r}: allowed: {sorted(accounting.ACCOUNTANTS)} ('prv': "
                f"Opacus' PRV accountant, tight; 'rdp': its RDP accountant, a looser bound)"
            )
        for key in ("noise_multiplier", "max_grad_norm", "delta"):
            object.__setattr__(self, key, float(getattr(self, key)))
        self._check_clip(number)

    def _check_clip(self, number: Any) -> None:
        if self.clip not in adaptive_clipping.MODES:
            raise ConfigError(
                f"dp_args.clip={self.clip!r}: allowed: {list(adaptive_clipping.MODES)} ('fixed': every sample "
                f"clipped at max_grad_norm; 'adaptive': each user's bound follows target_quantile of its norms)"
            )
        if not 0 < number("target_quantile", self.target_quantile) < 1:
            raise ConfigError(
                f"dp_args.target_quantile={self.target_quantile!r}: must be in (0, 1) (the fraction of samples "
                f"whose norm the adaptive bound should be above; 0.5, the median, by default)"
            )
        if number("clip_learning_rate", self.clip_learning_rate) <= 0:
            raise ConfigError(
                f"dp_args.clip_learning_rate={self.clip_learning_rate!r}: must be > 0 (eta, the geometric step of "
                f"the adaptive bound; {adaptive_clipping.DEFAULT_LEARNING_RATE} by default)"
            )
        if self.clip_count_stddev is None:
            stddev = adaptive_clipping.DEFAULT_COUNT_STDDEV_PER_SIGMA * self.noise_multiplier
            object.__setattr__(self, "clip_count_stddev", stddev)
        elif not number("clip_count_stddev", self.clip_count_stddev) > self.noise_multiplier / 2:
            raise ConfigError(
                f"dp_args.clip_count_stddev={self.clip_count_stddev!r}: must be above noise_multiplier / 2 = "
                f"{self.noise_multiplier / 2:g} (the count and the gradient share sigma's budget: "
                f"(2 clip_count_stddev)^-2 + sigma_grad^-2 = sigma^-2); null: "
                f"{adaptive_clipping.DEFAULT_COUNT_STDDEV_PER_SIGMA:g} x sigma"
            )
        for key in ADAPTIVE_KEYS:
            object.__setattr__(self, key, float(getattr(self, key)))

    @property
    def clip_label(self) -> str:
        """How a log line states the clip bound."""
        if not self.adaptive:
            return f"C {self.max_grad_norm:g}"
        return f"C adaptive from {self.max_grad_norm:g} toward quantile {self.target_quantile:g} of each user's norms"

    @property
    def adaptive(self) -> bool:
        """Whether each user's clip bound adapts (``clip: adaptive``)."""
        return self.clip == ADAPTIVE

    @property
    def gradient_noise_multiplier(self) -> float:
        """The noise multiplier of a clipped gradient: sigma, or with adaptive clipping the larger
        sigma_grad that leaves the count its share of sigma's budget (core/adaptive_clipping.py)."""
        if not self.adaptive:
            return self.noise_multiplier
        assert self.clip_count_stddev is not None  # resolved in __post_init__
        return adaptive_clipping.gradient_noise_multiplier(self.noise_multiplier, self.clip_count_stddev)

    def settings(self) -> Dict[str, Any]:
        """How ``summary.json``'s ``privacy`` states the mechanism and its accountant."""
        return {
            "accountant": accounting.ACCOUNTANTS[self.accountant],
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "max_epsilon": self.max_epsilon,
            "clip": self.clip,
            **(
                {
                    "target_quantile": self.target_quantile,
                    "clip_learning_rate": self.clip_learning_rate,
                    "clip_count_stddev": self.clip_count_stddev,
                    "gradient_noise_multiplier": self.gradient_noise_multiplier,
                }
                if self.adaptive
                else {}
            ),
        }

    @property
    def noise_std(self) -> float:
        """The standard deviation of the Gaussian noise added to a clipped sum."""
        return self.noise_multiplier * self.max_grad_norm

    # -- what DP-SGD allows: every refusal it causes is asked of it here -----------------------
    def check_run(self, *, stationarity_every: int, random_iterate: bool, cross_silo: bool, own_data: bool) -> None:
        """:class:`ConfigError` for a run setting that would read a user's data outside the mechanism
        (the config's rules ask this), or keep a user's adaptive bound away from the user's silo."""
        if stationarity_every:
            raise ConfigError(
                f"validation_args.stationarity_every={stationarity_every!r} with {NAMED}: the measure reads every "
                f"user's gradients without clipping or noise; set it to 0"
            )
        if random_iterate:
            raise ConfigError(
                f"validation_args.random_iterate=True with {NAMED}: evaluating a second model each round is a "
                f"second personalization on every user's data, which the accountant does not count; set it false"
            )
        if self.adaptive and cross_silo and not own_data:
            raise ConfigError(
                "dp_args.clip='adaptive' with comm_args.silo_data='shared': each user's clip bound is a state of "
                "its own, which stays with the silo that holds the user; across silos that is data-owner mode "
                "(comm_args.silo_data: own), where each silo holds one user for the whole run"
            )

    def check_algorithm(self, name: str, refusal: Optional[str]) -> None:
        """:class:`ConfigError` where DP-SGD cannot reach algorithm ``name``'s client maths;
        ``refusal`` is the algorithm's own answer (algorithms/base.py's ``dp_refusal``), or None."""
        if refusal is not None:
            raise ConfigError(f"train_args.federated_optimizer={name!r} with {NAMED}: {refusal}")

    def check_model(self, model: str, problem: Optional[str]) -> None:
        """:class:`ConfigError` where each sample's gradient of ``model`` cannot be computed alone;
        ``problem`` is the model probe's finding (core/private_steps.py's ``per_sample_problem``)."""
        if problem is not None:
            raise ConfigError(f"{NAMED}: {model} cannot run DP-SGD: {problem}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> Optional["DPSGD"]:
        """The DP-SGD a ``dp_args`` section asks for, or None where it asks for none (disabled, or
        FedML's own ldp/cdp); :class:`ConfigError` naming the key for what cannot run."""
        solution = section.get("dp_solution_type")
        if isinstance(solution, (list, tuple)):
            raise ConfigError(
                f"dp_args.dp_solution_type={solution!r}: one solution per run: {SOLUTION!r} (DP-SGD in the "
                f"local steps) or one of FedML's 'ldp', 'cdp'"
            )
        if solution != SOLUTION:
            for key in ("noise_multiplier", "max_epsilon"):
                if key in section:
                    raise ConfigError(
                        f"dp_args.{key}={section[key]!r}: a key of dp_solution_type {SOLUTION!r}; here "
                        f"dp_solution_type={solution!r}"
                    )
            return None
        if not section.get("enable_dp"):
            raise ConfigError(
                f"dp_args.enable_dp={section.get('enable_dp')!r}: dp_solution_type {SOLUTION!r} is set; "
                f"set enable_dp true, or remove dp_solution_type"
            )
        for key in FEDML_ONLY_KEYS:
            if key in section:
                raise ConfigError(
                    f"dp_args.{key}={section[key]!r}: a key of FedML's ldp/cdp, not of {SOLUTION!r} (which "
                    f"takes {list(KEYS[2:])}); DP-SGD and FedML's DP do not run together"
                )
        unknown = sorted(set(section) - set(KEYS))
        if unknown:
            raise ConfigError(f"dp_args.{unknown[0]}={section[unknown[0]]!r}: unknown key; allowed: {list(KEYS)}")
        for key in ("noise_multiplier", "max_grad_norm", "delta"):
            if key not in section:
                raise ConfigError(f"dp_args.{key}: required with dp_solution_type {SOLUTION!r}")
        clip = section.get("clip", FIXED)
        if clip != ADAPTIVE:
            for key in ADAPTIVE_KEYS:
                if key in section:
                    raise ConfigError(
                        f"dp_args.{key}={section[key]!r}: a key of clip: {ADAPTIVE!r}; here clip={clip!r}"
                    )
        return cls(
            noise_multiplier=section["noise_multiplier"],
            max_grad_norm=section["max_grad_norm"],
            delta=section["delta"],
            max_epsilon=section.get("max_epsilon"),
            accountant=section.get("accountant", accounting.DEFAULT),
            clip=clip,
            **{key: section[key] for key in ADAPTIVE_KEYS if key in section and section[key] is not None},
        )


def sample_rate(batch_size: int, num_samples: int) -> float:
    """Poisson sampling's rate for an expected minibatch of ``batch_size`` (all data when fewer)."""
    return min(1.0, batch_size / num_samples)


def uses_per_step(step: Step) -> int:
    """The private gradients one local step computes: D (and D' in FO; D'' too in HF and exact)."""
    return step.batch_roles
