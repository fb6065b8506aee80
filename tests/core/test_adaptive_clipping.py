"""DP-SGD's adaptive clip bound (fedml_perfedavg.core.adaptive_clipping; Andrew et al. 2021): its
privacy cost against the Gaussian mechanism's closed form, its convergence to the target quantile,
its noise, the chain against per-sample gradients, and the refusals."""

import math
import statistics

import pytest
import torch
from torch import nn
from torch.func import grad, vmap

from fedml_perfedavg.core import adaptive_clipping
from fedml_perfedavg.core.client_maths import LocalUpdateConfig, Step
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.functional import functional_network, make_loss_fn
from fedml_perfedavg.core.hand_batched import hand_batched_gradients
from fedml_perfedavg.core.private_draws import draw_private_batches
from fedml_perfedavg.core.private_steps import PrivateSteps, private_update, single_sample_loss
from fedml_perfedavg.core.privacy import DPSGD

ADAPTIVE = {"clip": "adaptive"}


def _setup(n=50):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ELU(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    net = functional_network(module.double())
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return net, make_loss_fn(net), params, x, y


def _dp(**kwargs):
    return DPSGD(**{"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5, **ADAPTIVE, **kwargs})


@pytest.mark.parametrize("sigma, count_stddev", [(1.0, 2.0), (1.1, 0.6), (8.0, 16.0), (0.5, 10.0)])
def test_the_count_and_the_gradient_together_cost_one_use_at_sigma(sigma, count_stddev):
    """The Gaussian mechanism's RDP at order a is a * sensitivity^2 / (2 noise^2), and a joint
    release's is the sum: the gradient (sensitivity C, noise sigma_grad C) and the centred count
    (sensitivity 1/2, noise sigma_b) add up to one use at sigma, for every order alike."""
    sigma_grad = adaptive_clipping.gradient_noise_multiplier(sigma, count_stddev)
    assert sigma_grad > sigma
    for order in (1.5, 2.0, 8.0, 64.0):
        joint = order / (2 * sigma_grad**2) + order * 0.5**2 / (2 * count_stddev**2)
        assert joint == pytest.approx(order / (2 * sigma**2), rel=1e-12)
    # the default count noise takes a sixteenth of the budget at any sigma: sigma_grad = sigma * sqrt(16/15)
    assert _dp(noise_multiplier=sigma).gradient_noise_multiplier == pytest.approx(sigma * math.sqrt(16 / 15))


@pytest.mark.parametrize("quantile", [0.5, 0.9, 0.2])
@pytest.mark.parametrize("start", [0.01, 100.0])
def test_the_bound_converges_to_the_target_quantile_of_a_fixed_distribution(quantile, start):
    """Norms log-normal(0, 0.5), Poisson minibatches of expected size 40, the count noised at
    Andrew et al.'s sigma_b = 40 / 20: from four orders of magnitude away the bound settles at the
    distribution's quantile (its log within 0.08 of the true one, over the last 1000 uses)."""
    g = torch.Generator().manual_seed(0)
    bound = torch.tensor([start], dtype=torch.float64)
    logs = []
    for use in range(3000):
        mask = (torch.rand(1, 400, generator=g, dtype=torch.float64) < 0.1).to(torch.float64)
        norms = torch.exp(0.5 * torch.randn(1, 400, generator=g, dtype=torch.float64))
        noise = torch.randn(1, generator=g, dtype=torch.float64)
        bound = adaptive_clipping.updated_bounds(
            bound, norms, mask, noise, torch.tensor([40.0], dtype=torch.float64), 2.0, quantile, 0.2
        )
        if use >= 2000:
            logs.append(float(bound.log()))
    true_log = 0.5 * statistics.NormalDist().inv_cdf(quantile)
    assert abs(statistics.fmean(logs) - true_log) < 0.08, (statistics.fmean(logs), true_log)
    assert statistics.pstdev(logs) > 0.01  # it keeps moving with the noised counts


def test_one_use_moves_the_bound_by_its_noised_count_by_hand():
    """b = (sum of (1[norm <= C] - 1/2) + sigma_b xi) / m + 1/2; C <- C exp(-eta (b - gamma)),
    with the use's own draws; without the noise term the bound would land elsewhere."""
    _, loss, params, x, y = _setup()
    dp = _dp(max_grad_norm=0.3, target_quantile=0.7, clip_learning_rate=0.3, clip_count_stddev=3.0)
    bounds = adaptive_clipping.initial_bounds(1, 0.3)
    batches = draw_private_batches(x, y, [20], 1, params, torch.Generator().manual_seed(5), bounds)
    steps = PrivateSteps(loss, batches, Step.SGD, dp)
    steps.gradient(params, 0, 0)
    per_sample = vmap(grad(single_sample_loss(loss)), in_dims=(None, 0, 0))(params, batches.x[0, 0], batches.y[0, 0])
    norms = torch.sqrt(sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in per_sample.values()))
    centred = ((norms <= 0.3).double() - 0.5) * batches.mask[0, 0]
    xi = float(batches.count_noise[0, 0])
    fraction = (float(centred.sum()) + 3.0 * xi) / 20 + 0.5
    assert float(steps.bounds[0]) == pytest.approx(0.3 * math.exp(-0.3 * (fraction - 0.7)), rel=1e-12)
    noiseless = 0.3 * math.exp(-0.3 * (float(centred.sum()) / 20 + 0.5 - 0.7))
    assert abs(float(steps.bounds[0]) - noiseless) > 1e-3 and xi != 0.0
    assert torch.equal(bounds, adaptive_clipping.initial_bounds(1, 0.3))  # the caller's bounds are not changed


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_gradients_noise_is_sigma_grad_times_the_bound_under_adaptive_clipping(adaptive):
    """A use with no sample drawn is its noise alone: sigma_grad C noise / m under adaptive
    clipping (the count took its share of sigma's budget), sigma C noise / m with a fixed C."""
    _, loss, params, x, y = _setup()
    dp = _dp(max_grad_norm=2.0) if adaptive else DPSGD(noise_multiplier=1.0, max_grad_norm=2.0, delta=1e-5)
    bounds = adaptive_clipping.initial_bounds(1, 2.0) if adaptive else None
    batches = draw_private_batches(x, y, [20], 1, params, torch.Generator().manual_seed(5), bounds)
    batches = batches._replace(mask=torch.zeros_like(batches.mask))
    used = PrivateSteps(loss, batches, Step.SGD, dp).gradient(params, 0, 0)
    multiplier = math.sqrt(16 / 15) if adaptive else 1.0
    for k in params:
        expected = multiplier * 2.0 * batches.noise[k][0, 0] / 20
        assert torch.allclose(used[k], expected, rtol=1e-12, atol=0), k


def _per_sample_norms(loss, params, x, y):
    per_sample = vmap(grad(single_sample_loss(loss)), in_dims=(None, 0, 0))(params, x, y)
    return torch.sqrt(sum(v.reshape(v.shape[0], -1).pow(2).sum(1) for v in per_sample.values()))


@pytest.mark.parametrize("quantile", [0.5, 0.8])
def test_through_the_mechanism_the_bound_finds_the_quantile_of_the_users_own_norms(quantile):
    """A user's model held still (beta 0): its per-sample gradient norms are a fixed set, and
    after 300 uses its D bound has that fraction of them below it (by the chain's outer-product
    norms; torch.func's per-sample gradients agree on the first 20 uses)."""
    net, loss, params, x, y = _setup()
    dp = _dp(max_grad_norm=50.0, target_quantile=quantile, clip_count_stddev=0.6)
    bounds = adaptive_clipping.initial_bounds(1, 50.0)
    batches = draw_private_batches(x, y, [25], 300, params, torch.Generator().manual_seed(2), bounds)
    norms = _per_sample_norms(loss, params, x, y)
    chain = hand_batched_gradients(net, (1, 3, 4))[0]
    _, bound = private_update(loss, params, batches, LocalUpdateConfig("sgd", beta=0.0, local_steps=300), dp, chain)
    below = float((norms <= bound[0]).double().mean())
    assert abs(below - quantile) <= 0.12, (below, float(bound[0]), norms.sort().values)
    first = LocalUpdateConfig("sgd", beta=0.0, local_steps=20)
    (_, generic), (_, by_chain) = (private_update(loss, params, batches, first, dp, c) for c in (None, chain))
    assert torch.allclose(generic, by_chain, rtol=1e-12, atol=0) and float(generic[0]) < 50.0


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
def test_the_chain_moves_each_roles_bound_as_per_sample_gradients_do(variant):
    net, loss, params, x, y = _setup()
    chain = hand_batched_gradients(net, (1, 3, 4))[0]
    dp = _dp(noise_multiplier=0.7, max_grad_norm=0.05)
    config = LocalUpdateConfig(variant, alpha=0.05, beta=0.1, delta=0.001, local_steps=6)
    roles = Step(variant).batch_roles
    bounds = adaptive_clipping.initial_bounds(roles, 0.05)
    batches = draw_private_batches(x, y, [8] * roles, 6, params, torch.Generator().manual_seed(3), bounds)
    generic, generic_bounds = private_update(loss, params, batches, config, dp, chain=None)
    by_chain, chain_bounds = private_update(loss, params, batches, config, dp, chain=chain)
    assert generic_bounds.shape == (roles,) and not torch.equal(generic_bounds, bounds)
    assert torch.allclose(generic_bounds, chain_bounds, rtol=1e-12, atol=0)
    for k in params:
        assert torch.allclose(generic[k], by_chain[k], atol=1e-12, rtol=1e-12), k
    if roles == 3:  # the second-order term's norms have a scale of their own, and so has its bound
        assert float(generic_bounds[2]) != pytest.approx(float(generic_bounds[0]), rel=0.05)


SECTION = {"enable_dp": True, "dp_solution_type": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"clip": "auto"}, r"dp_args.clip='auto': allowed: \['fixed', 'adaptive'\]"),
        ({**ADAPTIVE, "target_quantile": 0.0}, r"dp_args.target_quantile=0.0: must be in \(0, 1\)"),
        ({**ADAPTIVE, "target_quantile": 1}, r"dp_args.target_quantile=1: must be in \(0, 1\)"),
        ({**ADAPTIVE, "target_quantile": "half"}, r"dp_args.target_quantile='half': must be a finite number"),
        ({**ADAPTIVE, "clip_learning_rate": 0}, r"dp_args.clip_learning_rate=0: must be > 0"),
        ({**ADAPTIVE, "clip_count_stddev": 0.5}, r"dp_args.clip_count_stddev=0.5: must be above noise_multiplier / 2"),
        ({"target_quantile": 0.5}, r"dp_args.target_quantile=0.5: a key of clip: 'adaptive'; here clip='fixed'"),
    ],
)
def test_bad_adaptive_clipping_settings_are_refused_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        DPSGD.from_section({**SECTION, **change})


def test_the_settings_state_the_mode_and_what_it_adds():
    fixed = DPSGD.from_section(SECTION)
    assert fixed.settings()["clip"] == "fixed" and "target_quantile" not in fixed.settings()
    adaptive = DPSGD.from_section({**SECTION, **ADAPTIVE, "target_quantile": 0.7})
    keys = ("clip", "target_quantile", "clip_learning_rate", "clip_count_stddev")
    assert {k: adaptive.settings()[k] for k in keys} == {
        "clip": "adaptive",
        "target_quantile": 0.7,
        "clip_learning_rate": 0.2,
        "clip_count_stddev": 2.0,
    }
    assert adaptive.settings()["gradient_noise_multiplier"] == pytest.approx(math.sqrt(16 / 15))
    assert "adaptive from 1 toward quantile 0.7" in adaptive.clip_label and fixed.clip_label == "C 1"


def test_the_docs_adaptive_block_runs_as_it_says():
    """docs/security.md's ``clip: adaptive`` YAML, on top of its DP-SGD example: accepted, with
    the defaults it states (sigma_b = 2 sigma, eta 0.2, the median)."""
    import re

    import yaml

    from tests.helpers import REPO

    text = (REPO / "docs" / "security.md").read_text()
    blocks = [yaml.safe_load(b)["dp_args"] for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "dp_args" in b]
    [example] = [b for b in blocks if b.get("dp_solution_type") == "dpsgd"]
    [adaptive] = [b for b in blocks if "target_quantile" in b]
    assert example["clip"] == "adaptive"  # the example the deployment runs
    dp = DPSGD.from_section({**example, **{k: v for k, v in adaptive.items() if v is not None}})
    assert dp.adaptive and dp.target_quantile == 0.5 and dp.clip_learning_rate == 0.2
    assert dp.clip_count_stddev == 2 * dp.noise_multiplier
    assert dp.gradient_noise_multiplier == pytest.approx(dp.noise_multiplier * 1.0328, rel=1e-4)  # "+3.3%"
