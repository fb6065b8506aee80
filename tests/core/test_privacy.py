"""DP-SGD's settings, draws and mechanism (fedml_perfedavg.core.privacy, private_draws,
private_steps): clipping, noise, Poisson draws, the chain's outer-product clipping against
per-sample gradients, and the accountant against Opacus'."""

import pytest
import torch
from torch import nn
from torch.func import grad

from fedml_perfedavg.core.client_maths import LocalUpdateConfig, Step
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.functional import functional_network, make_loss_fn
from fedml_perfedavg.core.hand_batched import hand_batched_gradients
from fedml_perfedavg.core.accounting import rdp_epsilon as epsilon_of
from fedml_perfedavg.core.ledger import PrivacyLedger, UseRules
from fedml_perfedavg.core.private_draws import PrivateBatches, draw_private_batches, one_client, poisson_draw
from fedml_perfedavg.core.private_steps import (
    PrivateChainSteps,
    PrivateSteps,
    clip_and_sum,
    per_sample_problem,
    private_update,
)
from fedml_perfedavg.core.privacy import DPSGD


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ELU(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    return net.to(dtype)


def _setup(dtype=torch.float64, n=50):
    net = functional_network(_mlp(dtype))
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, 3, 4, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return net, make_loss_fn(net), params, x, y


def _full_batches(x, y, params, roles=3, steps=1, zero_noise=True):
    """Every sample in every minibatch (mask 1, expected size n) and zero noise: the mechanism
    reduces to the clipped mean."""
    n = len(y)
    return PrivateBatches(
        x.expand(roles, steps, *x.shape).clone(),
        y.expand(roles, steps, n).clone(),
        torch.ones(roles, steps, n, dtype=x.dtype),
        {k: torch.zeros(roles, steps, *p.shape, dtype=p.dtype) for k, p in params.items()},
        torch.full((roles,), float(n), dtype=x.dtype),
    )


def test_with_a_huge_clip_bound_and_no_noise_the_clipped_sum_is_the_batch_gradient():
    _, loss, params, x, y = _setup()
    batch_gradient = grad(loss)(params, x, y)
    dp = DPSGD(noise_multiplier=1e-12, max_grad_norm=1e12, delta=1e-5)
    for chain in (False, True):
        batches = _full_batches(x, y, params)
        if chain:
            net = functional_network(_mlp())
            steps = PrivateChainSteps(hand_batched_gradients(net, (1, 3, 4))[0], one_client(batches), Step.SGD, dp)
            got = {k: v[0] for k, v in steps.gradient({k: v.unsqueeze(0) for k, v in params.items()}, 0, 0).items()}
        else:
            got = PrivateSteps(loss, batches, Step.SGD, dp).gradient(params, 0, 0)
        for k in params:
            assert torch.allclose(got[k], batch_gradient[k], atol=1e-6, rtol=0), (chain, k)


def test_a_sample_whose_gradient_is_above_the_bound_is_clipped_to_it_and_one_below_is_not():
    per_sample = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]]), "b": torch.zeros(2, 1)}
    alone = [clip_and_sum({k: v[i : i + 1] for k, v in per_sample.items()}, torch.ones(1), 1.0) for i in (0, 1)]
    assert torch.allclose(alone[0]["w"], torch.tensor([0.6, 0.8]))  # norm 5 -> 1
    assert torch.allclose(alone[1]["w"], torch.tensor([0.3, 0.4]))  # norm 0.5 stays
    masked = clip_and_sum(per_sample, torch.tensor([0.0, 1.0]), 1.0)  # padding contributes nothing
    assert torch.allclose(masked["w"], torch.tensor([0.3, 0.4]))


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
@pytest.mark.parametrize("clip", [1e9, 0.05])
def test_the_chain_clips_by_outer_products_as_per_sample_gradients_do(variant, clip):
    net, loss, params, x, y = _setup()
    chain = hand_batched_gradients(net, (1, 3, 4))[0]
    dp = DPSGD(noise_multiplier=0.7, max_grad_norm=clip, delta=1e-5)
    config = LocalUpdateConfig(variant, alpha=0.05, beta=0.1, delta=0.001, local_steps=3)
    roles = Step(variant).batch_roles
    batches = draw_private_batches(x, y, [8] * roles, 3, params, torch.Generator().manual_seed(3))
    generic = private_update(loss, params, batches, config, dp, chain=None)[0]
    by_chain = private_update(loss, params, batches, config, dp, chain=chain)[0]
    moved = max(float((generic[k] - params[k]).abs().max()) for k in params)
    assert moved > 1e-3
    for k in params:
        assert torch.allclose(generic[k], by_chain[k], atol=1e-12, rtol=1e-12), k


def test_the_second_order_term_is_clipped_as_one_vector():
    """HF's D'' term: with C tiny, each sample's finite difference counts C at most, so the
    correction's size is bounded by alpha * (C * |D''| + noise) / expected size."""
    _, loss, params, x, y = _setup()
    dp = DPSGD(noise_multiplier=1e-12, max_grad_norm=1e-3, delta=1e-5)
    batches = _full_batches(x, y, params)
    steps = PrivateSteps(loss, batches, Step.HF, dp)
    g = {k: torch.ones_like(v) for k, v in params.items()}
    term = steps.hessian_times(params, g, 0, 1e-3)
    norm = torch.sqrt(sum(v.pow(2).sum() for v in term.values()))
    assert norm <= 1e-3 * (1 + 1e-9)


def test_poisson_draws_have_the_rate_asked_and_distinct_sorted_indices():
    index, mask, expected = poisson_draw(200, [20, 50], 400, torch.Generator().manual_seed(0))
    assert expected.tolist() == [20.0, 50.0]
    sizes = mask.sum(-1)
    assert abs(float(sizes[0].mean()) - 20) < 1 and abs(float(sizes[1].mean()) - 50) < 1.5
    assert float(sizes[0].var()) > 10  # a Binomial's spread, not a fixed size
    for role in range(2):
        for t in range(5):
            chosen = index[role, t, : int(sizes[role, t])]
            assert len(set(chosen.tolist())) == len(chosen) and torch.equal(chosen, chosen.sort().values)
    # all data when the batch is at least the data
    _, mask_all, expected_all = poisson_draw(10, [40], 3, torch.Generator().manual_seed(0))
    assert expected_all.tolist() == [10.0] and bool((mask_all == 1).all())


def test_the_noise_is_really_there():
    _, loss, params, x, y = _setup()
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    config = LocalUpdateConfig("hf", alpha=0.05, beta=0.1, delta=0.001, local_steps=2)
    outs = []
    for seed in (0, 1):
        batches = draw_private_batches(x, y, [50, 50, 50], 2, params, torch.Generator().manual_seed(seed))
        batches = batches._replace(mask=torch.ones_like(batches.mask))  # same samples: only the noise differs
        batches = batches._replace(x=x.expand(3, 2, *x.shape), y=y.expand(3, 2, 50))
        outs.append(private_update(loss, params, batches, config, dp)[0])
    assert max(float((outs[0][k] - outs[1][k]).abs().max()) for k in params) > 1e-3


def test_epsilon_is_opacus_rdp_accountant_on_the_same_history():
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(1.3, 0.05, 120), (1.3, 0.1, 7)]
    assert epsilon_of({0.05: 120, 0.1: 7}, 1.3, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert epsilon_of({}, 1.3, 1e-5) == 0.0


def test_the_ledger_counts_each_round_and_user_once_and_survives_a_checkpoint():
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    rules = UseRules.of(Step.HF, (8, 8, 4), local_steps=3, eval_batch=8, adapt_steps=1)
    ledger = PrivacyLedger(dp, rules, {0: 40, 1: 80})
    ledger.trained(0, [0, 1])
    ledger.trained(0, [0])  # computed again (same keyed draws): the same release, not a new one
    ledger.evaluated(0, [0, 1])
    # D and D' (8 of 40: rate 0.2) and D'' (4 of 40) for 3 steps, once; one evaluation step (8 of 40)
    assert ledger.uses[0] == {0.2: 3 + 3 + 1, 0.1: 3}
    assert ledger.uses[1] == {0.1: 3 + 3 + 1, 0.05: 3}
    again = PrivacyLedger(dp, rules, {0: 40, 1: 80})
    again.load_state_dict(ledger.state_dict())
    assert again.uses == ledger.uses and again.report() == ledger.report()
    report = ledger.report()  # a running record: the RDP bounds
    assert report["per_user"]["0"]["uses"] == 10 and report["per_user"]["0"]["sample_rate"] == 0.2
    assert report["epsilon"] == max(ledger.bound(0), ledger.bound(1)) > 0 and report["epsilon_from"] == "opacus.rdp"
    final = ledger.report(final=True)  # the run's last record: the accountant's (PRV) figures
    assert final["epsilon"] == max(ledger.epsilon(0), ledger.epsilon(1)) and final["epsilon_from"] == "opacus.prv"
    for user in ("0", "1"):
        assert (
            final["per_user"][user]["epsilon"]
            < final["per_user"][user]["epsilon_rdp"]
            == report["per_user"][user]["epsilon"]
        )


def test_a_new_ledger_has_its_accountant_ready_before_any_round():
    """A silo's first evaluation report must not import Opacus inside the round's deadline (a fresh-
    clone run beside busy loops: both silos missed round 0's 10 s deadline doing so)."""
    from fedml_perfedavg.core import accounting

    accounting._rdp_of_one_use.cache_clear()
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)
    PrivacyLedger(dp, UseRules.of(Step.HF, (8, 8, 4), local_steps=3, eval_batch=8, adapt_steps=1), {0: 40, 1: 80})
    # the rates 0.2, 0.1 (user 0) and 0.1, 0.05 (user 1), each computed once already
    assert accounting._rdp_of_one_use.cache_info().currsize == 3
    calls = accounting._rdp_of_one_use.cache_info().misses
    accounting.rdp_epsilon({0.2: 7, 0.1: 3, 0.05: 1}, 1.1, 1e-5)
    assert accounting._rdp_of_one_use.cache_info().misses == calls


# Google dp-accounting 0.6.0's PLD accountant (an independent implementation: privacy loss
# distributions, not Opacus' PRVs), value_discretization_interval 1e-4, delta 1e-5, computed with
# `PLDAccountant(1e-4).compose(ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q,
# GaussianDpEvent(sigma)), count) ...])).get_epsilon(1e-5)` in a venv of its own, 2026-11-28.
GOOGLE_PLD = [
    ({0.0408: 1200, 0.0816: 60}, 1.1, 8.95607),
    ({0.05: 300}, 8.0, 0.37762),
    ({0.08: 400}, 100.0, 0.04594),
    ({8 / 24: 100}, 1.1, 21.6247),
    ({0.05: 120, 0.1: 7}, 1.3, 2.60576),
]


@pytest.mark.parametrize("uses, sigma, google", GOOGLE_PLD)
def test_the_tight_accountant_agrees_with_googles_pld_and_stays_below_the_rdp_bound(uses, sigma, google):
    from fedml_perfedavg.core.accounting import prv_epsilon, rdp_epsilon, within

    tight, bound = prv_epsilon(uses, sigma, 1e-5), rdp_epsilon(uses, sigma, 1e-5)
    # an upper estimate: at or above the PLD figure, by PRV_RELATIVE_ERROR of the bound at most
    assert google <= tight <= google + 0.011 * bound + 1e-3, (tight, google, bound)
    assert tight <= bound
    # a budget between the two figures passes by the tight one only; the RDP bound answers first
    between = (tight + bound) / 2
    assert within("prv", uses, sigma, 1e-5, between) and not within("rdp", uses, sigma, 1e-5, between)
    assert not within("prv", uses, sigma, 1e-5, tight * 0.99)


def test_the_accountant_is_a_setting_and_a_wrong_one_is_refused_naming_the_choices():
    assert DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5).accountant == "prv"
    section = {"enable_dp": True, "dp_solution_type": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    assert DPSGD.from_section({**section, "delta": 1e-5, "accountant": "rdp"}).settings()["accountant"] == "opacus.rdp"
    with pytest.raises(ConfigError, match=r"dp_args.accountant='pld': allowed: \['prv', 'rdp'\]"):
        DPSGD.from_section({**section, "delta": 1e-5, "accountant": "pld"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"noise_multiplier": 0}, r"dp_args.noise_multiplier=0: must be > 0"),
        ({"max_grad_norm": -1.0}, r"dp_args.max_grad_norm=-1.0: must be > 0"),
        ({"delta": 1}, r"dp_args.delta=1: must be in \(0, 1\)"),
        ({"delta": 0.0}, r"dp_args.delta=0.0: must be in \(0, 1\)"),
        ({"epsilon": 1.0}, r"dp_args.epsilon=1.0: a key of FedML's ldp/cdp"),
        ({"dp_solution_type": ["dpsgd", "ldp"]}, r"one solution per run"),
        ({"enable_dp": False}, r"dp_args.enable_dp=False: dp_solution_type 'dpsgd' is set"),
        ({"noise_multiplier": "1"}, r"dp_args.noise_multiplier='1': must be a finite number"),
        ({"clipping": 1.0}, r"dp_args.clipping=1.0: unknown key"),
    ],
)
def test_bad_dp_settings_are_refused_naming_the_key(change, message):
    section = {"enable_dp": True, "dp_solution_type": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0}
    section = {**section, "delta": 1e-5, **change}
    with pytest.raises(ConfigError, match=message):
        DPSGD.from_section(section)


def test_fedml_own_dp_is_not_dpsgd():
    assert DPSGD.from_section({"enable_dp": True, "dp_solution_type": "ldp", "epsilon": 1.0}) is None
    with pytest.raises(ConfigError, match="dp_args.noise_multiplier=1.0: a key of dp_solution_type 'dpsgd'"):
        DPSGD.from_section({"enable_dp": True, "dp_solution_type": "cdp", "noise_multiplier": 1.0})


def test_a_model_with_batchnorm_cannot_clip_per_sample():
    net = functional_network(nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)))
    params = {k: v.detach() for k, v in net.named_parameters()}
    why = per_sample_problem(net, make_loss_fn(net), params, torch.randn(4, 1, 3, 4), torch.zeros(4, dtype=torch.long))
    assert why is not None and "BatchNorm1d" in why and "GroupNorm" in why
    plain = functional_network(_mlp(torch.float32))
    params = {k: v.detach() for k, v in plain.named_parameters()}
    assert (
        per_sample_problem(plain, make_loss_fn(plain), params, torch.randn(4, 1, 3, 4), torch.zeros(4).long()) is None
    )


def test_the_tight_epsilon_is_the_same_bits_whatever_the_processs_blas_threads():
    """PRV has a BLAS dot product, whose sum order follows the thread count: once a silo (one
    thread) and the single process (two) stated one user's epsilon 1 ulp apart."""
    from threadpoolctl import threadpool_limits

    from fedml_perfedavg.core import accounting

    uses = {0.04081632653061224: 33, 0.08163265306122448: 3}
    said = set()
    for threads in (1, 2):
        accounting._prv.cache_clear()
        with threadpool_limits(threads, user_api="blas"):
            said.add(accounting.prv_epsilon(uses, 1.0, 1e-5))
    assert len(said) == 1, said


def test_every_refusal_dp_sgd_causes_is_the_policys_and_names_its_setting():
    """Issue 56 item 3: the config's rules, the algorithm's construction and the model probe ask
    the policy (DPSGD), so each refusal is worded once, naming the key and dp_args."""
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    adaptive = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, clip="adaptive")
    plain_run = dict(stationarity_every=0, random_iterate=False, cross_silo=False, own_data=False)
    for policy in (dp, adaptive):
        policy.check_run(**plain_run)
        policy.check_run(**{**plain_run, "cross_silo": True, "own_data": True})
        policy.check_algorithm("PerFedAvg", None)
        policy.check_model("Sequential", None)
    dp.check_run(**{**plain_run, "cross_silo": True})  # a fixed bound is no user's state
    refused = [
        (lambda: dp.check_run(**{**plain_run, "stationarity_every": 5}), "validation_args.stationarity_every=5 with"),
        (lambda: dp.check_run(**{**plain_run, "random_iterate": True}), "validation_args.random_iterate=True with"),
        (lambda: adaptive.check_run(**{**plain_run, "cross_silo": True}), "dp_args.clip='adaptive' with comm_args."),
        (lambda: dp.check_algorithm("Mine", "its maths"), "train_args.federated_optimizer='Mine' with dp_args."),
        (lambda: dp.check_model("Net", "it has BatchNorm1d"), "dp_args.dp_solution_type='dpsgd': Net cannot run"),
    ]
    for refuse, words in refused:
        with pytest.raises(ConfigError) as err:
            refuse()
        assert str(err.value).startswith(words), str(err.value)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_rounds_draws_into_the_stacked_tensors_are_each_clients_draws_stacked(adaptive):
    """draw_private_round (noise written in place, use by use where a parameter's size is a
    multiple of 16 and large; inputs gathered into the round's tensors) gives stack_private of every
    client's own draw_private_batches bit for bit: the per-client path's numbers."""
    from fedml_perfedavg.core.private_draws import draw_private_round, stack_private

    torch.manual_seed(0)
    params = {
        "large": torch.zeros(128, 128),  # drawn in place use by use (private_draws._DRAWN_IN_PLACE)
        "w": torch.zeros(8, 12),
        "b": torch.zeros(8),
        "odd": torch.zeros(3, 5),
        "tiny": torch.zeros(10),
        "double": torch.zeros(4, 8, dtype=torch.float64),
    }
    data = [(torch.randn(n, 1, 3, 4), torch.randint(0, 3, (n,))) for n in (40, 25, 60)]
    bounds = [torch.tensor([0.5, 1.0, 2.0]) * (c + 1) if adaptive else None for c in range(3)]

    def generators():
        return [torch.Generator().manual_seed(10 + c) for c in range(3)]

    one_by_one = stack_private(
        [
            draw_private_batches(x, y, [8, 9, 10], 4, params, generator, bound)
            for (x, y), generator, bound in zip(data, generators(), bounds)
        ]
    )
    together = draw_private_round(
        data, [8, 9, 10], 4, params, generators(), bounds, lambda fn, count: [fn(c) for c in range(count)]
    )
    for name, expected, got in zip(PrivateBatches._fields, one_by_one, together):
        if isinstance(expected, dict):
            assert all(torch.equal(expected[k], got[k]) for k in params), name
        elif expected is None:
            assert got is None, name
        else:
            assert torch.equal(expected, got), name
    assert float(together.noise["w"].std()) == pytest.approx(1.0, abs=0.05)


def test_a_rounds_draws_reuse_the_last_rounds_memory_only_where_nobody_holds_it():
    """RoundBuffers: a round drawn into kept memory has the numbers of one drawn into new memory;
    the next round writes into the same memory once the first round's draws are let go, and into
    new memory while a caller still holds them (which stay as they were)."""
    from fedml_perfedavg.core.private_draws import RoundBuffers, draw_private_round

    params = {"w": torch.zeros(8, 12), "b": torch.zeros(8), "odd": torch.zeros(3, 5)}
    data = [
        (torch.randn(n, 1, 3, 4, generator=torch.Generator().manual_seed(n)), torch.arange(n) % 3) for n in (40, 25)
    ]

    def draw(round_seed, buffers):
        generators = [torch.Generator().manual_seed(round_seed + c) for c in range(2)]
        each = lambda fn, count: [fn(c) for c in range(count)]  # noqa: E731
        return draw_private_round(data, [8, 9, 10], 4, params, generators, [None, None], each, buffers)

    def same(a, b):
        return all(torch.equal(a.noise[k], b.noise[k]) for k in params) and torch.equal(a.x, b.x)

    buffers = RoundBuffers()
    first = draw(1, buffers)
    assert same(first, draw(1, None))
    held = {k: v.clone() for k, v in first.noise.items()}, first.x.clone()
    kept_address = first.noise["w"].data_ptr()
    second = draw(2, buffers)  # the first is still held: new memory, the first untouched
    assert second.noise["w"].data_ptr() != kept_address
    assert all(torch.equal(held[0][k], first.noise[k]) for k in params) and torch.equal(held[1], first.x)
    assert same(second, draw(2, None))
    second_address, x_address = second.noise["w"].data_ptr(), second.x.data_ptr()
    del first, second
    third = draw(2, buffers)  # nothing holds the last round's: its memory again (the same cap: it fits)
    assert third.noise["w"].data_ptr() == second_address and third.x.data_ptr() == x_address
    assert same(third, draw(2, None))


@pytest.mark.parametrize("variant", ["sgd", "fo", "hf", "exact"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_the_chain_on_inputs_gathered_use_by_use_gives_the_gathered_rounds_bits(variant, adaptive):
    """draw_private_round's lazy_inputs (the engine's: each use's inputs gathered just before the
    chain computes it, into one buffer) gives the same inputs and the same trained clients, bit
    for bit, as the round's inputs gathered up front."""
    from fedml_perfedavg.core.client_maths import run_steps
    from fedml_perfedavg.core.private_draws import (
        PrivateInputs,
        draw_private_round,
        gathered_norms_are_exact,
        squared_norms,
    )

    net, _, params, _, _ = _setup()
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randn(n, 1, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
        for n in (30, 50, 41)
    ]
    roles = Step(variant).batch_roles
    dp = DPSGD(noise_multiplier=0.7, max_grad_norm=0.5, delta=1e-5, **({"clip": "adaptive"} if adaptive else {}))
    bounds = [torch.tensor([0.4, 0.6, 0.8][:roles], dtype=torch.float64) if adaptive else None for _ in data]
    config = LocalUpdateConfig(variant, alpha=0.05, beta=0.1, delta=0.001, local_steps=3)
    chain = hand_batched_gradients(net, (1, 3, 4))[0]

    def train(lazy, norms=None):
        generators = [torch.Generator().manual_seed(20 + c) for c in range(len(data))]
        each = lambda fn, count: [fn(c) for c in range(count)]  # noqa: E731
        batches = draw_private_round(
            data, [8] * roles, 3, params, generators, bounds, each, lazy_inputs=lazy, input_norms=norms
        )
        start = {k: v.unsqueeze(0).expand(len(data), *v.shape) for k, v in params.items()}
        steps = PrivateChainSteps(chain, batches, config.step, dp)
        return batches, run_steps(steps, start, config), steps.bounds

    (eager, trained, eager_bounds), (lazy, lazily_trained, lazy_bounds) = train(False), train(True)
    assert isinstance(lazy.x, PrivateInputs) and not isinstance(eager.x, PrivateInputs)
    assert torch.equal(lazy.gathered_x(), eager.x) and lazy.x.shape == tuple(eager.x.shape)
    assert all(torch.equal(trained[k], lazily_trained[k]) for k in params)
    # each user's squared input norms computed once and gathered with its minibatches: the same bits
    assert all(gathered_norms_are_exact(x) for x, _ in data)
    with_norms, trained_with_norms, _ = train(True, [squared_norms(x) for x, _ in data])
    assert torch.equal(
        with_norms.x.use_norms(roles - 1, 2),
        eager.x[:, roles - 1, 2].reshape(len(data), eager.x.shape[3], -1).pow(2).sum(-1),
    )
    assert all(torch.equal(trained[k], trained_with_norms[k]) for k in params)
    assert max(float((trained[k][0] - params[k]).abs().max()) for k in params) > 1e-3
    assert (eager_bounds is None and lazy_bounds is None) or torch.equal(eager_bounds, lazy_bounds)


@pytest.mark.parametrize(
    "uses, sigma", [({0.05: 100}, 1.0), ({0.0544: 300, 0.08: 40}, 1.1), ({0.04: 1000, 1.0: 10}, 2.0)]
)
def test_the_tight_epsilon_reusing_one_uses_rdp_is_opacus_prv_accountant_bit_for_bit(uses, sigma):
    """prv_epsilon composes Opacus' public PRV analysis with the domain sized from each rate's RDP
    computed once (accounting._safe_domain_size): the very figure of Opacus' own accountant, and
    nothing of Opacus is replaced (issue 77: its compute_rdp was patched during each call)."""
    import warnings

    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis import rdp as opacus_rdp
    from threadpoolctl import threadpool_limits

    from fedml_perfedavg.core import accounting

    own = opacus_rdp.compute_rdp
    delta = 1e-5
    bound = accounting.rdp_epsilon(uses, sigma, delta)
    accountant = PRVAccountant()
    accountant.history = [(sigma, rate, count) for rate, count in sorted(uses.items())]
    with warnings.catch_warnings(), threadpool_limits(1, user_api="blas"):
        warnings.simplefilter("ignore")
        error = max(accounting.PRV_RELATIVE_ERROR * bound, 1e-6)
        expected = min(float(accountant.get_epsilon(delta, eps_error=error)), bound)
    accounting._prv.cache_clear()
    assert accounting.prv_epsilon(uses, sigma, delta) == expected
    assert opacus_rdp.compute_rdp is own
