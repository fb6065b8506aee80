"""Properties of the meta-gradient estimators and the local update (float64, small MLP)."""

import dataclasses

import pytest
import torch

from fedml_perfedavg.core.functional import make_loss_fn, parameters_of
from fedml_perfedavg.core.client_maths import (
    LocalBatches,
    LocalUpdateConfig,
    local_update,
    mean_figures,
    meta_gradient,
)
from fedml_perfedavg.models import MLP


def _problem(seed=0, batch=8, steps=1):
    torch.manual_seed(seed)
    model = MLP(6, 3, hidden=(5, 4)).double()
    make = lambda: (torch.randn(steps, batch, 6, dtype=torch.float64), torch.randint(0, 3, (steps, batch)))  # noqa
    d, dp, dpp = make(), make(), make()
    return model, make_loss_fn(model), parameters_of(model), LocalBatches(*d, *dp, *dpp)


def _autograd_meta_gradient(loss_fn, params, x_d, y_d, x_dp, y_dp, alpha):
    """grad of F(w) = f(w - alpha grad f(w; D); D'), by plain autograd through the inner step."""
    w = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    inner = torch.autograd.grad(loss_fn(w, x_d, y_d), list(w.values()), create_graph=True)
    adapted = {k: w[k] - alpha * g for k, g in zip(w, inner)}
    outer = torch.autograd.grad(loss_fn(adapted, x_dp, y_dp), list(w.values()))
    return dict(zip(w, outer))


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_exact_equals_autograd_gradient_of_meta_objective_when_hessian_batch_is_d():
    model, loss_fn, params, batches = _problem()
    step = batches.step(0)
    step = step._replace(third_x=step.x, third_y=step.y)
    alpha = 0.3
    expected = _autograd_meta_gradient(loss_fn, params, step.x, step.y, step.second_x, step.second_y, alpha)
    got = meta_gradient(loss_fn, params, step, "exact", alpha, delta=1e-3)
    assert _max_diff(got, expected) < 1e-12
    # and the Hessian term matters: first order is measurably different
    fo = meta_gradient(loss_fn, params, step, "fo", alpha, delta=1e-3)
    assert _max_diff(fo, expected) > 1e-4


def test_exact_uses_the_hessian_batch_d_double_prime():
    model, loss_fn, params, batches = _problem()
    step = batches.step(0)
    on_d = meta_gradient(loss_fn, params, step._replace(third_x=step.x, third_y=step.y), "exact", 0.3, 1e-3)
    on_dpp = meta_gradient(loss_fn, params, step, "exact", 0.3, 1e-3)
    assert _max_diff(on_d, on_dpp) > 1e-6


def test_hf_converges_to_exact_as_delta_shrinks():
    model, loss_fn, params, batches = _problem()
    step = batches.step(0)
    exact = meta_gradient(loss_fn, params, step, "exact", 0.3, delta=1.0)
    errors = [_max_diff(meta_gradient(loss_fn, params, step, "hf", 0.3, delta=d), exact) for d in (1e-1, 1e-2, 1e-3)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-7  # central differences: error ~ delta^2


def test_fo_equals_exact_when_alpha_is_zero():
    model, loss_fn, params, batches = _problem()
    step = batches.step(0)
    fo = meta_gradient(loss_fn, params, step, "fo", 0.0, 1e-3)
    exact = meta_gradient(loss_fn, params, step, "exact", 0.0, 1e-3)
    hf = meta_gradient(loss_fn, params, step, "hf", 0.0, 1e-3)
    assert _max_diff(fo, exact) == 0.0 and _max_diff(hf, exact) == 0.0


@pytest.mark.parametrize("variant", ["fo", "hf", "exact"])
def test_meta_step_starts_from_w_not_from_adapted_point(variant):
    """Regression: w <- w - beta * grad F(w), never w~ - beta * g."""
    model, loss_fn, params, batches = _problem()
    alpha, beta = 0.3, 0.05
    config = LocalUpdateConfig(variant=variant, alpha=alpha, beta=beta, delta=1e-4, local_steps=1)
    new = local_update(loss_fn, params, batches, config)
    step = batches.step(0)
    direction = meta_gradient(loss_fn, params, step, variant, alpha, 1e-4)
    from_w = {k: params[k] - beta * direction[k] for k in params}
    assert _max_diff(new, from_w) < 1e-14
    grads = torch.func.grad(loss_fn)(params, step.x, step.y)
    adapted = {k: params[k] - alpha * grads[k] for k in params}
    from_adapted = {k: adapted[k] - beta * direction[k] for k in params}
    assert _max_diff(new, from_adapted) > 1e-4


def test_several_steps_chain_from_the_updated_w():
    model, loss_fn, params, batches = _problem(steps=3)
    config = LocalUpdateConfig(variant="exact", alpha=0.1, beta=0.05, local_steps=3)
    got = local_update(loss_fn, params, batches, config)
    w = params
    for t in range(3):
        step = batches.step(t)
        direction = meta_gradient(loss_fn, w, step, "exact", 0.1, 1e-3)
        w = {k: w[k] - 0.05 * direction[k] for k in w}
    assert _max_diff(got, w) < 1e-14


def test_fedavg_is_plain_local_sgd_with_step_beta():
    model, loss_fn, params, batches = _problem(steps=2)
    config = LocalUpdateConfig(variant="sgd", beta=0.1, local_steps=2)
    got = local_update(loss_fn, params, batches, config)
    w = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.SGD(w.values(), lr=0.1)
    for t in range(2):
        opt.zero_grad()
        loss_fn(w, batches.x[t], batches.y[t]).backward()
        opt.step()
    assert _max_diff(got, {k: v.detach() for k, v in w.items()}) < 1e-14


def test_invalid_variant_and_method_are_rejected_with_the_allowed_values():
    with pytest.raises(ValueError, match="variant='so'.*fo"):
        LocalUpdateConfig(variant="so")
    with pytest.raises(ValueError, match="variant='fedavg'"):
        LocalUpdateConfig(variant="fedavg")


def test_reverse_mode_hvp_and_the_sequential_pair_equal_the_default_oracle_float64():
    """The fallbacks for models without forward-mode AD or vmap give the same numbers."""
    import torch
    from torch import nn

    from fedml_perfedavg.core.client_maths import FunctionalGradients, ReverseModeGradients, meta_gradient
    from fedml_perfedavg.core.functional import functional_network, make_loss_fn
    from fedml_perfedavg.core.sampling import sample_local_batches

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    loss_fn = make_loss_fn(functional_network(model))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(30, 5, dtype=torch.float64), torch.randint(0, 3, (30,))
    step = sample_local_batches(x, y, 1, (6, 6, 6), torch.Generator().manual_seed(1)).step(0)
    for variant in ("hf", "exact"):
        reference = meta_gradient(loss_fn, params, step, variant, 0.1, 1e-3, FunctionalGradients(loss_fn))
        for oracle in (ReverseModeGradients(loss_fn), FunctionalGradients(loss_fn, pair_by_vmap=False)):
            got = meta_gradient(loss_fn, params, step, variant, 0.1, 1e-3, oracle)
            for k in reference:
                torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)


def _figures_by_hand(loss_fn, network_params_and_batches, t):
    """(loss, accuracy) of step t's minibatch D at the iterate step t starts from."""
    model, params, batches, config = network_params_and_batches
    w_t = local_update(make_loss_fn(model), params, batches, dataclasses.replace(config, local_steps=t))
    x, y = batches.x[t], batches.y[t]
    logits = torch.func.functional_call(model, w_t, (x,))
    return float(loss_fn(w_t, x, y)), float((logits.argmax(-1) == y).double().mean())


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
def test_training_figures_are_each_steps_loss_and_accuracy_on_d_and_move_no_bit(variant):
    model, loss_fn, params, batches = _problem(batch=12, steps=4)
    config = LocalUpdateConfig(variant=variant, alpha=0.3, beta=0.5, delta=1e-3, local_steps=4)
    plain = local_update(loss_fn, params, batches, config)
    figures = []
    recorded = local_update(loss_fn, params, batches, config, figures=figures)
    assert all(torch.equal(recorded[k], plain[k]) for k in plain)  # recording changes no bit of the update
    assert len(figures) == 4
    steps = [mean_figures([step]) for step in figures]
    for t, step in enumerate(steps):  # the step's own forward pass at w_t, on D (never D' or D'')
        loss, accuracy = _figures_by_hand(loss_fn, (model, params, batches, config), t)
        assert float(step[0]) == pytest.approx(loss, abs=1e-12) and float(step[1]) == accuracy
    assert float(steps[-1][0]) < float(steps[0][0])  # it trained: the loss on D went down
    torch.testing.assert_close(mean_figures(figures), torch.stack(steps).mean(0), rtol=1e-14, atol=1e-14)


def test_a_loss_of_ones_own_gives_its_value_and_no_accuracy():
    model, loss_fn, params, batches = _problem(steps=2)

    def own_loss(p, x, y):  # a plain function: no with_figures beside it
        return loss_fn(p, x, y)

    figures = []
    local_update(own_loss, params, batches, LocalUpdateConfig(local_steps=2), figures=figures)
    first = mean_figures(figures[:1])
    assert float(first[0]) == pytest.approx(float(loss_fn(params, batches.x[0], batches.y[0])), abs=1e-12)
    assert torch.isnan(mean_figures(figures)[1])
