"""Hand-batched gradients for a chain of Linear layers and elementwise activations.

The batched engine's round is thousands of tiny operators when ``torch.func`` vmaps a generic
network; for a plain chain (``Flatten``, ``Linear``, ``ELU``/``ReLU``/``Tanh``/``Sigmoid``, as
the paper's MLP) the forward and backward pass of every client of a round is a handful of
batched matrix products instead (``torch.bmm`` over a leading client dimension). The
gradients are plain differentiable PyTorch, so the exact variant's Hessian-vector product is
forward-over-reverse (``torch.func.jvp`` of this backward pass).

:meth:`StackedGradients.for_network` accepts a network only if it is an ``nn.Sequential`` (or
wraps exactly one) whose leaves form such a chain, and its output equals the chain's on a
probe input; otherwise it says why, and the engine
keeps the generic path. The loss is the plugin's (mean cross-entropy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functional import logits_of, parameters_of
from .types import Params

# activation -> (forward, derivative from (pre-activation z, output h))
Activation = Tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]


def _activation(module: nn.Module) -> Optional[Activation]:
    if type(module) is nn.ELU:
        alpha = float(module.alpha)
        return (lambda z: F.elu(z, alpha)), (lambda z, h: torch.where(z > 0, torch.ones_like(z), h + alpha))
    if type(module) is nn.ReLU:
        return torch.relu, (lambda z, h: (z > 0).to(z.dtype))
    if type(module) is nn.Tanh:
        return torch.tanh, (lambda z, h: 1 - h * h)
    if type(module) is nn.Sigmoid:
        return torch.sigmoid, (lambda z, h: h * (1 - h))
    return None


@dataclass(frozen=True)
class _Layer:
    weight: str
    bias: Optional[str]
    activation: Optional[Activation]


class StackedGradients:
    """Gradients of the mean cross-entropy for all clients of a round at once: parameters carry
    a leading client dimension C, inputs are (C, B, ...), labels (C, B). Implements
    :class:`fedml_perfedavg.core.algorithm.Gradients`."""

    def __init__(self, layers: List[_Layer]) -> None:
        self.layers = layers

    @classmethod
    def for_network(cls, network: nn.Module, input_shape: Tuple[int, ...]) -> Tuple[Optional["StackedGradients"], str]:
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
                layers.append(_Layer(names[id(module.weight)],
                                     None if module.bias is None else names[id(module.bias)], None))
                continue
            activation = _activation(module)
            if activation is None or not layers or layers[-1].activation is not None:
                return None, f"its layers are not a chain of Linear and ELU/ReLU/Tanh/Sigmoid ({type(module).__name__})"
            last = layers[-1]
            layers[-1] = _Layer(last.weight, last.bias, activation)
        if not layers or len({n for layer in layers for n in (layer.weight, layer.bias) if n}) != len(names):
            return None, "not every parameter belongs to a Linear layer of the chain"
        stacked = cls(layers)
        params = parameters_of(network)
        probe = torch.randn(3, *input_shape, generator=torch.Generator().manual_seed(0)).to(
            next(iter(params.values())))
        expected = logits_of(network, params, probe)
        got = stacked.logits({k: v.unsqueeze(0) for k, v in params.items()}, probe.unsqueeze(0))[0]
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            return None, "its forward pass is not the chain of its layers"
        return stacked, ""

    def _forward(self, params: Params, x: Tensor) -> Tuple[List[Tensor], List[Tensor]]:
        """Inputs of each layer and its pre-activations; the last pre-activation is the logits."""
        h = x.reshape(x.shape[0], x.shape[1], -1)
        inputs, pre = [], []
        for layer in self.layers:
            inputs.append(h)
            weight = params[layer.weight]
            z = torch.bmm(h, weight.transpose(1, 2))
            if layer.bias is not None:
                z = z + params[layer.bias].unsqueeze(1)
            pre.append(z)
            h = z if layer.activation is None else layer.activation[0](z)
        return inputs, pre + [h]

    def logits(self, params: Params, x: Tensor) -> Tensor:
        """The network's outputs, (C, B, classes)."""
        return self._forward(params, x)[1][-1]

    def grad(self, params: Params, x: Tensor, y: Tensor) -> Params:
        inputs, outputs = self._forward(params, x)
        pre, logits = outputs[:-1], outputs[-1]
        batch = y.shape[1]
        # d(mean cross-entropy)/d(logits) = (softmax - one-hot) / B
        delta = (torch.softmax(logits, dim=-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)) / batch
        grads: Dict[str, Tensor] = {}
        for index in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[index]
            if layer.activation is not None:
                output = inputs[index + 1] if index + 1 < len(self.layers) else logits
                delta = delta * layer.activation[1](pre[index], output)
            grads[layer.weight] = torch.bmm(delta.transpose(1, 2), inputs[index])
            if layer.bias is not None:
                grads[layer.bias] = delta.sum(dim=1)
            if index:
                delta = torch.bmm(delta, params[layer.weight])
        return {k: grads[k] for k in params}

    def grad_pair(self, params: Params, x: Tensor, y: Tensor) -> Params:
        # the two points as 2C clients: one batched pass
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in params.items()}
        grads = self.grad(flat, torch.cat((x, x)), torch.cat((y, y)))
        return {k: v.reshape(2, -1, *v.shape[1:]) for k, v in grads.items()}
