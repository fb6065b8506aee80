"""What a model allows, probed once at the start of a run on a batch like the run's: whether it
trains on such samples at all, whether ``torch.func.vmap`` can batch its gradients over clients,
whether its operators have forward-mode derivatives (the exact variant's Hessian-vector product),
and whether vmap's batched kernels give a client the bits it gets alone. The answers set an
algorithm's paths (:class:`ModelPaths`), so every backend computes each client alike."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor
from torch.func import vmap

from ..core import client_maths
from ..core.client_maths import LocalBatches, LocalUpdateConfig, Step
from ..core.hand_batched import HandBatchedGradients, hand_batched_gradients
from ..core.private_steps import per_sample_problem
from ..core.types import LossFn, Params, StateDict


class ModelMismatch(ValueError):
    """The model cannot train on the run's samples at all (shapes, channels, labels)."""


class ModelPaths:
    """How an algorithm computes with ``network``: what the probe found it allows (each True until
    probed), and its hand-batched form, decided once per input shape."""

    def __init__(self, network: Any) -> None:
        self.network = network
        self.vmappable = True  # False: client maths and evaluation never call vmap
        self.forward_ad = True  # False: the exact variant's HVP is reverse-over-reverse
        # False: vmap's batched kernels give a client other bits than alone, so clients are trained
        # and evaluated one by one (every backend then computes each client alike)
        self.groups_exactly = True
        self._hand_batched: Dict[Tuple[int, ...], Tuple[Optional[HandBatchedGradients], str]] = {}

    def hand_batched(self, input_shape: Tuple[int, ...]) -> Tuple[Optional[HandBatchedGradients], str]:
        """(the network's hand-batched form, "") where it is a Linear chain, else (None, why not):
        shared by the batched engine's local training and the evaluation's scoring (which still
        probes that it gives the same bits)."""
        if input_shape not in self._hand_batched:
            self._hand_batched[input_shape] = hand_batched_gradients(self.network, input_shape)
        return self._hand_batched[input_shape]

    def hand_batched_form(self, input_shape: Optional[Tuple[int, ...]]) -> Optional[HandBatchedGradients]:
        return None if input_shape is None else self.hand_batched(input_shape)[0]

    def private_chain(self, input_shape: Optional[Tuple[int, ...]]) -> Optional[HandBatchedGradients]:
        """The Linear chain's form by which DP-SGD clips each sample's gradient (by its
        outer-product norm, no per-sample gradient formed; the exact step's per-sample
        Hessian-vector products too: core/private_steps.py), or None: the per-sample gradients are
        torch.func's (a model that is no such chain). The one owner of that choice: the engine's
        plan and a client's own update ask it."""
        if not self.vmappable:
            return None
        return self.hand_batched_form(input_shape)

    def batches_evaluation(self, input_shape: Optional[Tuple[int, ...]]) -> bool:
        """Whether users with samples of ``input_shape`` may be evaluated together (vmapped, or
        by the hand-batched form)."""
        return self.vmappable and (self.groups_exactly or self.hand_batched_form(input_shape) is not None)

    def evaluation_path(self, input_shape: Optional[Tuple[int, ...]]) -> str:
        """How the personalized evaluation computes users with samples of ``input_shape`` (the
        plan's log line; the scoring together is still checked bit for bit where it is tried)."""
        if not self.batches_evaluation(input_shape):
            return "one user at a time"
        if self.hand_batched_form(input_shape) is not None:
            return "users adapted together, scored together by the hand-batched form where that gives the same bits"
        return "users adapted together (vmap), scored one by one"

    def gradient_oracle(self, loss_fn: LossFn) -> client_maths.FunctionalGradients:
        """The client maths' gradients: torch.func's, the exact Hessian-vector product forward-over-
        reverse unless the model has no forward-mode derivative (then reverse-over-reverse), pairs
        vmapped unless the model cannot be."""
        oracle = client_maths.FunctionalGradients if self.forward_ad else client_maths.ReverseModeGradients
        return oracle(loss_fn, pair_by_vmap=self.vmappable)

    def gradients_path(self) -> str:
        """The gradient oracle in words (the plan's log line)."""
        hvp = "forward-over-reverse" if self.forward_ad else "reverse-over-reverse"
        return f"torch.func gradients, Hessian-vector products {hvp}" + ("" if self.vmappable else ", no vmap")


class Probed(Protocol):
    """What the probe reads of an algorithm, and the paths it sets."""

    settings: Any
    network: Any
    standard_update: Optional[LocalUpdateConfig]
    keeps_client_state: ClassVar[bool]
    loss_fn: LossFn
    parameter_names: List[str]
    paths: ModelPaths

    def local_training(self, state: StateDict, batches: LocalBatches) -> StateDict: ...

    def split_state(self, state: StateDict) -> Tuple[Params, StateDict]: ...


def probe(algorithm: Probed, global_state: StateDict, x: Tensor, y: Tensor) -> List[str]:
    """Set ``algorithm``'s paths by what the model allows on the batch ``x, y``: if vmap cannot
    batch its gradients, every client update and evaluation runs client by client; if its
    operators have no forward-mode derivative, the exact variant's HVP is reverse-over-reverse;
    if vmap's kernels change a client's bits, clients run one by one too. Returns a line for
    each such fallback, saying why; :class:`ModelMismatch`
    (with the model's own error) if it cannot compute a loss and gradient on them at all."""
    params, _ = algorithm.split_state({k: v.detach() for k, v in global_state.items()})
    loss_fn, paths = algorithm.loss_fn, algorithm.paths
    notes = []
    with torch.no_grad():
        why = client_maths.model_problem(loss_fn, params, x, y)
        if why is not None:
            raise ModelMismatch(
                f"it cannot compute a loss and its gradient on a batch of {len(y)} samples of "
                f"shape {tuple(x.shape[1:])} ({x.dtype}): {why}"
            )
        privacy = algorithm.settings.privacy
        if privacy is not None:
            privacy.check_model(
                type(algorithm.network).__name__, per_sample_problem(algorithm.network, loss_fn, params, x, y)
            )
        standard = algorithm.standard_update
        if standard is not None and standard.step is Step.EXACT:
            why = client_maths.forward_ad_problem(loss_fn, params, x, y)
            paths.forward_ad = why is None  # before the probes below: the local update reads it
            if why is not None:
                notes.append(
                    f"no forward-mode derivative ({why}); the exact Hessian-vector product is reverse-over-reverse"
                )
        why = client_maths.vmap_problem(loss_fn, params, x, y, reverse_hvp=not paths.forward_ad)
        paths.vmappable = why is None
        if why is not None:
            notes.append(
                f"torch.func.vmap cannot batch its gradients ({why}); every client trains and is "
                f"evaluated one by one (the per-client path)"
            )
        elif paths.hand_batched(tuple(x.shape[1:]))[0] is None and algorithm.keeps_client_state:
            # Clients with states of their own train one by one (engine/plan.py); their evaluation,
            # unprobed, runs one by one too, as a silo evaluates its user.
            paths.groups_exactly = False
        elif paths.hand_batched(tuple(x.shape[1:]))[0] is None:
            difference = grouping_difference(algorithm, global_state, x, y)
            paths.groups_exactly = difference == 0.0
            if not paths.groups_exactly:
                notes.append(
                    f"torch.func.vmap's batched kernels give a client other bits than training it "
                    f"alone (by up to {difference:.2g} after one step); every client trains and is "
                    f"evaluated one by one, so that sp, MPI and cross-silo compute each client alike"
                )
    return notes


def grouping_difference(algorithm: Probed, global_state: StateDict, x: Tensor, y: Tensor) -> float:
    """The largest difference between one local step of two clients vmapped together and the
    same clients one at a time. The probe's inputs depend only on the sample's shape and dtype
    (every process of a run decides alike, whatever its own data)."""
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.rand(x.shape, generator=g).to(device=x.device, dtype=x.dtype)
        if x.is_floating_point()
        else torch.zeros_like(x)
        for _ in range(2)
    ]
    ys = [torch.zeros_like(y) for _ in range(2)]
    state = {k: v.detach() for k, v in global_state.items()}
    batches = [LocalBatches(*(t.unsqueeze(0) for t in (xi, yi, xi, yi, xi, yi))) for xi, yi in zip(xs, ys)]
    alone = [algorithm.local_training(state, b) for b in batches]
    stacked = LocalBatches(*(torch.stack(t) for t in zip(*batches)))
    together = vmap(algorithm.local_training, in_dims=(None, 0))(state, stacked)
    return max(
        float((together[k][i].double() - alone[i][k].double()).abs().max())
        for i in range(2)
        for k in algorithm.parameter_names
    )
