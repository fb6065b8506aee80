"""Hand-batched gradients equal torch.func's (float64) on every chain they accept, and refuse
what they cannot compute exactly, saying why."""

import pytest
import torch
from torch import nn
from torch.func import grad, jvp, vmap

from fedml_perfedavg.core.functional import functional_network, make_loss_fn, parameters_of
from fedml_perfedavg.core.client_maths import LocalBatches, LocalUpdateConfig, local_update, mean_figures
from fedml_perfedavg.core.hand_batched import IndexedInputs, hand_batched_gradients
from fedml_perfedavg.models import MLP, SmallCNN

CHAINS = {
    "paper_mlp": lambda: MLP(12, 3, (5, 4)),
    "relu_no_bias": lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 6, bias=False), nn.ReLU(), nn.Linear(6, 3)),
    "tanh_sigmoid_output": lambda: nn.Sequential(nn.Linear(12, 4), nn.Tanh(), nn.Linear(4, 3), nn.Sigmoid()),
    "logistic": lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 3)),
}


def _client_params(model, clients):
    """The model's parameters for ``clients`` clients, each slightly perturbed."""
    return {
        k: v.expand(clients, *v.shape) + 0.1 * torch.randn(clients, *v.shape, dtype=torch.float64)
        for k, v in parameters_of(model).items()
    }


def _chain(name, seed, clients, batch):
    """(stacked gradients, functional network, per-client parameters, x, y) for a chain of CHAINS."""
    torch.manual_seed(seed)
    model = CHAINS[name]().double()
    network = functional_network(model)
    stacked, why = hand_batched_gradients(network, (12,))
    assert stacked is not None, why
    params = _client_params(model, clients)
    x, y = torch.randn(clients, batch, 12, dtype=torch.float64), torch.randint(0, 3, (clients, batch))
    return stacked, network, params, x, y


@pytest.mark.parametrize("name", CHAINS)
def test_gradients_and_hessian_vector_products_equal_torch_func(name):
    stacked, network, params, x, y = _chain(name, seed=0, clients=4, batch=7)
    loss_fn = make_loss_fn(network)
    expected = vmap(grad(loss_fn))(params, x, y)
    got = stacked.grad(params, x, y)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-12, atol=1e-14)
    tangent = {k: torch.randn_like(v) for k, v in params.items()}
    _, hvp = jvp(lambda p: stacked.grad(p, x, y), (params,), (tangent,))
    _, expected_hvp = vmap(lambda p, t, xx, yy: jvp(lambda q: grad(loss_fn)(q, xx, yy), (p,), (t,)))(
        params, tangent, x, y
    )
    for k in hvp:
        torch.testing.assert_close(hvp[k], expected_hvp[k], rtol=1e-10, atol=1e-12)
    by_hand = stacked.hessian_vector_product(params, tangent, x, y)  # the R-operator the exact variant uses
    for k in by_hand:
        torch.testing.assert_close(by_hand[k], expected_hvp[k], rtol=1e-10, atol=1e-12)
    pair = {k: torch.stack((v, 2 * v)) for k, v in params.items()}
    both = stacked.grad_pair(pair, x, y)
    for k in both:
        torch.testing.assert_close(both[k][1], stacked.grad({q: 2 * v for q, v in params.items()}, x, y)[k])


class Shortcut(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.second(x + torch.relu(self.first(x)))


@pytest.mark.parametrize(
    "model,reason",
    [
        (SmallCNN((1, 4, 4), 3), "neither an nn.Sequential nor a wrapper of one"),
        (
            nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3)),
            "not a chain of Linear and ELU/ReLU/Tanh/Sigmoid (Conv2d)",
        ),
        (nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), "(BatchNorm1d)"),
        (nn.Sequential(nn.Linear(16, 4), nn.ELU(), nn.ELU(), nn.Linear(4, 3)), "not a chain"),
        (Shortcut(), "neither an nn.Sequential nor a wrapper of one"),
    ],
)
def test_what_is_not_a_plain_chain_is_refused_with_a_reason(model, reason):
    shape = (1, 4, 4) if not isinstance(model, Shortcut) else (12,)
    stacked, why = hand_batched_gradients(functional_network(model), shape)
    assert stacked is None and reason in why


class Doubling(nn.Module):
    """Wraps one Sequential but does more than call it: caught by the probe."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))

    def forward(self, x):
        return 2 * self.net(x)


def test_a_wrapper_that_changes_the_chains_output_is_refused():
    stacked, why = hand_batched_gradients(functional_network(Doubling()), (12,))
    assert stacked is None and why == "its forward pass is not the chain of its layers"


@pytest.mark.parametrize("name", CHAINS)
def test_fused_finite_difference_hvp_equals_the_two_gradients(name):
    stacked, _, params, x, y = _chain(name, seed=1, clients=3, batch=5)
    delta = 1e-3
    direction = {k: torch.randn_like(v) for k, v in params.items()}
    plus = stacked.grad({k: v + delta * direction[k] for k, v in params.items()}, x, y)
    minus = stacked.grad({k: v - delta * direction[k] for k, v in params.items()}, x, y)
    got = stacked.finite_difference_hvp(params, direction, x, y, delta)
    for k in params:
        torch.testing.assert_close(got[k], (plus[k] - minus[k]) / (2 * delta), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
@pytest.mark.parametrize("name", CHAINS)
def test_buffered_local_update_is_the_generic_loop_bit_for_bit(name, variant):
    # float32, as runs train: the flat reused buffers must not move a single bit
    torch.manual_seed(2)
    model = CHAINS[name]()
    stacked, why = hand_batched_gradients(functional_network(model), (12,))
    assert stacked is not None, why
    clients, steps = 5, 3
    start = {k: v.expand(clients, *v.shape) for k, v in parameters_of(model).items()}
    batches = LocalBatches(
        *(t for _ in range(3) for t in (torch.randn(steps, clients, 6, 12), torch.randint(0, 3, (steps, clients, 6))))
    )
    config = LocalUpdateConfig(variant=variant, alpha=0.3, beta=0.2, delta=1e-3, local_steps=steps)
    expected = local_update(
        make_loss_fn(functional_network(model)), {k: v.clone() for k, v in start.items()}, batches, config, stacked
    )
    for _ in range(2):  # the second call reuses the first one's buffers
        got = stacked.local_update(start, batches, config)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not torch.equal(got[next(iter(got))], start[next(iter(got))])  # it did train


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
def test_inputs_gathered_a_step_at_a_time_give_the_same_bits(variant):
    torch.manual_seed(3)
    model = CHAINS["paper_mlp"]()
    stacked, _ = hand_batched_gradients(functional_network(model), (12,))
    clients, steps, batch = 4, 3, 6
    data, labels = torch.randn(50, 12), torch.randint(0, 3, (50,))
    index = [torch.randint(0, 50, (steps, clients, batch)) for _ in range(3)]
    gathered = LocalBatches(*(t for i in index for t in (data[i], labels[i])))
    lazy = LocalBatches(*(t for i in index for t in (IndexedInputs(data, i), labels[i])))
    start = {k: v.expand(clients, *v.shape) for k, v in parameters_of(model).items()}
    config = LocalUpdateConfig(variant=variant, alpha=0.3, beta=0.2, delta=1e-3, local_steps=steps)
    expected = stacked.local_update(start, gathered, config)
    got = stacked.local_update(start, lazy, config)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(IndexedInputs(data, index[1]).step(2), data[index[1][2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_curvature_mask_is_torch_where_bit_for_bit(dtype):
    # the exact variant's ELU curvature zeroes by bits what torch.where(z > 0, 0.0, v) zeroes
    from fedml_perfedavg.core.hand_batched import _zero_where_positive

    torch.manual_seed(0)
    z, value = torch.randn(2, 3, 41, 37, dtype=dtype), torch.randn(2, 3, 41, 37, dtype=dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf")], dtype=dtype)
    z[0, 0, 0, :6], value[0, 0, 1, :6], value[0, 0, 0, :6] = specials, specials, specials.flip(0)
    value[1, 2, :, :6] = -0.0
    expected = torch.where(z > 0, 0.0, value)
    got = _zero_where_positive(value.clone(), z)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(got.view(bits), expected.view(bits))
    assert (got[z > 0] == 0).all() and not torch.signbit(got[z > 0]).any()
    odd = value.clone().transpose(2, 3)  # not contiguous: torch.where itself
    assert torch.equal(
        _zero_where_positive(odd, z.transpose(2, 3)).view(bits), torch.where(z.transpose(2, 3) > 0, 0.0, odd).view(bits)
    )


def test_in_place_baddbmm_is_baddbmm_bit_for_bit():
    # the exact HVP accumulates into a product's result in place (no copy of it); same numbers
    torch.manual_seed(0)
    for c, b, m, n in [(10, 40, 80, 60), (10, 40, 60, 10), (10, 80, 40, 784), (3, 7, 5, 4)]:
        acc, left, right = torch.randn(c, b, n), torch.randn(c, b, m), torch.randn(c, m, n)
        assert torch.equal(acc.clone().baddbmm_(left, right), torch.baddbmm(acc, left, right))
        assert torch.equal(
            acc.clone().baddbmm_(left, right), torch.baddbmm(acc, left, right, out=torch.empty_like(acc))
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(10, 40, 80), (3, 7, 5), (50, 40, 80), (1, 1, 33)])
def test_elu_slope_times_a_signal_is_the_backward_kernel_bit_for_bit(shape, dtype):
    from fedml_perfedavg.core.hand_batched import _activation

    torch.manual_seed(0)
    elu = _activation(nn.ELU())
    z, d = 4 * torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -90.0, -800.0, 1e-30], dtype=dtype)
    z.view(-1)[:8], d.view(-1)[8:16] = specials, specials
    h = elu.forward(z)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    expected = elu.backward(d, z, h)
    assert torch.equal((d * elu.slope(z, h)).view(bits), expected.view(bits))
    assert _activation(nn.ELU(alpha=0.5)).slope is None  # alpha * exp(z) is not d-free: no slope


def test_exact_hvp_is_the_same_with_and_without_the_slope_shortcut():
    import dataclasses

    torch.manual_seed(0)
    model = MLP(784, 10, (80, 60))
    stacked, why = hand_batched_gradients(functional_network(model), (784,))
    assert stacked is not None, why
    assert all(layer.activation.slope is not None for layer in stacked.layers[:-1])
    params = {k: v.expand(10, *v.shape) + 0.05 * torch.randn(10, *v.shape) for k, v in parameters_of(model).items()}
    tangent = {k: 0.01 * torch.randn_like(v) for k, v in params.items()}
    x, y = torch.rand(10, 40, 784), torch.randint(0, 10, (10, 40))
    with_slope = stacked.hessian_vector_product(params, tangent, x, y)
    stacked.layers = [
        dataclasses.replace(layer, activation=layer.activation and dataclasses.replace(layer.activation, slope=None))
        for layer in stacked.layers
    ]
    without = stacked.hessian_vector_product(params, tangent, x, y)
    for k in with_slope:
        assert torch.equal(with_slope[k], without[k]), k


def test_the_slope_shortcut_is_not_taken_for_half_types():
    # a half-precision backward kernel rounds once; d times a rounded slope would round twice
    from fedml_perfedavg.core.hand_batched import _activation, _LayerDerivative

    elu = _activation(nn.ELU())
    z = torch.randn(4, 5, 6, dtype=torch.bfloat16)
    assert _LayerDerivative(elu, z, elu.forward(z)).slope is None
    assert _LayerDerivative(elu, z.float(), elu.forward(z.float())).slope is not None


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
@pytest.mark.parametrize("name", CHAINS)
def test_hand_batched_training_figures_are_torch_funcs_and_move_no_bit(name, variant):
    # float64: each client's figures equal its own torch.func update's; the update's bits are the same
    torch.manual_seed(3)
    model = CHAINS[name]().double()
    network = functional_network(model)
    stacked, why = hand_batched_gradients(network, (12,))
    assert stacked is not None, why
    clients, steps = 4, 3
    start = {k: v.expand(clients, *v.shape).clone() for k, v in parameters_of(model).items()}
    batches = LocalBatches(
        *(
            t
            for _ in range(3)
            for t in (torch.randn(steps, clients, 6, 12, dtype=torch.float64), torch.randint(0, 3, (steps, clients, 6)))
        )
    )
    config = LocalUpdateConfig(variant=variant, alpha=0.3, beta=0.2, delta=1e-3, local_steps=steps)
    plain = stacked.local_update(start, batches, config)
    plain = {k: v.clone() for k, v in plain.items()}
    figures = []
    recorded = stacked.local_update(start, batches, config, figures)
    assert all(torch.equal(recorded[k], plain[k]) for k in plain)
    got = mean_figures(figures)  # (clients, 2)
    assert got.shape == (clients, 2)
    loss_fn = make_loss_fn(network)
    for client in range(clients):
        own = []
        mine = LocalBatches(*(t[:, client] for t in batches))
        local_update(loss_fn, {k: v[client] for k, v in start.items()}, mine, config, figures=own)
        torch.testing.assert_close(got[client], mean_figures(own), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
def test_a_first_layer_kept_transposed_moves_no_bit_and_is_used_where_exact(variant, monkeypatch):
    """The local update keeps the first layer's weight transposed (a contiguous right operand for
    x W^T, 1.4x faster on the AVX-512 machines) only where this CPU's products give the same bits
    either way (the probe); the result then is the plain layout's bit for bit, and comes back
    contiguous in the model's layout."""
    import fedml_perfedavg.core.hand_batched as hand_batched

    exact_here = hand_batched.transposed_storage_is_exact(3, 40, 784, 80, torch.float32)
    torch.manual_seed(4)
    clients = 3
    model, start, batches, config = _paper_mlp_update(variant, clients=clients, steps=2)
    results = {}
    for transposed in (True, False):
        monkeypatch.setattr(hand_batched, "transposed_storage_is_exact", lambda *shape, answer=transposed: answer)
        stacked, _ = hand_batched_gradients(functional_network(model), (1, 28, 28))
        results[transposed] = stacked.local_update(start, batches, config)
        (layout_key,) = stacked._work
        assert layout_key[1] == (("net.1.weight",) if transposed else ())
        kept = stacked._work[layout_key]["meta"][1]["net.1.weight"]
        assert kept.shape == (clients, 80, 784) and kept.transpose(1, 2).is_contiguous() == transposed
        assert all(v.is_contiguous() and v.shape == start[k].shape for k, v in results[transposed].items())
    same = [torch.equal(results[True][k], results[False][k]) for k in start]
    if exact_here:
        assert all(same)
    else:  # another CPU's kernels: the probe keeps the plain layout there; the numbers still agree
        assert all(torch.allclose(results[True][k], results[False][k], atol=1e-6) for k in start)


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf"])
def test_a_direction_folded_into_the_move_moves_no_bit(variant, monkeypatch):
    """SGD's and FO's move takes the first-layer weight part of its direction as one product into
    w (WeightProduct.add_to, once a step) where this CPU's epilogue gives the separate passes'
    bits; HF never folds (its g is the Hessian's direction). Same bits either way, where exact."""
    import fedml_perfedavg.core.hand_batched as hand_batched

    exact_here = hand_batched.folded_update_is_exact(3, 40, 784, 80, torch.float32, (-0.05,), True)
    torch.manual_seed(5)
    steps = 3
    model, start, batches, config = _paper_mlp_update(variant, clients=3, steps=steps)
    calls = []
    add_to = hand_batched.WeightProduct.add_to
    monkeypatch.setattr(hand_batched.WeightProduct, "add_to", lambda self, *a: calls.append(1) or add_to(self, *a))
    results = {}
    for folds in (True, False):
        monkeypatch.setattr(hand_batched, "folded_update_is_exact", lambda *shape, answer=folds: answer)
        stacked, _ = hand_batched_gradients(functional_network(model), (1, 28, 28))
        calls.clear()
        results[folds] = stacked.local_update(start, batches, config)
        assert len(calls) == (steps if folds and variant != "hf" else 0)
    if exact_here:
        assert all(torch.equal(results[True][k], results[False][k]) for k in start)
    else:
        assert all(torch.allclose(results[True][k], results[False][k], atol=1e-6) for k in start)
    assert not torch.equal(results[True]["net.1.weight"], start["net.1.weight"])  # it did train


def _paper_mlp_update(variant, clients, steps, batch=40):
    """The paper's MLP (784-80-60-10), its parameters for ``clients`` clients, random minibatches
    of ``batch`` for ``steps`` steps, and a local update's config of ``variant``."""
    model = MLP(784, 10, (80, 60))
    start = {k: v.expand(clients, *v.shape) for k, v in parameters_of(model).items()}
    batches = LocalBatches(
        *(
            t
            for _ in range(3)
            for t in (torch.rand(steps, clients, batch, 784), torch.randint(0, 10, (steps, clients, batch)))
        )
    )
    config = LocalUpdateConfig(variant=variant, alpha=0.01, beta=0.05, delta=1e-3, local_steps=steps)
    return model, start, batches, config


def test_off_the_cpu_the_local_update_keeps_the_plain_layout_and_passes():
    """The transposed layout and the folded move are probed on the CPU's kernels; on any other
    device (cuBLAS reads either layout at full speed, and its epilogue may fuse) both stay off,
    so the CUDA path is the one measured on the H100 and H200."""
    model = MLP(784, 10, (80, 60))
    stacked, _ = hand_batched_gradients(functional_network(model), (1, 28, 28))
    on_meta = {k: torch.empty(3, *v.shape, device="meta") for k, v in parameters_of(model).items()}
    assert stacked.transposed_weights(on_meta, [40]) == frozenset()
    assert stacked.folds_updates(on_meta, [40], (-0.001,), False) is False
    on_cpu = {k: v.expand(3, *v.shape) for k, v in parameters_of(model).items()}
    assert stacked.folds_updates(on_cpu, [40], (0.0,), False) is False  # a zero step: MKL may skip the product
