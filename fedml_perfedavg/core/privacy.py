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

The randomness (the Poisson draws and the noise) is drawn outside the maths, keyed by (seed,
round, user), so a vmapped round, one client at a time, MPI ranks and silos compute the same
numbers. FedML-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap

from . import accounting, adaptive_clipping
from .adaptive_clipping import ADAPTIVE, FIXED
from .client_maths import Step, axpy
from .errors import ConfigError
from .types import LossFn, Params

SOLUTION = "dpsgd"
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
_NORM_FLOOR = 1e-6  # a per-sample norm below this is scaled as if it were this (Opacus' choice)


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


# -- the draws: Poisson minibatches and the noise ----------------------------------------------
class PrivateBatches(NamedTuple):
    """One client's Poisson minibatches (roles, steps, cap): D, D', D'' padded to a common size
    ``cap`` with samples whose ``mask`` is 0, the noise of every use (each parameter's shape with
    (roles, steps) first, standard normal) and the expected size of each role's minibatch."""

    x: Tensor
    y: Tensor
    mask: Tensor
    noise: Dict[str, Tensor]
    expected: Tensor
    #: With adaptive clipping: the noise of each use's count (roles, steps), standard normal, and
    #: the client's bounds at the start (roles,) (core/adaptive_clipping.py); else None.
    count_noise: Optional[Tensor] = None
    clip_bounds: Optional[Tensor] = None

    @property
    def steps(self) -> int:
        return int(self.mask.shape[1])


def poisson_draw(
    num_samples: int, batch_sizes: Sequence[int], steps: int, generator: torch.Generator
) -> Tuple[Tensor, Tensor, Tensor]:
    """(index, mask, expected): for each role and step, each of ``num_samples`` samples is in
    the minibatch with probability ``sample_rate(batch_size, num_samples)``, independently; the
    chosen indices come first in a row of ``cap`` (the largest minibatch drawn), the rest padding."""
    rates = torch.tensor([sample_rate(b, num_samples) for b in batch_sizes], dtype=torch.float64)
    uniform = torch.rand(len(batch_sizes), steps, num_samples, generator=generator, dtype=torch.float64)
    chosen = uniform < rates.view(-1, 1, 1)
    counts = chosen.sum(-1)
    cap = max(1, int(counts.max()))
    # A stable sort of "not chosen" puts the chosen indices first, in increasing order.
    index = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices[..., :cap]
    mask = (torch.arange(cap).view(1, 1, -1) < counts.unsqueeze(-1)).to(torch.get_default_dtype())
    expected = (rates * num_samples).to(torch.get_default_dtype())
    return index, mask, expected


def draw_private_batches(
    x: Tensor,
    y: Tensor,
    batch_sizes: Sequence[int],
    steps: int,
    params: Params,
    generator: torch.Generator,
    clip_bounds: Optional[Tensor] = None,
) -> PrivateBatches:
    """A client's :class:`PrivateBatches` from its training data, every number from ``generator``
    (the Poisson draws first, then the noise, parameter by parameter in ``params``' order; only
    their shapes and dtypes are read; with adaptive clipping, the client's ``clip_bounds``, then
    the counts' noise last)."""
    index, mask, expected = poisson_draw(len(y), batch_sizes, steps, generator)
    noise = {
        k: torch.randn(len(batch_sizes), steps, *p.shape, generator=generator, dtype=p.dtype).to(x.device)
        for k, p in params.items()
    }
    count_noise = None
    if clip_bounds is not None:
        count_noise = torch.randn(len(batch_sizes), steps, generator=generator, dtype=torch.float64).to(x.device)
        clip_bounds = clip_bounds.to(device=x.device, dtype=torch.float64)
    device_index = index.to(x.device)
    return PrivateBatches(
        x[device_index],
        y[device_index.to(y.device)],
        mask.to(x.device),
        noise,
        expected.to(x.device),
        count_noise,
        clip_bounds,
    )


def stack_private(batches: Sequence[PrivateBatches]) -> PrivateBatches:
    """Several clients' draws stacked along a new leading client dimension, padded to one cap."""
    cap = max(b.mask.shape[-1] for b in batches)

    def pad(t: Tensor) -> Tensor:  # with copies of a sample, whose mask is 0
        extra = cap - t.shape[2]
        return t if extra == 0 else torch.cat([t, t[:, :, :1].expand(-1, -1, extra, *t.shape[3:])], dim=2)

    adaptive = batches[0].clip_bounds is not None
    return PrivateBatches(
        torch.stack([pad(b.x) for b in batches]),
        torch.stack([pad(b.y) for b in batches]),
        torch.stack([torch.nn.functional.pad(b.mask, (0, cap - b.mask.shape[-1])) for b in batches]),
        {k: torch.stack([b.noise[k] for b in batches]) for k in batches[0].noise},
        torch.stack([b.expected for b in batches]),
        torch.stack([b.count_noise for b in batches]) if adaptive else None,  # type: ignore[misc]
        torch.stack([b.clip_bounds for b in batches]) if adaptive else None,  # type: ignore[misc]
    )


# -- the mechanism -----------------------------------------------------------------------------
def sample_norms(per_sample: Params) -> Tensor:
    """Each sample's norm, all parameters together."""
    squares = sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in per_sample.values())
    return torch.sqrt(squares)  # type: ignore[arg-type]


def clip_and_sum(per_sample: Params, mask: Tensor, max_grad_norm: Union[float, Tensor]) -> Params:
    """Each sample's vector (all parameters together) scaled to norm at most ``max_grad_norm``,
    the samples with ``mask`` 1 summed."""
    norms = sample_norms(per_sample)
    scale = torch.clamp(max_grad_norm / torch.clamp(norms, min=_NORM_FLOOR), max=1.0) * mask
    return {k: torch.tensordot(scale, v, dims=1) for k, v in per_sample.items()}


def privatize(per_sample: Params, mask: Tensor, noise: Params, expected: Tensor, dp: DPSGD) -> Params:
    """One use of the subsampled Gaussian mechanism: (clipped sum + sigma C noise) / expected size."""
    summed = clip_and_sum(per_sample, mask, dp.max_grad_norm)
    return {k: (v + dp.noise_std * noise[k]) / expected for k, v in summed.items()}


class _Bounds:
    """A use's clip bound, and with adaptive clipping each role's bound moved after each use
    (core/adaptive_clipping.py); ``bounds``: (roles,) or (clients, roles), or None for fixed C."""

    def __init__(self, dp: DPSGD, batches: PrivateBatches) -> None:
        self.dp = dp
        self.adaptive = batches.clip_bounds is not None
        if self.adaptive != dp.adaptive:
            raise ValueError(f"dp_args.clip={dp.clip!r}, but the minibatches were drawn for the other mode")
        self.bounds = None if batches.clip_bounds is None else batches.clip_bounds.clone()
        self.count_noise, self.expected = batches.count_noise, batches.expected

    def of(self, role: int, dtype: torch.dtype) -> Union[float, Tensor]:
        """The bound of ``role``'s use now: C, or the client's (each client's: (clients,))."""
        return self.dp.max_grad_norm if self.bounds is None else self.bounds[..., role].to(dtype)

    def noise_std(self, bound: Union[float, Tensor]) -> Union[float, Tensor]:
        """The noise's standard deviation of a use clipped at ``bound``."""
        return self.dp.noise_std if self.bounds is None else self.dp.gradient_noise_multiplier * bound

    def after_use(self, norms: Tensor, mask: Tensor, role: int, t: int) -> None:
        """Move ``role``'s bound by the use's noised count of the samples at most at it."""
        if self.bounds is None:
            return
        assert self.count_noise is not None and self.dp.clip_count_stddev is not None
        self.bounds[..., role] = adaptive_clipping.updated_bounds(
            self.bounds[..., role],
            norms,
            mask,
            self.count_noise[..., role, t],
            self.expected[..., role],
            self.dp.clip_count_stddev,
            self.dp.target_quantile,
            self.dp.clip_learning_rate,
        )


def single_sample_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` on one sample (its input and label without a batch dimension)."""
    return lambda params, x, y: loss_fn(params, x.unsqueeze(0), y.unsqueeze(0))


class PrivateSteps:
    """The local step's arithmetic (:class:`~fedml_perfedavg.core.client_maths.StepArithmetic`)
    with every gradient on private data a use of the mechanism: per-sample gradients vectorized
    by ``torch.func.vmap`` over the Poisson minibatch, clipped, summed and noised."""

    def __init__(self, loss_fn: LossFn, batches: PrivateBatches, kind: Step, dp: DPSGD, forward_ad: bool = True):
        self.kind, self.batches, self.dp, self.forward_ad = kind, batches, dp, forward_ad
        self.sample_grad = grad(single_sample_loss(loss_fn))
        self.per_sample = vmap(self.sample_grad, in_dims=(None, 0, 0))
        self.clip = _Bounds(dp, batches)

    @property
    def bounds(self) -> Optional[Tensor]:
        """The client's adaptive bounds now (roles,), or None for a fixed C."""
        return self.clip.bounds

    def _use(self, per_sample: Params, role: int, t: int) -> Params:
        b = self.batches
        noise = {k: v[role, t] for k, v in b.noise.items()}
        mask = b.mask[role, t]
        if not self.clip.adaptive:
            return privatize(per_sample, mask, noise, b.expected[role], self.dp)
        norms = sample_norms(per_sample)
        bound = self.clip.of(role, norms.dtype)
        summed = clip_and_sum(per_sample, mask, bound)
        std = self.clip.noise_std(bound)
        self.clip.after_use(norms, mask, role, t)
        return {k: (v + std * noise[k]) / b.expected[role] for k, v in summed.items()}

    def start(self, params: Params) -> Params:
        return params

    def gradient(self, point: Params, role: int, t: int) -> Params:
        return self._use(self.per_sample(point, self.batches.x[role, t], self.batches.y[role, t]), role, t)

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        return axpy(-alpha, gradient, w)

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        """D'''s per-sample second-order term, clipped and noised as one vector: HF's central
        difference of per-sample gradients at w +- delta g, or exact's Hessian-vector product."""
        x, y = self.batches.x[2, t], self.batches.y[2, t]
        if self.kind is Step.HF:
            plus = self.per_sample(axpy(delta, g, w), x, y)
            minus = self.per_sample(axpy(-delta, g, w), x, y)
            per_sample = {k: (plus[k] - minus[k]) / (2.0 * delta) for k in plus}
        else:
            sample_grad = self.sample_grad
            if self.forward_ad:

                def hvp(xi: Tensor, yi: Tensor) -> Params:
                    return jvp(lambda p: sample_grad(p, xi, yi), (w,), (g,))[1]

            else:  # reverse over reverse, for operators without a forward-mode derivative

                def hvp(xi: Tensor, yi: Tensor) -> Params:
                    with torch.enable_grad():
                        return vjp(lambda p: sample_grad(p, xi, yi), w)[1](g)[0]

            per_sample = vmap(hvp)(x, y)
        return self._use(per_sample, 2, t)

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params:
        return axpy(-alpha, hessian_g, g)

    def move(self, w: Params, direction: Params, beta: float) -> Params:
        return axpy(-beta, direction, w)


class PrivateChainSteps:
    """:class:`PrivateSteps`' mechanism for a chain of Linear layers and activations
    (:class:`~fedml_perfedavg.core.hand_batched.HandBatchedGradients`), for every client of a round
    at once (parameters, and every tensor of ``batches``, client first). A sample's gradient of a
    Linear layer is the outer product of the signal at its output and its input, so its norm is
    the product of theirs and the clipped sum is one matrix product: per-sample gradients are
    never formed (the "ghost clipping" of Goodfellow 2015; Li et al. 2022). HF's finite
    difference of two such outer products, u+ a+^T - u- a-^T = (u+ - u-) a+^T + u- (a+ - a-)^T,
    has its norm from differences that stay small, never from two large numbers' difference."""

    def __init__(self, chain: Any, batches: PrivateBatches, kind: Step, dp: DPSGD) -> None:
        if kind is Step.EXACT:
            raise ValueError("the chain's private steps have no per-sample Hessian-vector product: use PrivateSteps")
        self.kind: Step = kind
        self.chain, self.batches, self.dp = chain, batches, dp
        self.layers = chain.layers

        # (roles, steps, clients, ...): each use reads contiguous (clients, ...) blocks, not strided ones
        def step_major(t: Tensor) -> Tensor:
            return t.movedim(0, 2).contiguous()

        self.x, self.y, self.mask = step_major(batches.x), step_major(batches.y), step_major(batches.mask)
        self.noise = {k: step_major(v) for k, v in batches.noise.items()}
        self.clip = _Bounds(dp, batches)
        self._noise_std: Union[float, Tensor] = dp.noise_std  # of the use being computed

    @property
    def bounds(self) -> Optional[Tensor]:
        """Each client's adaptive bounds now (clients, roles), or None for a fixed C."""
        return self.clip.bounds

    def _signals(self, params: Params, x: Tensor, y: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """Each Linear layer's inputs (C, B, in) and each sample's own loss gradient at its output
        (C, B, out): the backward pass of the summed, not the mean, loss."""
        inputs, pre, logits = self.chain._forward(params, x.reshape(x.shape[0], x.shape[1], -1))
        signal = torch.softmax(logits, dim=-1) - torch.nn.functional.one_hot(y, logits.shape[-1]).to(logits.dtype)
        signals: List[Tensor] = [signal] * len(self.layers)
        for position in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[position]
            if layer.activation is not None:
                output = inputs[position + 1] if position + 1 < len(inputs) else logits
                signal = layer.activation.backward(signal, pre[position], output)
            signals[position] = signal
            if position > 0:
                signal = torch.bmm(signal, params[layer.weight])
        return inputs, signals

    def _scale(self, squared_norms: Tensor, role: int, t: int, divide: float = 1.0) -> Tensor:
        """Each sample's clip factor (clients, B, 1) of a use (the samples' squared norms); with
        adaptive clipping, each client's bound moved after it."""
        norms = torch.sqrt(torch.clamp(squared_norms, min=0.0))
        bound = self.clip.of(role, norms.dtype)
        per_client = bound.unsqueeze(-1) if isinstance(bound, Tensor) else bound
        clip = torch.clamp(per_client / torch.clamp(norms, min=_NORM_FLOOR), max=1.0)
        self._noise_std = self.clip.noise_std(bound)
        self.clip.after_use(norms, self.mask[role, t], role, t)
        return (clip * self.mask[role, t] / divide).unsqueeze(-1)

    def _noised(self, summed: Params, role: int, t: int) -> Params:
        expected = self.batches.expected[:, role]
        std = self._noise_std
        out = {}
        for k, v in summed.items():  # (sum + sigma C noise) / expected size, in the sum's own tensor
            shape = (-1, *([1] * (v.dim() - 1)))
            if isinstance(std, Tensor):  # each client's own bound
                v.addcmul_(self.noise[k][role, t], std.view(shape))
            else:
                v.add_(self.noise[k][role, t], alpha=std)
            out[k] = v.div_(expected.view(shape))
        return out

    def start(self, params: Params) -> Params:
        return params

    def gradient(self, point: Params, role: int, t: int) -> Params:
        inputs, signals = self._signals(point, self.x[role, t], self.y[role, t])
        squares = [s.pow(2).sum(-1) for s in signals]
        total = sum(
            sq * (a.pow(2).sum(-1) + (1.0 if layer.bias is not None else 0.0))
            for layer, a, sq in zip(self.layers, inputs, squares)
        )
        scale = self._scale(total, role, t)  # type: ignore[arg-type]
        summed: Params = {}
        for layer, a, s in zip(self.layers, inputs, signals):
            weighted = s * scale
            summed[layer.weight] = torch.bmm(weighted.transpose(1, 2), a)
            if layer.bias is not None:
                summed[layer.bias] = weighted.sum(1)
        return self._noised(summed, role, t)

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        return axpy(-alpha, gradient, w)

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        x, y = self.x[2, t], self.y[2, t]
        plus_inputs, plus = self._signals(axpy(delta, g, w), x, y)
        minus_inputs, minus = self._signals(axpy(-delta, g, w), x, y)
        total: Any = 0.0
        parts = []
        for position, layer in enumerate(self.layers):
            d_signal = plus[position] - minus[position]
            a = plus_inputs[position]
            d_input = None if position == 0 else a - minus_inputs[position]  # the data itself does not move
            squared = d_signal.pow(2).sum(-1) * (a.pow(2).sum(-1) + (1.0 if layer.bias is not None else 0.0))
            if d_input is not None:
                squared = (
                    squared
                    + minus[position].pow(2).sum(-1) * d_input.pow(2).sum(-1)
                    + 2.0 * (d_signal * minus[position]).sum(-1) * (a * d_input).sum(-1)
                )
            total = total + squared
            parts.append((layer, d_signal, a, minus[position], d_input))
        scale = self._scale(total / (4.0 * delta * delta), 2, t, divide=2.0 * delta)
        summed: Params = {}
        for layer, d_signal, a, minus_signal, d_input in parts:
            weighted = d_signal * scale
            summed[layer.weight] = torch.bmm(weighted.transpose(1, 2), a)
            if d_input is not None:
                summed[layer.weight].baddbmm_((minus_signal * scale).transpose(1, 2), d_input)
            if layer.bias is not None:
                summed[layer.bias] = weighted.sum(1)
        return self._noised(summed, 2, t)

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params:
        return axpy(-alpha, hessian_g, g)

    def move(self, w: Params, direction: Params, beta: float) -> Params:
        return axpy(-beta, direction, w)


def one_client(batches: PrivateBatches) -> PrivateBatches:
    """One client's draws with a client dimension of one in front (for :class:`PrivateChainSteps`)."""
    return PrivateBatches(
        batches.x.unsqueeze(0),
        batches.y.unsqueeze(0),
        batches.mask.unsqueeze(0),
        {k: v.unsqueeze(0) for k, v in batches.noise.items()},
        batches.expected.unsqueeze(0),
        None if batches.count_noise is None else batches.count_noise.unsqueeze(0),
        None if batches.clip_bounds is None else batches.clip_bounds.unsqueeze(0),
    )


def private_local_update(
    loss_fn: LossFn,
    params: Params,
    batches: PrivateBatches,
    config: Any,
    dp: DPSGD,
    chain: Any = None,
    forward_ad: bool = True,
) -> Params:
    """One client's DP-SGD local update (``config``: a LocalUpdateConfig): by the chain's outer
    products where ``chain`` is given and the step is not exact, else per-sample by torch.func."""
    return private_update(loss_fn, params, batches, config, dp, chain, forward_ad)[0]


def private_update(
    loss_fn: LossFn,
    params: Params,
    batches: PrivateBatches,
    config: Any,
    dp: DPSGD,
    chain: Any = None,
    forward_ad: bool = True,
) -> Tuple[Params, Optional[Tensor]]:
    """:func:`private_local_update`, and the client's adaptive clip bounds after it (roles,), or
    None for a fixed C."""
    from .client_maths import run_steps

    if chain is not None and config.step is not Step.EXACT:
        start = {k: v.unsqueeze(0) for k, v in params.items()}
        steps = PrivateChainSteps(chain, one_client(batches), config.step, dp)
        out = run_steps(steps, start, config)
        return {k: v[0] for k, v in out.items()}, None if steps.bounds is None else steps.bounds[0]
    generic = PrivateSteps(loss_fn, batches, config.step, dp, forward_ad)
    return run_steps(generic, params, config), generic.bounds


def private_sgd_steps(
    loss_fn: LossFn, params: Params, batches: PrivateBatches, alpha: float, dp: DPSGD, chain: Any = None
) -> Params:
    """SGD steps of size ``alpha`` whose gradients are uses of the mechanism (role 0 of
    ``batches``, one step per step): the personalization step of a private evaluation."""
    config = _SGDSteps(batches.steps, alpha)
    return private_local_update(loss_fn, params, batches, config, dp, chain)


@dataclass(frozen=True)
class _SGDSteps:
    """What run_steps reads of a LocalUpdateConfig, for plain SGD steps of size ``beta``."""

    local_steps: int
    beta: float
    alpha: float = 0.0
    delta: float = 0.0
    step: Step = Step.SGD


def per_sample_problem(
    network: torch.nn.Module, loss_fn: LossFn, params: Params, x: Tensor, y: Tensor
) -> Optional[str]:
    """Why per-sample gradients of the model cannot be computed (BatchNorm, which mixes a
    minibatch's samples; a model vmap cannot batch over samples), or None."""
    norms = [type(m).__name__ for m in network.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:
        return (
            f"the model has {norms[0]}, which normalizes each sample with its minibatch's statistics: a "
            f"sample's gradient depends on the others, so it cannot be clipped alone (use GroupNorm or "
            f"LayerNorm)"
        )
    try:
        vmap(grad(single_sample_loss(loss_fn)), in_dims=(None, 0, 0))(params, x[:2], y[:2])
    except Exception as err:  # noqa: BLE001 - whatever vmap raises is the reason
        return f"torch.func.vmap cannot compute its per-sample gradients: {type(err).__name__}: {err}"
    return None
