"""Per-FedAvg local update and its meta-gradient estimators, in plain PyTorch.

Everything here is functional (parameters are ``dict[str, Tensor]``) and built on
``torch.func``, so the same code runs for one client or, under ``torch.func.vmap``, for
all clients of a round at once. Nothing here imports FedML.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, List, NamedTuple, Optional, Protocol, Tuple, Union, cast

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, jvp, vjp, vmap

from .functional import training_figures
from .types import LossFn, Params


class Step(str, Enum):
    """The direction of a local step: a Per-FedAvg meta-gradient estimate (FO, HF, EXACT) or
    FedAvg's plain gradient on D (SGD, the paper's baseline). Equal to its name as a string
    (``Step.HF == "hf"``), which is how configs and records spell it."""

    FO = "fo"
    HF = "hf"
    EXACT = "exact"
    SGD = "sgd"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # errors and records name it as the config spells it
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def batch_roles(self) -> int:
        """How many of a step's minibatches it reads: D; D' too in FO; D'' too in HF and exact."""
        return 1 if self is Step.SGD else 2 if self is Step.FO else 3


VARIANTS = (Step.FO, Step.HF, Step.EXACT)  # Per-FedAvg's meta-gradient estimators
STEPS = tuple(Step)


@dataclass(frozen=True)
class LocalUpdateConfig:
    """Hyperparameters of one client's local update: ``local_steps`` steps of size ``beta``
    from the current w, each in the direction ``variant`` names (alpha the estimators' inner
    step, delta HF's finite difference). The one place a variant is checked: a string becomes
    its :class:`Step` here, or is refused."""

    variant: Union[Step, str] = Step.HF
    alpha: float = 0.01
    beta: float = 0.001
    delta: float = 0.001
    local_steps: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.variant, Step):
            if self.variant not in STEPS:
                raise ValueError(f"variant={self.variant!r} is not one of {[str(s) for s in STEPS]}")
            object.__setattr__(self, "variant", Step(self.variant))

    @property
    def step(self) -> Step:
        """``variant``, typed (``__post_init__`` made it a :class:`Step`)."""
        assert isinstance(self.variant, Step)
        return self.variant


class LocalBatches(NamedTuple):
    """Three independent minibatches for each of ``local_steps`` steps; every tensor has the step
    index first. ``x, y`` is the step's minibatch (FedAvg's and most algorithms' only one);
    ``second_*`` and ``third_*`` are drawn independently of it for estimators that need more
    (an algorithm's ``batch_roles`` says which it reads). Per-FedAvg reads them as D (the inner
    alpha-step), D' (the gradient at the adapted point) and D'' (the Hessian correction).
    """

    x: Tensor
    y: Tensor
    second_x: Tensor
    second_y: Tensor
    third_x: Tensor
    third_y: Tensor

    def step(self, t: int) -> "LocalBatches":
        return LocalBatches(*(tensor[t] for tensor in self))

    def with_labels(self, change: Callable[[Tensor], Tensor]) -> "LocalBatches":
        """The same minibatches with ``change`` applied to each of the three label tensors."""
        return self._replace(y=change(self.y), second_y=change(self.second_y), third_y=change(self.third_y))


class StepFigures(NamedTuple):
    """What a step keeps of grad f(w; D)'s forward pass for its training figures: the loss where
    the oracle computes it (torch.func's does), the outputs (logits) where it has them, and D's
    labels (or one-hot targets). :func:`mean_figures` turns a local update's steps into its
    figures in one batched computation, not a few small kernels a step."""

    loss: Optional[Tensor]
    logits: Optional[Tensor]
    y: Tensor


class Gradients(Protocol):
    """How the local update gets the loss's derivatives: ``grad(params, x, y)``; ``grad_pair`` at
    two parameter points at once (a leading dimension of 2); HF's Hessian-vector estimate
    ``finite_difference_hvp`` ([grad(w + delta g) - grad(w - delta g)] / (2 delta)); and the exact
    ``hessian_vector_product``; ``grad_and_figures``, the gradient with what its forward pass
    gives of the minibatch's training figures (:class:`StepFigures`). :class:`FunctionalGradients`
    computes them by ``torch.func`` for any model; a specialised oracle (a Linear chain's,
    :mod:`.hand_batched`) its own way."""

    def grad(self, params: Params, x: Tensor, y: Tensor) -> Params: ...

    def grad_and_figures(self, params: Params, x: Tensor, y: Tensor) -> Tuple[Params, StepFigures]: ...

    def grad_pair(self, params: Params, x: Tensor, y: Tensor) -> Params: ...

    def finite_difference_hvp(self, w: Params, g: Params, x: Tensor, y: Tensor, delta: float) -> Params: ...

    def hessian_vector_product(self, params: Params, v: Params, x: Tensor, y: Tensor) -> Params: ...


class FunctionalGradients:
    """Gradients of any loss by ``torch.func`` (the default). ``pair_by_vmap=False`` never calls
    ``vmap``: the path for a model vmap cannot batch (data-dependent control flow, ...)."""

    def __init__(self, loss_fn: LossFn, pair_by_vmap: bool = True) -> None:
        self.grad = grad(loss_fn)
        self.pair_by_vmap = pair_by_vmap
        # The same gradient with its forward pass's value and logits beside it (make_loss_fn's
        # loss has them; any other loss gives its value alone, so no accuracy is recorded).
        with_logits = getattr(loss_fn, "with_logits", None)
        self._with_logits = None if with_logits is None else grad_and_value(with_logits, has_aux=True)
        self._with_value = grad_and_value(loss_fn)

    def grad_and_figures(self, params: Params, x: Tensor, y: Tensor) -> Tuple[Params, StepFigures]:
        if self._with_logits is not None:
            gradient, (loss, logits) = self._with_logits(params, x, y)
            return gradient, StepFigures(loss.detach(), logits, y)
        gradient, loss = self._with_value(params, x, y)
        return gradient, StepFigures(loss.detach(), None, y)

    def grad_pair(self, params: Params, x: Tensor, y: Tensor) -> Params:
        if self.pair_by_vmap:  # one vmapped call with twice the work instead of two small passes
            return vmap(self.grad, in_dims=(0, None, None))(params, x, y)
        first, second = (self.grad({k: v[i] for k, v in params.items()}, x, y) for i in (0, 1))
        return {k: torch.stack((first[k], second[k])) for k in first}

    def finite_difference_hvp(self, w: Params, g: Params, x: Tensor, y: Tensor, delta: float) -> Params:
        plus_minus = {k: torch.stack((p + delta * g[k], p - delta * g[k])) for k, p in w.items()}
        grads = self.grad_pair(plus_minus, x, y)
        return {k: (v[0] - v[1]) / (2.0 * delta) for k, v in grads.items()}

    def hessian_vector_product(self, params: Params, v: Params, x: Tensor, y: Tensor) -> Params:
        """Forward over reverse: the jvp of the gradient."""
        return jvp(lambda p: self.grad(p, x, y), (params,), (v,))[1]


class ReverseModeGradients(FunctionalGradients):
    """:class:`FunctionalGradients` whose exact Hessian-vector product is reverse-over-reverse
    (a vjp of the gradient; the Hessian is symmetric), for models with operators that have no
    forward-mode derivative (PyTorch's CPU LSTM kernel, for one)."""

    def hessian_vector_product(self, params: Params, v: Params, x: Tensor, y: Tensor) -> Params:
        # Under no_grad, PyTorch's CPU LSTM runs its inference kernel, which keeps no workspace
        # for a second backward pass; torch.func keeps no graph beyond this call either way.
        with torch.enable_grad():
            pullback = vjp(lambda p: self.grad(p, x, y), params)[1]
            (hessian_v,) = pullback(v)
        return hessian_v


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def model_problem(loss_fn: LossFn, params: Params, x: Tensor, y: Tensor) -> Optional[str]:
    """Why the model cannot compute a loss and its gradient on the batch ``x, y`` at all (wrong
    input shape or channels, labels beyond its outputs, ...), or None."""
    try:
        grad(loss_fn)(params, x, y)
    except Exception as err:  # noqa: BLE001 - whatever it raises is the reason the run cannot go on
        return _first_line(err)
    return None


def forward_ad_problem(loss_fn: LossFn, params: Params, x: Tensor, y: Tensor) -> Optional[str]:
    """Why forward-mode AD over ``loss_fn``'s gradient fails (a probe on the batch ``x, y``), or None."""
    try:
        jvp(lambda p: grad(loss_fn)(p, x, y), (params,), ({k: torch.zeros_like(v) for k, v in params.items()},))
    except Exception as err:  # noqa: BLE001 - whatever it raises, the answer is "use reverse mode"
        return _first_line(err)
    return None


def vmap_problem(loss_fn: LossFn, params: Params, x: Tensor, y: Tensor, reverse_hvp: bool = False) -> Optional[str]:
    """Why ``torch.func.vmap`` cannot batch gradients of ``loss_fn`` over clients (a probe on two
    clients holding the batch ``x, y``: a batch of the run's size, so that a model that needs more
    than one sample, as BatchNorm does, is probed as it will run; with ``reverse_hvp``,
    :class:`ReverseModeGradients`' Hessian-vector product too), or None when it can."""
    xs, ys = torch.stack((x, x)), torch.stack((y, y))
    try:
        vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, xs, ys)
        if reverse_hvp:
            hvp = ReverseModeGradients(loss_fn).hessian_vector_product
            vmap(lambda bx, by: hvp(params, params, bx, by), in_dims=(0, 0))(xs, ys)
    except Exception as err:  # noqa: BLE001 - whatever vmap raises, the answer is "not batchable"
        return _first_line(err)
    return None


def axpy(scale: float, x: Params, y: Params, out: Optional[Params] = None) -> Params:
    """``y + scale * x`` for parameter dicts; written into ``out``'s tensors where given (which may
    be ``x``'s), as the product and then the sum: the same two roundings, so the same bits."""
    if out is None:
        return {k: y[k] + scale * x[k] for k in y}
    for k in y:
        torch.mul(x[k], scale, out=out[k]).add_(y[k])
    return out


class StepArithmetic(Protocol):
    """Where a local update's numbers live and how each part of a step is computed; the step
    itself (:func:`step_direction`, :func:`run_steps`) is the same for every arithmetic, and they
    are its only callers. ``role`` names a step's minibatch: 0 is D, 1 is D', 2 is D''.

    An arithmetic may keep its numbers in buffers it reuses (the hand-batched one does, for
    speed): a value it returns is valid until the next call, except ``w`` (from :meth:`start` and
    :meth:`move`), valid until the next ``move``; so the loop passes each value on once, in its
    order. The loop is held to that by a test, not by convention:
    ``tests/core/test_hand_batched.py::test_buffered_local_update_is_the_generic_loop_bit_for_bit``
    runs it over the reusing arithmetic and the allocating one (:class:`FunctionalSteps`) and
    requires the same bits for every variant."""

    def start(self, params: Params) -> Params: ...

    def gradient(self, point: Params, role: int, t: int) -> Params: ...

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params: ...  # w - alpha gradient

    kind: Step  # the step's direction, chosen once for the whole update

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params: ...

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params: ...  # g - alpha H g

    def move(self, w: Params, direction: Params, beta: float) -> Params: ...  # w - beta direction


class RecordingSteps(StepArithmetic, Protocol):
    """An arithmetic that also gives grad f(w; D) with D's training figures (loss, accuracy:
    :meth:`Gradients.grad_and_figures`), for a loop that records them; DP-SGD's do not (they
    release no figure of the private data)."""

    def gradient_and_figures(self, point: Params, role: int, t: int) -> Tuple[Params, StepFigures]: ...


class FunctionalSteps:
    """The step's arithmetic on parameter dicts, each value a new tensor (``axpy``), with
    ``gradients`` (:class:`FunctionalGradients` by default) on the minibatches of ``batches``."""

    def __init__(self, gradients: Gradients, batches: LocalBatches, kind: Step) -> None:
        self.kind = kind
        self.gradients = gradients
        self.roles = ((batches.x, batches.y), (batches.second_x, batches.second_y))
        self.hessian = (batches.third_x, batches.third_y)

    def start(self, params: Params) -> Params:
        return params

    def gradient(self, point: Params, role: int, t: int) -> Params:
        x, y = self.roles[role]
        return self.gradients.grad(point, x[t], y[t])

    def gradient_and_figures(self, point: Params, role: int, t: int) -> Tuple[Params, StepFigures]:
        x, y = self.roles[role]
        return self.gradients.grad_and_figures(point, x[t], y[t])

    def adapt(self, w: Params, gradient: Params, alpha: float) -> Params:
        return axpy(-alpha, gradient, w)

    def hessian_times(self, w: Params, g: Params, t: int, delta: float) -> Params:
        """H(w; D'') g: HF's central difference of gradients at w +- delta g, or exact."""
        x, y = self.hessian[0][t], self.hessian[1][t]
        if self.kind is Step.HF:
            return self.gradients.finite_difference_hvp(w, g, x, y, delta)
        return self.gradients.hessian_vector_product(w, g, x, y)

    def correct(self, g: Params, hessian_g: Params, alpha: float) -> Params:
        return axpy(-alpha, hessian_g, g)

    def move(self, w: Params, direction: Params, beta: float) -> Params:
        return axpy(-beta, direction, w)


def step_direction(
    steps: StepArithmetic, w: Params, t: int, alpha: float, delta: float, figures: Optional[List[StepFigures]] = None
) -> Params:
    """Step ``t``'s direction at ``w`` (never at the adapted point): SGD's grad f(w; D); FO's
    g = grad f(w~; D') with w~ = w - alpha grad f(w; D); HF's and exact's g - alpha H(w; D'') g.
    With ``figures``, what D's training figures at w (loss, accuracy) need is appended to it:
    grad f(w; D)'s own forward pass, the same for every step kind, so FedAvg's and Per-FedAvg's
    training losses are the same quantity."""
    kind = steps.kind
    if figures is None:
        gradient = steps.gradient(w, 0, t)
    else:
        gradient, step_figures = cast(RecordingSteps, steps).gradient_and_figures(w, 0, t)
        figures.append(step_figures)
    if kind is Step.SGD:
        return gradient
    g = steps.gradient(steps.adapt(w, gradient, alpha), 1, t)
    if kind is Step.FO:
        return g
    return steps.correct(g, steps.hessian_times(w, g, t, delta), alpha)


def run_steps(
    steps: StepArithmetic, params: Params, config: LocalUpdateConfig, figures: Optional[List[StepFigures]] = None
) -> Params:
    """The local update's loop, for every arithmetic: ``config.local_steps`` steps of size
    ``config.beta`` from ``params``, each starting from the current w, as in Algorithm 1 of
    Fallah et al. (2020). With ``figures``, each step's training figures are appended to it
    (:func:`step_direction`)."""
    w = steps.start(params)
    for t in range(config.local_steps):
        direction = step_direction(steps, w, t, config.alpha, config.delta, figures)
        w = steps.move(w, direction, config.beta)
    return w


def mean_figures(figures: List[StepFigures]) -> Tensor:
    """The local update's training figures from its steps' (:func:`step_direction`): the mean over
    its steps of D's loss and accuracy, (..., 2) (accuracy NaN where the oracle gave no logits)."""
    loss = None if figures[0].loss is None else torch.stack([f.loss for f in figures if f.loss is not None])
    if figures[0].logits is None:
        assert loss is not None  # an oracle gives the loss or the logits
        return torch.stack((loss, torch.full_like(loss, float("nan"))), dim=-1).mean(0)
    logits = torch.stack([f.logits for f in figures if f.logits is not None])
    return training_figures(logits, torch.stack([f.y for f in figures]), loss).mean(0)


def meta_gradient(
    loss_fn: LossFn,
    params: Params,
    batches: LocalBatches,
    variant: Step,
    alpha: float,
    delta: float,
    gradients: Optional[Gradients] = None,
) -> Params:
    """Estimate of grad F_i(w) = grad of f_i(w - alpha grad f_i(w; D); D') at ``params``.

    fo: g; hf: g - alpha * finite-difference Hessian(D'') @ g; exact: g - alpha * H(D'') @ g,
    where g = grad f_i(w~; D') and w~ = w - alpha grad f_i(w; D). ``batches`` holds one step.
    ``gradients`` defaults to ``torch.func`` on ``loss_fn``.
    """
    if variant not in VARIANTS:  # SGD, or a string from a direct caller (LocalUpdateConfig checks a run's)
        raise ValueError(f"variant={variant!r} is not one of {[str(v) for v in VARIANTS]}")
    one_step = LocalBatches(*(tensor.unsqueeze(0) for tensor in batches))
    steps = FunctionalSteps(gradients or FunctionalGradients(loss_fn), one_step, Step(variant))
    return step_direction(steps, params, 0, alpha, delta)


def local_update(
    loss_fn: LossFn,
    params: Params,
    batches: LocalBatches,
    config: LocalUpdateConfig,
    gradients: Optional[Gradients] = None,
    figures: Optional[List[StepFigures]] = None,
) -> Params:
    """Run one client's ``config.local_steps`` steps from ``params`` and return the new params
    (:func:`run_steps` with :class:`FunctionalSteps`; ``figures``: each step's training figures
    are appended to it). ``gradients`` defaults to ``torch.func`` on ``loss_fn``;
    :meth:`fedml_perfedavg.core.hand_batched.HandBatchedGradients.local_update` runs the same loop
    for all clients of a round at once, in reused buffers."""
    steps = FunctionalSteps(gradients or FunctionalGradients(loss_fn), batches, config.step)
    return run_steps(steps, params, config, figures)
