"""The stationarity measure ||grad F(w)||^2: exact, on full data, against closed forms."""

import torch
from torch.func import grad

from fedml_perfedavg.core.stationarity import full_meta_gradient, stationarity
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.core.functional import functional_network, make_loss_fn
from fedml_perfedavg.models import MLP


def _least_squares(params, x, y):
    return 0.5 * ((x @ params["w"] - y) ** 2).mean()


def _users(sizes, dim=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        UserSplit(
            torch.randn(n, dim, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64),
            torch.zeros(1, dim),
            torch.zeros(1),
        )
        for n in sizes
    ]


def test_least_squares_meta_gradient_matches_the_closed_form():
    # f(w) = 1/2N ||Xw - y||^2: grad f = A w - c with A = X'X/N, c = X'y/N, Hessian A, so
    # grad F(w) = (I - alpha A)(A (w - alpha (A w - c)) - c).
    (user,) = _users([17])
    x, y, alpha = user.train_x, user.train_y, 0.3
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    a, c = x.T @ x / len(y), x.T @ y / len(y)
    eye = torch.eye(3, dtype=torch.float64)
    expected = (eye - alpha * a) @ (a @ (w - alpha * (a @ w - c)) - c)
    got = full_meta_gradient(_least_squares, {"w": w}, x, y, alpha)["w"]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_stationarity_is_the_squared_norm_of_the_users_mean():
    users, alpha = _users([10, 14, 9]), 0.1
    w = {"w": torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)}
    per_user = [full_meta_gradient(_least_squares, w, u.train_x, u.train_y, alpha)["w"] for u in users]
    mean = sum(per_user) / 3
    assert abs(stationarity(_least_squares, w, users, alpha) - float(mean @ mean)) < 1e-12
    # only the chosen users count (the training users when some are held out)
    only = (per_user[0] + per_user[2]) / 2
    assert abs(stationarity(_least_squares, w, users, alpha, [0, 2]) - float(only @ only)) < 1e-12


def test_network_meta_gradient_equals_differentiating_through_the_inner_step():
    torch.manual_seed(0)
    network = functional_network(MLP(5, 3, (4,)).double())
    loss_fn = make_loss_fn(network)
    params = {k: v.detach() for k, v in network.named_parameters()}
    x, y, alpha = torch.randn(30, 5, dtype=torch.float64), torch.randint(0, 3, (30,)), 0.2

    def meta_objective(p):  # F_i(w) = f_i(w - alpha grad f_i(w)), differentiated by autograd through grad
        inner = grad(loss_fn)(p, x, y)
        return loss_fn({k: p[k] - alpha * inner[k] for k in p}, x, y)

    expected = grad(meta_objective)(params)
    got = full_meta_gradient(loss_fn, params, x, y, alpha)
    for k in params:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-10, atol=1e-12)
