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


def make_loss_fn(network: nn.Module) -> LossFn:
    """Cross-entropy of ``network`` as a pure function of its parameters."""
    buffers = {name: b.detach() for name, b in network.named_buffers()}

    def loss_fn(params: Params, x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(network, {**params, **buffers}, (x,))
        # Same value as F.cross_entropy; its nll_loss is slower under vmap than a gather.
        return -torch.gather(F.log_softmax(logits, dim=-1), 1, y.unsqueeze(1)).mean()

    return loss_fn


def logits_of(network: nn.Module, params: Params, x: Tensor) -> Tensor:
    """The network's outputs for ``x`` at ``params`` (buffers as the network holds them)."""
    buffers = {name: b.detach() for name, b in network.named_buffers()}
    return functional_call(network, {**params, **buffers}, (x,))


def parameters_of(model: nn.Module) -> Params:
    """The model's trainable parameters, detached, as a functional parameter dict."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}
