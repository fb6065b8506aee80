"""Types shared by the core, the algorithms, the data layer and the FedML bridge."""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

from torch import Tensor

Params = Dict[str, Tensor]
"""Trainable parameters by name, as ``nn.Module.named_parameters`` names them."""

StateDict = Dict[str, Tensor]
"""A full model state (parameters and buffers), what FedML sends between server and clients."""

LossFn = Callable[[Params, Tensor, Tensor], Tensor]
"""``loss(params, x, y)``: a scalar loss as a pure function of the parameters."""


class UserSplit(NamedTuple):
    """One user's training and test tensors."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
