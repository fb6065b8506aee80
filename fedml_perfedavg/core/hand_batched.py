"""Hand-batched gradients for a chain of Linear layers and elementwise activations.

The batched engine's round is thousands of tiny operators when ``torch.func`` vmaps a generic
network; for a plain chain (``Flatten``, ``Linear``, ``ELU``/``ReLU``/``Tanh``/``Sigmoid``, as
the paper's MLP) the forward and backward pass of every client of a round is a handful of
batched matrix products instead (``torch.bmm`` over a leading client dimension). The exact
variant's Hessian-vector product is written out too (Pearlmutter's R-operator,
:meth:`HandBatchedGradients.hessian_vector_product`); the gradients are plain differentiable
PyTorch, so ``torch.func.jvp`` of them gives the same (the tests compare both with torch.func).

:func:`hand_batched_gradients` accepts a network only if it is an ``nn.Sequential`` (or
wraps exactly one) whose leaves form such a chain, and its output equals the chain's on a
probe input; otherwise it says why, and the engine
keeps the generic path. The loss is the plugin's (mean cross-entropy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .client_maths import LocalBatches, LocalUpdateConfig, Step, StepFigures, run_steps
from .functional import logits_of, parameters_of
from .types import Params, gather_inputs, input_dtype


@dataclass(frozen=True)
class Activation:
    """An elementwise activation s, as the hand-written passes need it. Each takes the upstream
    gradient ``d`` (any shape), the pre-activation ``z`` and the output ``h = s(z)`` (same shape)."""

    forward: Callable[[Tensor], Tensor]  # z -> s(z)
    backward: Callable[[Tensor, Tensor, Tensor], Tensor]  # (d, z, h) -> d * s'(z), PyTorch's fused kernel
    curvature: Callable[[Tensor, Tensor, Tensor], Tensor]  # (d, z, h) -> d * s''(z), exact HVP; may write into d
    # (z, h) -> s'(z) as a tensor whose product with any contiguous float32/64 d of its shape is
    # backward(d, z, h) bit for bit; None where the backward kernel's own arithmetic has no such factor
    slope: Optional[Callable[[Tensor, Tensor], Tensor]] = None


# The backward passes call PyTorch's own fused backward kernels (aten.*_backward: one kernel
# instead of several elementwise ops, with forward-mode derivatives of their own, so jvp over
# these gradients works). Their schemas, from aten/src/ATen/native/native_functions.yaml:
#   elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result): with
#     is_result=False, self_or_result is the input z and the result is d * elu'(z)
#   threshold_backward(grad_output, self, threshold): d where z > threshold, else 0 (ReLU's)
#   tanh_backward(grad_output, output), sigmoid_backward(grad_output, output): from the output h
def _activation(module: nn.Module) -> Optional[Activation]:
    aten = torch.ops.aten
    if type(module) is nn.ELU:
        alpha = float(module.alpha)

        def backward(d: Tensor, z: Tensor, h: Tensor) -> Tensor:
            return aten.elu_backward(d, alpha=alpha, scale=1, input_scale=1, is_result=False, self_or_result=z)

        # z <= 0: s = alpha (e^z - 1), s' = s'' = alpha e^z = h + alpha; z > 0: s'' = 0
        return Activation(
            forward=lambda z: F.elu(z, alpha),
            backward=backward,
            curvature=lambda d, z, h: _zero_where_positive(d.mul_(h + alpha), z),  # d: the caller's temporary
            # The kernel computes d * input_scale * alpha * exp(z * input_scale) for z <= 0 and
            # d * scale above: with every factor 1 that is d * exp(z) and d, exactly d times its
            # value at d = 1 (the same exp, element by element, for operands of one layout).
            slope=(lambda z, h: backward(torch.ones_like(z), z, h)) if alpha == 1.0 else None,
        )
    if type(module) is nn.ReLU:
        return Activation(
            forward=torch.relu,
            backward=lambda d, z, h: aten.threshold_backward(d, z, threshold=0),
            curvature=lambda d, z, h: torch.zeros_like(d),
        )
    if type(module) is nn.Tanh:
        return Activation(
            forward=torch.tanh,
            backward=lambda d, z, h: aten.tanh_backward(d, output=h),
            curvature=lambda d, z, h: -2.0 * d * h * (1.0 - h * h),
        )
    if type(module) is nn.Sigmoid:
        return Activation(
            forward=torch.sigmoid,
            backward=lambda d, z, h: aten.sigmoid_backward(d, output=h),
            curvature=lambda d, z, h: d * h * (1.0 - h) * (1.0 - 2.0 * h),
        )
    return None


# Integer types of a float type's width: viewed as these, a float is masked by bits.
_SAME_WIDTH_INTEGER = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _zero_where_positive(value: Tensor, z: Tensor) -> Tensor:
    """``torch.where(z > 0, 0.0, value)``, bit for bit (+0.0 where z > 0, ``value`` elsewhere, NaN z
    included), written into ``value``: an AND of its bits with a mask of all ones or all zeros.
    torch.where's CPU kernel is scalar; this is vectorized integer work, about 40% less time
    on the exact variant's (clients, batch, width) tensors."""
    integer = _SAME_WIDTH_INTEGER.get(value.dtype)
    if (
        integer is None
        or value.requires_grad
        or z.dtype != value.dtype
        or z.shape != value.shape
        or not value.is_contiguous()
    ):
        return torch.where(z > 0, 0.0, value)
    keep = torch.gt(z, 0, out=torch.empty(z.shape, dtype=integer, device=z.device)).sub_(1)  # 0 or -1 (all ones)
    value.view(integer).bitwise_and_(keep)
    return value


@dataclass(frozen=True)
class _Layer:
    weight: str
    bias: Optional[str]
    activation: Optional[Activation]

    def add_gradients(
        self,
        grads: Dict[str, Tensor],
        delta: Tensor,
        inputs: Tensor,
        out: Optional[Params] = None,
        deferred: Optional[List["WeightProduct"]] = None,
    ) -> None:
        """This Linear layer's gradients into ``grads`` (written into ``out``'s tensors where
        given), from the gradient at its pre-activation ``delta`` (C, B, out) and its inputs
        (C, B, in): dW = delta^T x, db = sum over the batch. With ``deferred``, dW is not taken
        but appended to it as a :class:`WeightProduct` (the step folds it into its update)."""
        if deferred is None:
            grads[self.weight] = _weight_product(delta, inputs, _slot(out, self.weight))
        else:
            deferred.append(WeightProduct(delta, inputs))
        if self.bias is not None:
            grads[self.bias] = torch.sum(delta, dim=1, out=_slot(out, self.bias))


class WeightProduct(NamedTuple):
    """A Linear layer's weight gradient delta^T x (C, out, in) not yet taken: the buffered step
    takes it inside its move, w + s (delta^T x), as one matrix product with MKL's alpha and beta
    (:func:`folded_update_is_exact`) instead of a product and two passes over the buffers."""

    delta: Tensor  # (C, B, out)
    inputs: Tensor  # (C, B, in)

    def add_to(self, target: Tensor, scale: float) -> Tensor:
        """``target`` + ``scale`` (delta^T x), in place and in ``target``'s layout; the bits of the
        product, then a multiplication, then a sum, where :func:`folded_update_is_exact` says so."""
        if _stored_transposed(target):  # a contiguous (C, in, out) block: x^T delta there
            target.transpose(1, 2).baddbmm_(self.inputs.transpose(1, 2), self.delta, alpha=scale)
        else:
            target.baddbmm_(self.delta.transpose(1, 2), self.inputs, alpha=scale)
        return target


def folded_update_is_exact(
    clients: int, batch: int, inputs: int, outputs: int, dtype: torch.dtype, scales: Sequence[float], transposed: bool
) -> bool:
    """Whether :meth:`WeightProduct.add_to` gives, for these shapes and step sizes, the bits of the
    product taken alone, multiplied by the scale and added (what the flat buffers' update does):
    MKL's epilogue scales and adds after its sum, on the machines measured; a kernel that fuses
    the two (an FMA) would round once, and the step then keeps the separate passes."""
    generator = torch.Generator().manual_seed(1)
    x, delta, base = (
        torch.randn(shape, generator=generator, dtype=dtype)
        for shape in ((clients, batch, inputs), (clients, batch, outputs), (clients, outputs, inputs))
    )
    product = WeightProduct(delta, x)

    def fresh(values: Tensor) -> Tensor:  # a tensor of the layout the step keeps the weight in
        return values.transpose(1, 2).contiguous().transpose(1, 2) if transposed else values.clone()

    return all(
        torch.equal(product.add_to(fresh(base), scale), torch.bmm(delta.transpose(1, 2), x).mul_(scale).add_(base))
        for scale in scales
    )


class _StepInputs:
    """A local update's inputs by (role, step): slices of gathered tensors, or gathered a step at
    a time (:class:`IndexedInputs`) into one buffer per role."""

    def __init__(self, batches: LocalBatches, buffers: Dict[tuple, Tensor]) -> None:
        self.roles = (batches.x, batches.second_x, batches.third_x)
        self.buffers = buffers  # kept by the caller from call to call, by role and shape

    def get(self, role: int, t: int) -> Tensor:
        inputs = self.roles[role]
        if not isinstance(inputs, IndexedInputs):
            return inputs[t]
        data = inputs.data
        key = (role, inputs.index[t].numel(), tuple(data.shape[1:]), data.dtype, data.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty((key[1], *data.shape[1:]), dtype=input_dtype(data), device=data.device)
        return inputs.step(t, self.buffers[key])


class _LayerDerivative:
    """d -> d * s'(z) at one layer, for the several signals the exact HVP sends back through it:
    the activation's backward kernel each time, or, where the activation offers its slope, that
    slope computed once and multiplied (the same bits, :attr:`Activation.slope`)."""

    def __init__(self, activation: Activation, z: Tensor, h: Tensor) -> None:
        self.activation, self.z, self.h = activation, z, h
        # float32/64 only: for half types the kernel rounds d * s'(z) once, d * (s'(z) rounded) twice
        slope = activation.slope
        usable = slope is not None and z.is_contiguous() and z.dtype in (torch.float32, torch.float64)
        self.slope = slope(z, h) if usable and slope is not None else None

    def __call__(self, d: Tensor) -> Tensor:
        slope = self.slope
        if slope is not None and d.is_contiguous() and d.shape == slope.shape and d.dtype == slope.dtype:
            return d * slope
        return self.activation.backward(d, self.z, self.h)


def _slot(out: Optional[Params], name: str) -> Optional[Tensor]:
    return None if out is None else out[name]


def _stored_transposed(slot: Optional[Tensor]) -> bool:
    """Whether ``slot`` (C, out, in) is the transposed view of a contiguous (C, in, out) buffer
    (:class:`_FlatLayout`'s first-layer weight)."""
    return slot is not None and not slot.is_contiguous() and slot.transpose(1, 2).is_contiguous()


def _weight_product(delta: Tensor, inputs: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """delta^T x (C, out, in), a Linear layer's weight gradient; into a slot stored transposed as
    x^T delta, the same numbers (:func:`transposed_storage_is_exact` checks that on this CPU)."""
    if _stored_transposed(out):
        assert out is not None
        torch.bmm(inputs.transpose(1, 2), delta, out=out.transpose(1, 2))
        return out
    return torch.bmm(delta.transpose(1, 2), inputs, out=out)


def transposed_storage_is_exact(clients: int, batch: int, inputs: int, outputs: int, dtype: torch.dtype) -> bool:
    """Whether a first-layer weight kept as a contiguous (C, in, out) buffer (its transpose) gives
    the same bits as the (C, out, in) layout in every product the local update takes of it: the
    forward x W^T with and without a bias, and the weight gradient (x^T delta for delta^T x). It
    does with MKL on the AVX-512 machines measured, and the forward is then about 1.4x faster (a
    contiguous right operand); where a CPU's kernels differ, the plain layout is kept."""
    generator = torch.Generator().manual_seed(0)
    x, weight, delta, bias = (
        torch.randn(shape, generator=generator, dtype=dtype)
        for shape in (
            (clients, batch, inputs),
            (clients, outputs, inputs),
            (clients, batch, outputs),
            (clients, 1, outputs),
        )
    )
    stored = weight.transpose(1, 2).contiguous()  # what the buffer holds; `weight` is its view as the layout's
    gradient = torch.empty_like(stored)
    return (
        torch.equal(torch.bmm(x, weight.transpose(1, 2)), torch.bmm(x, stored))
        and torch.equal(torch.baddbmm(bias, x, weight.transpose(1, 2)), torch.baddbmm(bias, x, stored))
        and torch.equal(torch.bmm(delta.transpose(1, 2), x), _weight_product(delta, x, gradient.transpose(1, 2)))
    )


def _plus_minus(point: Tensor, direction: Tensor, delta: float) -> Tensor:
    """point + delta direction and point - delta direction stacked along the first dimension,
    each written in place (not two tensors and their concatenation)."""
    both = point.new_empty((2 * point.shape[0], *point.shape[1:]))
    torch.add(point, direction, alpha=delta, out=both[: point.shape[0]])
    torch.add(point, direction, alpha=-delta, out=both[point.shape[0] :])
    return both


def _one_hot(y: Tensor, logits: Tensor) -> Tensor:
    """The one-hot targets of labels ``y``, or ``y`` itself where it is one-hot already."""
    return y if y.dim() == logits.dim() else F.one_hot(y, logits.shape[-1]).to(logits.dtype)


def _through(derivative: Optional[_LayerDerivative], d: Tensor) -> Tensor:
    """``d`` back through a layer: times s'(z), or as it is for a layer without activation."""
    return d if derivative is None else derivative(d)


class IndexedInputs(NamedTuple):
    """A role's inputs for every local step as rows of ``data``: step t's are ``data[index[t]]``
    (``index`` is (steps, clients, batch)). :meth:`HandBatchedGradients.local_update` gathers each
    step's just before it is used, into one buffer, so they are read from cache rather than
    written to memory for the whole round and read back."""

    data: Tensor
    index: Tensor  # type: ignore[assignment]  # (a field, where tuple has a method of that name)

    def step(self, t: int, buffer: Optional[Tensor] = None) -> Tensor:
        """Step ``t``'s inputs, (clients, batch, ...), written into ``buffer`` where given."""
        rows = self.index[t]
        flat = gather_inputs(self.data, rows.reshape(-1), buffer)
        return flat.view(*rows.shape, *self.data.shape[1:])


class _FlatLayout:
    """Every parameter of C clients in one flat buffer, parameter after parameter, so each is a
    (C, ...) view of a contiguous block and an update of all parameters is one elementwise kernel.
    The weights named in ``transposed`` (the first layer's) are kept as their transpose, (C, in,
    out): their view is (C, out, in) as any other's, and the forward's x W^T reads a contiguous
    operand. The parameter named ``leading`` comes first in the buffer, so the others are one
    contiguous ``tail`` (the step updates it alone where it folds the leading one's update into a
    matrix product)."""

    def __init__(self, params: Params, transposed: FrozenSet[str] = frozenset(), leading: Optional[str] = None) -> None:
        self.clients = next(iter(params.values())).shape[0]
        self.shapes = {k: v.shape for k, v in params.items()}
        self.transposed = frozenset(k for k in transposed if k in self.shapes)
        self.dtype, self.device = next(iter(params.values())).dtype, next(iter(params.values())).device
        self.size = sum(v.numel() for v in params.values())
        self.order = sorted(self.shapes, key=lambda name: name != leading)  # stable: the rest in their order
        #: Where the parameters after the first one start in the buffer.
        self.tail = self.shapes[self.order[0]].numel()

    def key(self) -> tuple:
        return tuple(self.shapes.items()), tuple(sorted(self.transposed)), tuple(self.order), self.dtype, self.device

    def new(self) -> Tuple[Tensor, Params]:
        """A fresh flat buffer and its per-parameter views (in the parameters' own order)."""
        flat = torch.empty(self.size, dtype=self.dtype, device=self.device)
        views, offset = {}, 0
        for name in self.order:
            shape = self.shapes[name]
            count = shape.numel()
            block = flat[offset : offset + count]
            if name in self.transposed:
                views[name] = block.view(shape[0], shape[2], shape[1]).transpose(1, 2)
            else:
                views[name] = block.view(shape)
            offset += count
        return flat, {name: views[name] for name in self.shapes}


class HandBatchedGradients:
    """Gradients of the mean cross-entropy for all clients of a round at once: parameters carry
    a leading client dimension C, inputs are (C, B, ...), labels (C, B). Implements
    :class:`fedml_perfedavg.core.client_maths.Gradients`."""

    def __init__(self, layers: List[_Layer], classes: int) -> None:
        self.layers = layers
        self.classes = classes
        self._work: Dict[tuple, Dict[str, Tuple[Tensor, Params]]] = {}  # local_update's buffers, by shape
        self._input_buffers: Dict[tuple, Tensor] = {}  # a step's gathered inputs, by role and shape
        #: Whether batched scoring gives per-user logits bit for bit here (core.evaluation's probe):
        #: the adapted models' and the global model's passes, and the global model's alone.
        self.scores_exactly: Optional[bool] = None
        self.scores_global_exactly: Optional[bool] = None
        #: Whether :meth:`model_logits` gives the network's own outputs bit for bit (the same probe).
        self.scores_one_exactly: Optional[bool] = None
        # transposed_storage_is_exact's and folded_update_is_exact's answers, by their arguments
        self._transposed_exact: Dict[tuple, bool] = {}
        self._fold_exact: Dict[tuple, bool] = {}

    def folds_updates(
        self, params: Params, batch_sizes: Sequence[int], scales: Sequence[float], transposed: bool
    ) -> bool:
        """Whether :meth:`local_update`'s steps take the first layer's weight gradients inside
        their updates (:class:`WeightProduct`): on a CPU whose products give the bits of the
        separate passes for these shapes and step sizes (:func:`folded_update_is_exact`)."""
        weight = params[self.layers[0].weight]
        if weight.device.type != "cpu" or weight.dim() != 3 or weight.dtype not in (torch.float32, torch.float64):
            return False
        if not all(math.isfinite(scale) and scale != 0 for scale in scales):  # MKL may skip a product times 0
            return False
        sizes = tuple(sorted(set(batch_sizes)))
        key = (tuple(weight.shape), sizes, weight.dtype, tuple(scales), transposed)
        if key not in self._fold_exact:
            clients, outputs, inputs = weight.shape
            self._fold_exact[key] = all(
                folded_update_is_exact(clients, size, inputs, outputs, weight.dtype, scales, transposed)
                for size in sizes
            )
        return self._fold_exact[key]

    def transposed_weights(self, params: Params, batch_sizes: Sequence[int]) -> FrozenSet[str]:
        """The weights :meth:`local_update`'s buffers keep transposed (:class:`_FlatLayout`): the
        first layer's, on a CPU whose products give the same bits either way for these shapes."""
        name = self.layers[0].weight
        weight = params[name]
        if weight.device.type != "cpu" or weight.dim() != 3:  # cuBLAS reads either layout at full speed
            return frozenset()
        sizes = tuple(sorted(set(batch_sizes)))
        key = (tuple(weight.shape), sizes, weight.dtype)
        if key not in self._transposed_exact:
            clients, outputs, inputs = weight.shape
            self._transposed_exact[key] = all(
                transposed_storage_is_exact(clients, size, inputs, outputs, weight.dtype) for size in sizes
            )
        return frozenset({name}) if self._transposed_exact[key] else frozenset()

    def _forward(self, params: Params, h: Tensor, start: int = 0) -> Tuple[List[Tensor], List[Tensor], Tensor]:
        """From layer ``start`` on: each layer's input, its pre-activation, and the logits."""
        inputs, pre = [], []
        for layer in self.layers[start:]:
            inputs.append(h)
            weight = params[layer.weight].transpose(1, 2)
            z = (
                torch.bmm(h, weight)
                if layer.bias is None
                else torch.baddbmm(params[layer.bias].unsqueeze(1), h, weight)
            )
            pre.append(z)
            h = z if layer.activation is None else layer.activation.forward(z)
        return inputs, pre, h

    def _backward(
        self,
        params: Params,
        inputs: List[Tensor],
        pre: List[Tensor],
        logits: Tensor,
        y: Tensor,
        start: int = 0,
        out: Optional[Params] = None,
    ) -> Tuple[Dict[str, Tensor], Tensor]:
        """Gradients of layers ``start``.. and the gradient at layer ``start``'s pre-activation;
        ``y`` holds labels (C, B) or their one-hot encoding (C, B, classes) in the logits' dtype."""
        # d(mean cross-entropy)/d(logits) = (softmax - one-hot) / B
        delta = (torch.softmax(logits, dim=-1) - _one_hot(y, logits)) / y.shape[1]
        grads: Dict[str, Tensor] = {}
        for position in range(len(inputs) - 1, -1, -1):
            layer = self.layers[start + position]
            if layer.activation is not None:
                output = inputs[position + 1] if position + 1 < len(inputs) else logits
                delta = layer.activation.backward(delta, pre[position], output)
            if position == 0:
                break
            layer.add_gradients(grads, delta, inputs[position], out)
            delta = torch.bmm(delta, params[layer.weight])
        return grads, delta

    def logits(self, params: Params, x: Tensor) -> Tensor:
        """The network's outputs, (C, B, classes)."""
        return self._forward(params, x.reshape(x.shape[0], x.shape[1], -1))[2]

    def model_logits(self, params: Params, x: Tensor) -> Tensor:
        """One model's outputs (B, classes), by the operations its modules run (F.linear and the
        activation's function), without ``functional_call``'s swap of the module's parameters
        (about 0.1 ms a call)."""
        h = x.reshape(x.shape[0], -1)
        for layer in self.layers:
            h = F.linear(h, params[layer.weight], None if layer.bias is None else params[layer.bias])
            if layer.activation is not None:
                h = layer.activation.forward(h)
        return h

    def grad(self, params: Params, x: Tensor, y: Tensor, out: Optional[Params] = None) -> Params:
        """Gradients of the mean cross-entropy (written into ``out``'s tensors where given)."""
        return self.grad_and_figures(params, x, y, out)[0]

    def grad_and_figures(
        self,
        params: Params,
        x: Tensor,
        y: Tensor,
        out: Optional[Params] = None,
        deferred: Optional[List[WeightProduct]] = None,
    ) -> Tuple[Params, StepFigures]:
        """:meth:`grad`, and its logits and ``y`` for the clients' training figures. With
        ``deferred``, the first layer's weight gradient is appended to it untaken (its entry is
        left out)."""
        h = x.reshape(x.shape[0], x.shape[1], -1)
        inputs, pre, logits = self._forward(params, h)
        grads, delta = self._backward(params, inputs, pre, logits, y, out=out)
        self.layers[0].add_gradients(grads, delta, h, out, deferred)
        return {k: grads[k] for k in params if k in grads}, StepFigures(None, logits, y)

    def _r_forward(self, params: Params, direction: Params, x: Tensor) -> tuple:
        """The forward pass at ``params`` and its directional derivative along ``direction``:
        (inputs, pre-activations, logits, each layer's output, each layer's s' (None without an
        activation), R of each layer's input (None for the first), R of each pre-activation)."""
        inputs, pre, logits = self._forward(params, x.reshape(x.shape[0], x.shape[1], -1))
        outputs = inputs[1:] + [logits]
        derivative = [
            None if layer.activation is None else _LayerDerivative(layer.activation, z, output)
            for layer, z, output in zip(self.layers, pre, outputs)
        ]
        # R-forward: Rz_l = Rh_{l-1} W_l^T + h_{l-1} V_l^T (+ c_l); Rh_l = s'(z_l) Rz_l
        r_inputs: List[Optional[Tensor]] = [None]
        r_pre: List[Tensor] = []
        for position, layer in enumerate(self.layers):
            r_z = torch.bmm(inputs[position], direction[layer.weight].transpose(1, 2))
            r_input = r_inputs[position]
            if r_input is not None:  # (in place: baddbmm's numbers without its copy of r_z)
                r_z.baddbmm_(r_input, params[layer.weight].transpose(1, 2))
            if layer.bias is not None:
                r_z.add_(direction[layer.bias].unsqueeze(1))
            r_pre.append(r_z)
            if position + 1 < len(self.layers):
                r_inputs.append(_through(derivative[position], r_z))
        return inputs, pre, logits, outputs, derivative, r_inputs, r_pre

    def hessian_vector_product(
        self, params: Params, direction: Params, x: Tensor, y: Tensor, out: Optional[Params] = None
    ) -> Params:
        """H(w) v exactly, by hand (Pearlmutter's R-operator through this chain): a forward pass
        with its directional derivative, then the backward pass with its own; the gradient itself
        is never formed. Equal to forward-over-reverse autodiff, with fewer and fused products.
        Written into ``out``'s tensors where given."""
        inputs, pre, logits, outputs, derivative, r_inputs, r_pre = self._r_forward(params, direction, x)
        # the last layer's output: logits, or its activation's (as in the gradient)
        r_logits = _through(derivative[-1], r_pre[-1])
        probs = torch.softmax(logits, dim=-1)
        delta = (probs - _one_hot(y, logits)) / y.shape[1]
        weighted = probs * r_logits
        r_delta = (weighted - probs * weighted.sum(dim=-1, keepdim=True)) / y.shape[1]
        hvp: Dict[str, Tensor] = {}
        for position in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[position]
            if layer.activation is not None:
                z, output = pre[position], outputs[position]
                # R(s'(z) d) = s'(z) R(d) + s''(z) Rz d
                # (Rz_l is read here for the last time: delta Rz_l is formed in its place)
                r_delta = _through(derivative[position], r_delta).add_(
                    layer.activation.curvature(r_pre[position].mul_(delta), z, output)
                )
                if position > 0:  # the first layer's own delta enters no product (its input has no R)
                    delta = _through(derivative[position], delta)
            # R(dW_l) = R(delta)^T h_{l-1} + delta^T Rh_{l-1};  R(db_l) = sum R(delta)
            hvp[layer.weight] = _weight_product(r_delta, inputs[position], _slot(out, layer.weight))
            r_input = r_inputs[position]
            if r_input is not None:
                hvp[layer.weight].baddbmm_(delta.transpose(1, 2), r_input)
            if layer.bias is not None:
                hvp[layer.bias] = torch.sum(r_delta, dim=1, out=_slot(out, layer.bias))
            if position > 0:
                # R(delta_{l-1}) = R(delta_l) W_l + delta_l V_l;  delta_{l-1} = delta_l W_l
                r_delta = torch.bmm(r_delta, params[layer.weight]).baddbmm_(delta, direction[layer.weight])
                delta = torch.bmm(delta, params[layer.weight])
        return {k: hvp[k] for k in params}

    def per_sample_hessian_terms(
        self, params: Params, direction: Params, x: Tensor, y: Tensor
    ) -> Tuple[List[Tensor], List[Tensor], List[Tensor], List[Optional[Tensor]]]:
        """Each sample's own Hessian-vector product H_i v of the chain (v = ``direction``), per
        Linear layer as its pieces: the layer's inputs a (C, B, in), the signal delta and its
        directional derivative R(delta) at its output (C, B, out), and R(a) (None for the first
        layer: the data does not move); R(dW) = R(delta) a^T + delta R(a)^T and R(db) = R(delta).
        The R-operator of :meth:`hessian_vector_product`, of each sample's own loss and with
        nothing summed over the samples (``y``: labels): DP-SGD clips each sample's product by its
        norm (core/private_steps.py); summed over the samples and divided by B it is that product."""
        inputs, pre, logits, outputs, derivative, r_inputs, r_pre = self._r_forward(params, direction, x)
        r_logits = _through(derivative[-1], r_pre[-1])
        probs = torch.softmax(logits, dim=-1)
        delta = probs - torch.nn.functional.one_hot(y, logits.shape[-1]).to(logits.dtype)
        weighted = probs * r_logits
        r_delta = weighted - probs * weighted.sum(dim=-1, keepdim=True)
        deltas: List[Tensor] = [delta] * len(self.layers)
        r_deltas: List[Tensor] = [r_delta] * len(self.layers)
        for position in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[position]
            if layer.activation is not None:
                # R(s'(z) d) = s'(z) R(d) + s''(z) Rz d
                curvature = layer.activation.curvature(r_pre[position] * delta, pre[position], outputs[position])
                r_delta = _through(derivative[position], r_delta) + curvature
                delta = _through(derivative[position], delta)
            deltas[position], r_deltas[position] = delta, r_delta
            if position > 0:
                # R(delta_{l-1}) = R(delta_l) W_l + delta_l V_l;  delta_{l-1} = delta_l W_l
                r_delta = torch.bmm(r_delta, params[layer.weight]).baddbmm_(delta, direction[layer.weight])
                delta = torch.bmm(delta, params[layer.weight])
        return inputs, deltas, r_deltas, r_inputs

    def local_update(
        self,
        params: Params,
        batches: LocalBatches,
        config: LocalUpdateConfig,
        figures: Optional[List[StepFigures]] = None,
    ) -> Params:
        """``config.local_steps`` local steps of every client from ``params`` (client first;
        ``batches`` step first): the one step loop (:func:`~fedml_perfedavg.core.client_maths.run_steps`)
        in this oracle's flat per-client buffers (:class:`_BufferedSteps`), reused from call to
        call; its numbers are those of :func:`~fedml_perfedavg.core.client_maths.local_update`
        with this oracle, bit for bit. ``figures``: what each step's training figures need is appended."""
        steps = _BufferedSteps(self, params, batches, config)
        return steps.finished(run_steps(steps, params, config, figures))

    def grad_pair(self, params: Params, x: Tensor, y: Tensor) -> Params:
        # the two points as 2C clients: one batched pass
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in params.items()}
        grads = self.grad(flat, torch.cat((x, x)), torch.cat((y, y)))
        return {k: v.reshape(2, -1, *v.shape[1:]) for k, v in grads.items()}

    def finite_difference_hvp(
        self, params: Params, direction: Params, x: Tensor, y: Tensor, delta: float, out: Optional[Params] = None
    ) -> Params:
        """(grad(w + delta v) - grad(w - delta v)) / (2 delta), the HF estimator's Hessian-vector
        product, without copying the inputs or the first layer: both points share the input x,
        so the first layer's pre-activations are x W^T +- delta x V^T, and its gradient
        difference is one product of x with the difference of the two backward signals.
        Written into ``out``'s tensors where given."""
        if len(self.layers) < 2:  # a single layer: the two points as 2C clients
            pair = self.grad_pair(
                {k: torch.stack((p + delta * direction[k], p - delta * direction[k])) for k, p in params.items()}, x, y
            )
            return {k: torch.div(v[0] - v[1], 2.0 * delta, out=_slot(out, k)) for k, v in pair.items()}
        clients = x.shape[0]
        h = x.reshape(clients, x.shape[1], -1)
        first = self.layers[0]
        base = torch.bmm(h, params[first.weight].transpose(1, 2))
        shift = torch.bmm(h, direction[first.weight].transpose(1, 2))
        if first.bias is not None:
            base.add_(params[first.bias].unsqueeze(1))
            shift.add_(direction[first.bias].unsqueeze(1))
        z = _plus_minus(base, shift, delta)
        h1 = z if first.activation is None else first.activation.forward(z)
        rest = {
            k: _plus_minus(params[k], direction[k], delta)
            for layer in self.layers[1:]
            for k in (layer.weight, layer.bias)
            if k
        }
        inputs, pre, logits = self._forward(rest, h1, start=1)
        grads, signal = self._backward_from_second(rest, h1, z, inputs, pre, logits, torch.cat((y, y)))
        hvp = {k: torch.div(v[:clients] - v[clients:], 2.0 * delta, out=_slot(out, k)) for k, v in grads.items()}
        first.add_gradients(hvp, (signal[:clients] - signal[clients:]) / (2.0 * delta), h, out)
        return {k: hvp[k] for k in params}

    def _backward_from_second(
        self, rest: Params, h1: Tensor, z1: Tensor, inputs: List[Tensor], pre: List[Tensor], logits: Tensor, y: Tensor
    ) -> Tuple[Dict[str, Tensor], Tensor]:
        """Gradients of layers 1.. and the gradient at the first layer's pre-activation."""
        grads, delta = self._backward(rest, inputs, pre, logits, y, start=1)
        second = self.layers[1]
        second.add_gradients(grads, delta, h1)
        delta = torch.bmm(delta, rest[second.weight])
        first = self.layers[0]
        if first.activation is not None:
            delta = first.activation.backward(delta, z1, h1)
        return grads, delta


def hand_batched_gradients(
    network: nn.Module, input_shape: Tuple[int, ...]
) -> Tuple[Optional[HandBatchedGradients], str]:
    """(the stacked gradients, "") where ``network`` is a chain they compute exactly, else
    (None, why not)."""
    if any(True for _ in network.buffers()):
        return None, "it has buffers"
    children = list(network.children())
    chain = network if isinstance(network, nn.Sequential) else children[0] if len(children) == 1 else None
    if not isinstance(chain, nn.Sequential):
        return None, f"{type(network).__name__} is neither an nn.Sequential nor a wrapper of one"
    names = {id(p): n for n, p in network.named_parameters()}

    layers: List[_Layer] = []
    for _, module in chain.named_modules():
        if list(module.children()):
            continue  # containers: only their leaves count
        if isinstance(module, nn.Flatten) and not layers:
            continue
        if type(module) is nn.Linear:
            layers.append(
                _Layer(names[id(module.weight)], None if module.bias is None else names[id(module.bias)], None)
            )
            continue
        activation = _activation(module)
        if activation is None or not layers or layers[-1].activation is not None:
            return None, f"its layers are not a chain of Linear and ELU/ReLU/Tanh/Sigmoid ({type(module).__name__})"
        last = layers[-1]
        layers[-1] = _Layer(last.weight, last.bias, activation)
    if not layers or len({n for layer in layers for n in (layer.weight, layer.bias) if n}) != len(names):
        return None, "not every parameter belongs to a Linear layer of the chain"
    if len({p.dtype for p in network.parameters()}) > 1:
        return None, "its parameters have more than one dtype"
    params = parameters_of(network)
    stacked = HandBatchedGradients(layers, params[layers[-1].weight].shape[0])
    probe = torch.randn(3, *input_shape, generator=torch.Generator().manual_seed(0)).to(next(iter(params.values())))
    expected = logits_of(network, params, probe)
    got = stacked.logits({k: v.unsqueeze(0) for k, v in params.items()}, probe.unsqueeze(0))[0]
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return None, "its forward pass is not the chain of its layers"
    return stacked, ""


class _BufferedSteps:
    """The step's arithmetic in flat per-client buffers (:class:`_FlatLayout`): an update of all
    parameters is one kernel, and no step allocates gradient-sized tensors.

    One buffer (``work``) holds in turn grad f(w; D), the adapted point built from it in place,
    the Hessian-vector product once g no longer needs that point, and the step's direction: two
    buffers stay in cache where four would not. Each update is the same operation on the same
    operands as :func:`~fedml_perfedavg.core.client_maths.axpy` (y + s x), with the sum's operands
    swapped where it is done in place (an IEEE sum is commutative), so the bits are the same.

    Where :meth:`HandBatchedGradients.folds_updates` allows, the step's direction when it is one
    gradient (SGD's grad f(w; D), FO's g) has its first-layer weight part (nine tenths of the
    paper's MLP) not written to a buffer and then scaled and added in two passes: the move takes
    it as one matrix product into w in place, w + (-beta) (delta^T x) (:class:`WeightProduct`),
    with the same bits: FedAvg's local update 12.9 -> 11.6 ms, FO's 37.3 -> 34.6. The adaptation and
    the correction write into a buffer of their own, where the product's epilogue would first copy
    its other operand there: measured, no faster, so they keep the separate passes.
    """

    def __init__(
        self, oracle: HandBatchedGradients, params: Params, batches: LocalBatches, config: LocalUpdateConfig
    ) -> None:
        self.oracle, self.kind = oracle, config.step
        labels = (batches.y, batches.second_y, batches.third_y)[: self.kind.batch_roles]
        sizes = [y.shape[2] for y in labels]
        self.first = oracle.layers[0].weight
        transposed = oracle.transposed_weights(params, sizes)
        self.folds = self.kind in (Step.SGD, Step.FO) and oracle.folds_updates(
            params, sizes, (-config.beta,), bool(transposed)
        )
        layout = _FlatLayout(params, transposed, leading=self.first)
        self.transposed, self.tail = layout.transposed, layout.tail
        work = oracle._work.get(layout.key())
        if work is None:  # one set per shape (a grid's rounds are larger than a run's)
            work = oracle._work[layout.key()] = {name: layout.new() for name in ("meta", "adapted")}
        self.meta_flat, self.meta = work["meta"]
        self.work_flat, self.work = work["adapted"]
        self.w_flat, self.w = layout.new()  # returned: the caller keeps it, so never reused
        # The one-hot targets of every step at once (the same values as one step at a time), for
        # the minibatches the step reads.
        self.targets = [F.one_hot(y, oracle.classes).to(layout.dtype) for y in labels]
        self.inputs = _StepInputs(batches, oracle._input_buffers)
        # the first weight's gradient not taken yet, by the buffer (work or meta) it belongs in
        self.pending: Dict[int, WeightProduct] = {}

    def start(self, params: Params) -> Params:
        for name, tensor in self.w.items():
            source = params[name]
            if name not in self.transposed:
                tensor.copy_(source)
                continue
            stored = tensor.transpose(1, 2)  # the contiguous (C, in, out) block
            if source.stride(0) == 0:  # every client starts from one model: transpose it once
                stored.copy_(source[0].t().contiguous().expand_as(stored))
            else:
                stored.copy_(source.transpose(1, 2))
        return self.w

    def finished(self, w: Params) -> Params:
        """The trained parameters as the caller expects them: each (C, ...) contiguous (a weight
        kept transposed is copied into its own layout once)."""
        return {name: tensor.contiguous() if name in self.transposed else tensor for name, tensor in w.items()}

    def _deferred(self, buffer: Params, defer: bool) -> Optional[List[WeightProduct]]:
        self.pending.pop(id(buffer), None)
        return [] if defer and self.folds else None

    def _keep(self, buffer: Params, deferred: Optional[List[WeightProduct]]) -> None:
        if deferred:
            self.pending[id(buffer)] = deferred[0]

    def gradient(self, point: Params, role: int, t: int) -> Params:
        return self.gradient_and_figures(point, role, t)[0]

    def gradient_and_figures(self, point: Params, role: int, t: int) -> Tuple[Params, StepFigures]:
        out = self.work if role == 0 else self.meta
        # only a gradient that is the step's direction is left to the move (SGD's D, FO's D')
        direction = (role == 0 and self.kind is Step.SGD) or (role == 1 and self.kind is Step.FO)
        deferred = self._deferred(out, direction)
        x, y = self.inputs.get(role, t), self.targets[role][t]
        _, figures = self.oracle.grad_and_figures(point, x, y, out=out, deferred=deferred)
        self._keep(out, deferred)
        return out, figures

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        self.work_flat.mul_(-alpha).add_(self.w_flat)  # w + (-alpha grad f(w; D)), in grad's buffer
        return self.work

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        x, y = self.inputs.get(2, t), self.targets[2][t]
        if self.kind is Step.HF:
            self.oracle.finite_difference_hvp(w, g, x, y, delta, out=self.work)
        else:
            self.oracle.hessian_vector_product(w, g, x, y, out=self.work)
        return self.work

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params:
        self.work_flat.mul_(-alpha).add_(self.meta_flat)  # g + (-alpha H g)
        return self.work

    def move(self, w: Params, direction: Params, beta: float) -> Params:
        flat = self.work_flat if direction is self.work else self.meta_flat
        product = self.pending.pop(id(direction), None)
        if product is None:
            self.w_flat.add_(flat.mul_(-beta))
        else:
            self.w_flat[self.tail :].add_(flat[self.tail :].mul_(-beta))
            product.add_to(self.w[self.first], -beta)
        return self.w
