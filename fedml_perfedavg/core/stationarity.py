"""The paper's measure of progress: ||grad F(w)||^2, with F(w) = 1/n sum_i f_i(w - alpha grad f_i(w)).

Theorem 4.5 of Fallah et al. (2020) bounds E||grad F(w)||^2 (an epsilon-approximate first-order
stationary point of F). Here every term is exact: f_i is user i's loss on its *full* training
data (no minibatch), and grad F_i(w) = (I - alpha H_i(w)) grad f_i(w - alpha grad f_i(w)), the
Hessian-vector product by forward-over-reverse autodiff (``torch.func.jvp`` of ``grad``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.func import grad, jvp

from .client_maths import axpy
from .types import LossFn, Params, UserSplit, model_inputs


def full_meta_gradient(loss_fn: LossFn, params: Params, x: Tensor, y: Tensor, alpha: float) -> Params:
    """grad F_i(w) exactly, with f_i the loss on all of (x, y)."""
    grad_fn = grad(loss_fn)
    adapted = axpy(-alpha, grad_fn(params, x, y), params)
    g = grad_fn(adapted, x, y)
    hessian_g = jvp(lambda p: grad_fn(p, x, y), (params,), (g,))[1]
    return axpy(-alpha, hessian_g, g)


def stationarity(
    loss_fn: LossFn, params: Params, users: Sequence[UserSplit], alpha: float, user_ids: Optional[Sequence[int]] = None
) -> float:
    """||1/n sum_i grad F_i(w)||^2 over ``users`` (or those at ``user_ids``), each on its full
    training data."""
    chosen = list(range(len(users))) if user_ids is None else list(user_ids)
    if not chosen:
        raise ValueError("the stationarity measure needs at least one user")
    params = {k: v.detach() for k, v in params.items()}
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for i in chosen:
        user = users[i]
        total = axpy(1.0, full_meta_gradient(loss_fn, params, model_inputs(user.train_x), user.train_y, alpha), total)
    return float(sum((v / len(chosen)).pow(2).sum() for v in total.values()))
