"""Any ``nn.Module`` as a pure function of its parameters, as ``torch.func`` needs it.

Per-FedAvg differentiates through a gradient step (exactly, or by finite differences whose
two gradient evaluations must see the same network), so the network must be a deterministic
function of its parameters:

- dropout is off (the copy runs in eval mode);
- BatchNorm normalizes with the statistics of the batch it is given, in training, in the
  personalization step and at test, as MAML's reference code does; running statistics are
  neither updated nor used (``torch.func.replace_all_batch_norm_modules_``), so BatchNorm
  buffers travel unchanged with the model and averaging them is a no-op.

The user's module itself is never modified: these rules apply to a private copy.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, replace_all_batch_norm_modules_

from .types import LossFn, Params

logger = logging.getLogger(__name__)


def functional_network(model: nn.Module) -> nn.Module:
    """A private copy of ``model`` run by :func:`torch.func.functional_call` (see module doc)."""
    network = copy.deepcopy(model).eval()
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in network.modules()):
        replace_all_batch_norm_modules_(network)
        logger.info(
            "%s has BatchNorm: it normalizes with each batch's own statistics; running statistics are "
            "kept as they are (see fedml_perfedavg.core.functional)",
            type(model).__name__,
        )
    return network


def training_figures(logits: Tensor, y: Tensor, loss: Optional[Tensor] = None) -> Tensor:
    """A minibatch's training figures from its logits (..., B, classes) and labels (..., B), or
    their one-hot encoding (..., B, classes): its mean cross-entropy (``loss`` where the caller
    has it) and its accuracy, stacked as (..., 2). Detached: a record of the step, never part
    of its gradient."""
    logits = logits.detach()
    labels = y.argmax(-1) if y.dim() == logits.dim() else y
    if loss is None:
        log_probs = F.log_softmax(logits, dim=-1)
        loss = -torch.gather(log_probs, -1, labels.unsqueeze(-1)).squeeze(-1).mean(-1)
    loss = loss.detach()
    accuracy = (logits.argmax(-1) == labels).to(logits.dtype).mean(-1)
    return torch.stack((loss, accuracy), dim=-1)


def make_loss_fn(network: nn.Module) -> LossFn:
    """Cross-entropy of ``network`` as a pure function of its parameters. Its attribute
    ``with_logits`` is the same loss returning ``(loss, logits)``, the logits detached, for
    ``torch.func.grad_and_value(..., has_aux=True)``: the forward pass the gradient needs
    anyway, whose logits give the step's accuracy (:func:`training_figures`)."""
    buffers = {name: b.detach() for name, b in network.named_buffers()}

    def logits_and_loss(params: Params, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        logits = functional_call(network, {**params, **buffers}, (x,))
        # Same value as F.cross_entropy; its nll_loss is slower under vmap than a gather.
        return logits, -torch.gather(F.log_softmax(logits, dim=-1), 1, y.unsqueeze(1)).mean()

    def loss_fn(params: Params, x: Tensor, y: Tensor) -> Tensor:
        return logits_and_loss(params, x, y)[1]

    def with_logits(params: Params, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        logits, loss = logits_and_loss(params, x, y)
        return loss, logits.detach()

    loss_fn.with_logits = with_logits  # type: ignore[attr-defined]
    return loss_fn


def logits_of(network: nn.Module, params: Params, x: Tensor) -> Tensor:
    """The network's outputs for ``x`` at ``params`` (buffers as the network holds them)."""
    buffers = {name: b.detach() for name, b in network.named_buffers()}
    return functional_call(network, {**params, **buffers}, (x,))


def parameters_of(model: nn.Module) -> Params:
    """The model's trainable parameters, detached, as a functional parameter dict."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}
