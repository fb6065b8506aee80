"""DP-SGD's mechanism inside the local steps: every gradient on a user's private data is one use
of the subsampled Gaussian mechanism, each sample's part clipped (to C, or the user's adaptive bound:
core/adaptive_clipping.py), summed, noised and divided by the expected minibatch size, as the local
step's arithmetic (:class:`~fedml_perfedavg.core.client_maths.StepArithmetic`): per-sample gradients
by ``torch.func`` (:class:`PrivateSteps`), or a Linear chain's outer products for a round's clients at
once (:class:`PrivateChainSteps`). The draws it reads are core/private_draws.py's; the policy
core/privacy.py's. FedML-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap

from . import adaptive_clipping
from .client_maths import Step, axpy
from .private_draws import PrivateBatches, PrivateInputs, one_client
from .privacy import DPSGD
from .types import LossFn, Params

_NORM_FLOOR = 1e-6  # a per-sample norm below this is scaled as if it were this (Opacus' choice)


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
        self.x = batches.gathered_x()
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
        return self._use(self.per_sample(point, self.x[role, t], self.batches.y[role, t]), role, t)

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        return axpy(-alpha, gradient, w)

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        """D'''s per-sample second-order term, clipped and noised as one vector: HF's central
        difference of per-sample gradients at w +- delta g, or exact's Hessian-vector product."""
        x, y = self.x[2, t], self.batches.y[2, t]
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


class _Buffers:
    """Parameter-shaped tensors the chain's private steps write their results into and take back
    once the loop has passed a result on (its protocol: core/client_maths.StepArithmetic). A fresh
    tensor of the first layer's size is new memory from the system each time (page faults: 1.4 ms
    for an update whose arithmetic takes 0.1), so the step reuses a handful."""

    def __init__(self) -> None:
        self.free: List[Params] = []
        self.owned: Set[int] = set()

    def take(self, like: Params) -> Params:
        """Tensors of ``like``'s shapes and dtypes (a spare set, else new ones)."""
        buffers = (
            self.free.pop()
            if self.free
            else {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in like.items()}
        )
        self.owned.add(id(buffers))
        return buffers

    def give(self, buffers: Params) -> None:
        """``buffers`` back to the pool, where they are one of its own (the loop's starting point is not)."""
        if id(buffers) in self.owned:
            self.owned.discard(id(buffers))
            self.free.append(buffers)


class PrivateChainSteps:
    """:class:`PrivateSteps`' mechanism for a chain of Linear layers and activations
    (:class:`~fedml_perfedavg.core.hand_batched.HandBatchedGradients`), for every client of a round
    at once (parameters, and every tensor of ``batches``, client first). A sample's gradient of a
    Linear layer is the outer product of the signal at its output and its input, so its norm is
    the product of theirs and the clipped sum is one matrix product: per-sample gradients are
    never formed (the "ghost clipping" of Goodfellow 2015; Li et al. 2022). HF's finite
    difference of two such outer products, u+ a+^T - u- a-^T = (u+ - u-) a+^T + u- (a+ - a-)^T,
    has its norm from differences that stay small, never from two large numbers' difference.
    Exact's per-sample Hessian-vector product has the same form: Pearlmutter's R-operator through
    the chain gives each layer's R(dW) = R(delta) a^T + delta R(a)^T, two outer products a sample
    (:meth:`~fedml_perfedavg.core.hand_batched.HandBatchedGradients.per_sample_hessian_terms`),
    clipped by the same norm."""

    def __init__(self, chain: Any, batches: PrivateBatches, kind: Step, dp: DPSGD) -> None:
        self.kind: Step = kind
        self.chain, self.batches, self.dp = chain, batches, dp
        self.layers = chain.layers

        # (roles, steps, clients, ...): each use reads contiguous (clients, ...) blocks, not strided ones
        # (no copy where the draws were stacked so: private_draws.stack_private)
        def step_major(t: Tensor) -> Tensor:
            return t.movedim(0, 2).contiguous()

        self.y, self.mask = step_major(batches.y), step_major(batches.mask)
        self._lazy: Optional[PrivateInputs] = None
        self._x_buffer: Optional[Tensor] = None
        if isinstance(batches.x, PrivateInputs):  # gathered use by use, into one buffer (inputs)
            self._lazy = batches.x
        else:
            self.x = step_major(batches.x)
        self.noise = {k: step_major(v) for k, v in batches.noise.items()}
        self.clip = _Bounds(dp, batches)
        self._noise_std: Union[float, Tensor] = dp.noise_std  # of the use being computed
        self._buffers = _Buffers()

    @property
    def bounds(self) -> Optional[Tensor]:
        """Each client's adaptive bounds now (clients, roles), or None for a fixed C."""
        return self.clip.bounds

    def _inputs(self, role: int, t: int) -> Tensor:
        """Use (role, t)'s inputs (clients, cap, ...); valid until the next use's are asked for."""
        if self._lazy is None:
            return self.x[role, t]
        self._x_buffer = self._lazy.use(role, t, self._x_buffer)
        return self._x_buffer

    def _input_norms(self, role: int, t: int) -> Optional[Tensor]:
        """Use (role, t)'s samples' squared input norms (clients, cap), where the draws know them."""
        return None if self._lazy is None else self._lazy.use_norms(role, t)

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

    def _clipped_sum(
        self,
        terms: Sequence[Tuple[Any, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]],
        role: int,
        t: int,
        like: Params,
        squared_divisor: Optional[float] = None,
        divide: float = 1.0,
        input_norms: Optional[Tensor] = None,
    ) -> Params:
        """One use of the mechanism on each sample's vector, given per Linear layer as (layer, s1,
        a1, s2, a2): its weight part s1 a1^T + s2 a2^T (one outer product where a2 is None) and
        its bias part s1. Each sample's squared norm from the vectors' norms and two inner
        products (divided by ``squared_divisor``: HF's (2 delta)^2), never the vector itself;
        clipped (:meth:`_scale`, ``divide``), summed into a reused buffer shaped as ``like``, noised.
        ``input_norms``: the first term's a1 squared norms (the use's inputs'), where known."""
        total: Any = 0.0
        for position, (layer, s1, a1, s2, a2) in enumerate(terms):
            a1_squared = input_norms if position == 0 and input_norms is not None else a1.pow(2).sum(-1)
            squared = s1.pow(2).sum(-1) * (a1_squared + (1.0 if layer.bias is not None else 0.0))
            if s2 is not None and a2 is not None:
                squared = squared + s2.pow(2).sum(-1) * a2.pow(2).sum(-1) + 2.0 * (s1 * s2).sum(-1) * (a1 * a2).sum(-1)
            total = total + squared
        scale = self._scale(total if squared_divisor is None else total / squared_divisor, role, t, divide=divide)
        summed = self._buffers.take(like)
        for layer, s1, a1, s2, a2 in terms:
            weighted = s1 * scale
            torch.bmm(weighted.transpose(1, 2), a1, out=summed[layer.weight])
            if s2 is not None and a2 is not None:
                summed[layer.weight].baddbmm_((s2 * scale).transpose(1, 2), a2)
            if layer.bias is not None:
                torch.sum(weighted, 1, out=summed[layer.bias])
        return self._noised(summed, role, t)

    def start(self, params: Params) -> Params:
        return params

    def gradient(self, point: Params, role: int, t: int) -> Params:
        inputs, signals = self._signals(point, self._inputs(role, t), self.y[role, t])
        if role == 1:  # the adapted point: read for the last time
            self._buffers.give(point)
        terms = [(layer, s, a, None, None) for layer, s, a in zip(self.layers, signals, inputs)]
        return self._clipped_sum(terms, role, t, point, input_norms=self._input_norms(role, t))

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        return axpy(-alpha, gradient, w, out=gradient)

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        if self.kind is Step.EXACT:
            return self._exact_hessian_times(w, g, t)
        x, y = self._inputs(2, t), self.y[2, t]
        points = self._buffers.take(w), self._buffers.take(w)
        # w + delta g and w - delta g with axpy's two roundings, from one product: delta g and
        # -delta g round to the same magnitude, so w - (delta g) is w + (-delta g), bit for bit
        for k in w:
            shift = torch.mul(g[k], delta, out=points[1][k])
            torch.add(w[k], shift, out=points[0][k])
            torch.sub(w[k], shift, out=points[1][k])
        plus_inputs, plus = self._signals(points[0], x, y)
        minus_inputs, minus = self._signals(points[1], x, y)
        for point in points:  # the signals hold what the rest reads of them
            self._buffers.give(point)
        terms = []
        for position, layer in enumerate(self.layers):
            a = plus_inputs[position]
            d_input = None if position == 0 else a - minus_inputs[position]  # the data itself does not move
            terms.append((layer, plus[position] - minus[position], a, minus[position], d_input))
        return self._clipped_sum(
            terms, 2, t, w, squared_divisor=4.0 * delta * delta, divide=2.0 * delta, input_norms=self._input_norms(2, t)
        )

    def _exact_hessian_times(self, w: Params, g: Params, t: int) -> Params:
        """D'''s per-sample Hessian-vector products H_i g, each clipped by its norm over all
        parameters, summed and noised: the norm of R(delta) a^T + delta R(a)^T (and R(delta)
        for a bias) from the four vectors' norms and two inner products, never formed."""
        inputs, deltas, r_deltas, r_inputs = self.chain.per_sample_hessian_terms(w, g, self._inputs(2, t), self.y[2, t])
        terms = list(zip(self.layers, r_deltas, inputs, deltas, r_inputs))
        return self._clipped_sum(terms, 2, t, w, input_norms=self._input_norms(2, t))

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params:
        corrected = axpy(-alpha, hessian_g, g, out=hessian_g)
        self._buffers.give(g)
        return corrected

    def move(self, w: Params, direction: Params, beta: float) -> Params:
        moved = axpy(-beta, direction, w, out=direction)
        self._buffers.give(w)
        return moved


def private_update(
    loss_fn: LossFn,
    params: Params,
    batches: PrivateBatches,
    config: Any,
    dp: DPSGD,
    chain: Any = None,
    forward_ad: bool = True,
) -> Tuple[Params, Optional[Tensor]]:
    """One client's DP-SGD local update (``config``: a LocalUpdateConfig), by the chain's outer
    products where ``chain`` is given, else per-sample by torch.func; and the client's adaptive
    clip bounds after it (roles,), or None for a fixed C."""
    from .client_maths import run_steps

    if chain is not None:
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
    return private_update(loss_fn, params, batches, config, dp, chain)[0]


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
