"""The personalized evaluation protocol: adapt on train data only, then test."""

import pytest
import torch

from fedml_perfedavg.core.evaluation import EvaluationConfig, adaptation_batches, evaluate, sgd_steps
from fedml_perfedavg.core.functional import make_loss_fn, parameters_of
from fedml_perfedavg.core.sampling import Purpose, generator_for
from fedml_perfedavg.core.hand_batched import hand_batched_gradients
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.models import MLP


def personalized_evaluation(
    model, loss_fn, params, users, alpha, adapt_steps, batch_size, seed, round_idx, batched=False
):
    config = EvaluationConfig(alpha, adapt_steps, batch_size, seed, batched)
    return evaluate(model, params, users, config, round_idx, loss_fn=loss_fn)


def adapt(loss_fn, params, train_x, train_y, alpha, steps, batch_size, generator):
    return sgd_steps(loss_fn, params, *adaptation_batches(train_x, train_y, steps, batch_size, generator), alpha)


EVENTS = []


class WatchedTensor(torch.Tensor):
    """Records every torch operation that reads it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        EVENTS.append("test-data-read")
        return super().__torch_function__(func, types, args, kwargs or {})


def _users(num=3, seed=0):
    torch.manual_seed(seed)
    return [
        UserSplit(torch.randn(30, 6), torch.randint(0, 3, (30,)), torch.randn(12, 6), torch.randint(0, 3, (12,)))
        for _ in range(num)
    ]


def test_evaluation_never_touches_test_data_before_adaptation_is_done():
    torch.manual_seed(0)
    model = MLP(6, 3, (5,))
    loss = make_loss_fn(model)

    def watched_loss(params, x, y):
        EVENTS.append("adaptation-step")
        assert not isinstance(x, WatchedTensor)
        return loss(params, x, y)

    users = [
        UserSplit(u.train_x, u.train_y, u.test_x.as_subclass(WatchedTensor), u.test_y.as_subclass(WatchedTensor))
        for u in _users(1)
    ]
    EVENTS.clear()
    personalized_evaluation(
        model, watched_loss, parameters_of(model), users, alpha=0.1, adapt_steps=3, batch_size=8, seed=0, round_idx=0
    )
    assert EVENTS.count("adaptation-step") == 3
    first_read = EVENTS.index("test-data-read")
    assert all(e == "adaptation-step" for e in EVENTS[:first_read]) and first_read == 3


def test_adapted_model_does_not_depend_on_test_data():
    torch.manual_seed(0)
    model = MLP(6, 3, (5,))
    loss = make_loss_fn(model)
    users = _users(2)
    swapped = [UserSplit(u.train_x, u.train_y, torch.randn_like(u.test_x), u.test_y) for u in users]
    args = dict(alpha=0.5, adapt_steps=1, batch_size=8, seed=0, round_idx=4)
    a = personalized_evaluation(model, loss, parameters_of(model), users, **args)
    b = personalized_evaluation(model, loss, parameters_of(model), swapped, **args)
    assert a.per_user_accuracy_before != b.per_user_accuracy_before or a.per_user_accuracy != b.per_user_accuracy
    # with the real test data restored the numbers are reproduced exactly
    assert (
        personalized_evaluation(model, loss, parameters_of(model), users, **args).per_user_accuracy
        == a.per_user_accuracy
    )


def test_personalized_accuracy_is_the_mean_over_users_of_the_adapted_models_accuracy():
    torch.manual_seed(1)
    model = MLP(6, 3, (5,))
    loss = make_loss_fn(model)
    users = _users(3)
    params = parameters_of(model)
    result = personalized_evaluation(
        model, loss, params, users, alpha=0.5, adapt_steps=1, batch_size=8, seed=3, round_idx=7
    )
    expected = []
    for i, u in enumerate(users):
        adapted = adapt(loss, params, u.train_x, u.train_y, 0.5, 1, 8, generator_for(3, 7, i, Purpose.EVALUATION))
        logits = torch.func.functional_call(model, adapted, (u.test_x,))
        expected.append(float((logits.argmax(1) == u.test_y).float().mean()))
    assert result.per_user_accuracy == expected
    assert abs(result.personalized_accuracy - sum(expected) / 3) < 1e-7
    assert result.per_user_accuracy != result.per_user_accuracy_before


def test_zero_adaptation_steps_gives_the_accuracy_before_adaptation():
    torch.manual_seed(2)
    model = MLP(6, 3, (5,))
    result = personalized_evaluation(
        model,
        make_loss_fn(model),
        parameters_of(model),
        _users(3),
        alpha=0.5,
        adapt_steps=0,
        batch_size=8,
        seed=0,
        round_idx=0,
    )
    assert result.per_user_accuracy == result.per_user_accuracy_before


def test_batched_and_one_by_one_evaluation_agree():
    torch.manual_seed(3)
    model = MLP(6, 3, (5,))
    users = _users(5)
    args = dict(alpha=0.3, adapt_steps=2, batch_size=8, seed=1, round_idx=2)
    a = personalized_evaluation(model, make_loss_fn(model), parameters_of(model), users, **args)
    b = personalized_evaluation(model, make_loss_fn(model), parameters_of(model), users, batched=True, **args)
    assert a.per_user_accuracy == b.per_user_accuracy and a.per_user_accuracy_before == b.per_user_accuracy_before


def test_user_ids_key_the_adaptation_batches():
    """A silo evaluating user 7 alone draws what the server's evaluation of all users draws for it."""
    torch.manual_seed(4)
    model = MLP(6, 3, (5,))
    users = _users(8)
    config = EvaluationConfig(0.5, 1, 8, 0, batched=False)
    everyone = evaluate(model, parameters_of(model), users, config, 3)
    alone = evaluate(model, parameters_of(model), [users[7]], config, 3, user_ids=[7])
    assert alone.per_user_accuracy == [everyone.per_user_accuracy[7]]
    assert alone.per_user_loss == [everyone.per_user_loss[7]]


def _users_of_two_test_sizes(seed=0, features=784):
    torch.manual_seed(seed)
    return [
        UserSplit(
            torch.randn(60, features), torch.randint(0, 10, (60,)), torch.randn(n, features), torch.randint(0, 10, (n,))
        )
        for n in (160, 80, 160, 80, 160)
    ]


def _paper_mlp():
    """The paper's MLP: matrix kernels give batched and per-user logits the same bits at its sizes
    on the machines this was measured on; where they do not, the probe sends scoring user by user."""
    model = MLP(784, 10, (80, 60))
    chain, why = hand_batched_gradients(model, (784,))
    assert chain is not None, why
    return model, chain


@pytest.mark.parametrize("adapt_steps,per_coordinate", [(1, False), (2, False), (1, True)])
def test_users_scored_together_get_the_per_user_numbers_bit_for_bit(adapt_steps, per_coordinate):
    torch.manual_seed(5)
    model, chain = _paper_mlp()
    users, params = _users_of_two_test_sizes(), parameters_of(model)
    step_sizes = {k: torch.full_like(v, 0.2) for k, v in params.items()} if per_coordinate else None
    config = EvaluationConfig(0.3, adapt_steps, 8, 1, batched=True)
    reference = evaluate(model, params, users, config, 2, step_sizes=step_sizes)  # chunks, then user by user
    stacks: dict = {}
    for _ in range(2):  # the second evaluation reads the test splits stacked by the first
        together = evaluate(
            model, params, users, config, 2, step_sizes=step_sizes, hand_batched=chain, test_stacks=stacks
        )
        assert together.per_user_accuracy == reference.per_user_accuracy
        assert together.per_user_accuracy_before == reference.per_user_accuracy_before
        assert together.per_user_loss == reference.per_user_loss
    assert len(set(reference.per_user_loss)) == len(users)  # distinct numbers, not a vacuous match
    if not chain.scores_exactly:
        pytest.skip("this CPU's batched kernels differ in the last bits: the users were scored one by one")
    assert len(stacks) == 2


def test_users_are_scored_one_by_one_where_the_batched_pass_differs():
    torch.manual_seed(6)
    model, chain = _paper_mlp()
    users, params = _users_of_two_test_sizes(1), parameters_of(model)
    config = EvaluationConfig(0.3, 1, 8, 1, batched=True)
    exact_logits = chain.logits
    chain.logits = lambda p, x: exact_logits(p, x) * (1 + 1e-6)  # a kernel whose last bits differ
    result = evaluate(model, params, users, config, 2, hand_batched=chain)
    assert chain.scores_exactly is False
    assert result.per_user_loss == evaluate(model, params, users, config, 2).per_user_loss


def test_where_only_the_global_models_pass_is_exact_it_alone_is_batched(monkeypatch):
    """A CPU whose per-user products split their sums (MKL over 2 threads, on the Intel Xeon of
    2026-11-29) differs from the batched pass of the adapted models but not from the global
    model's one pass: that pass is taken, one per test-split size, after the chunk's adaptation,
    and every per-user number is the per-user path's."""
    from fedml_perfedavg.core import evaluation

    torch.manual_seed(8)
    model, chain = _paper_mlp()
    users, params = _users_of_two_test_sizes(4), parameters_of(model)
    config = EvaluationConfig(0.3, 1, 8, 1, batched=True)
    exact_logits = chain.logits

    def adapted_models_differ(p, x):  # several models: a kernel whose last bits differ; one model: exact
        logits = exact_logits(p, x)
        return logits * (1 + 1e-6) if next(iter(p.values())).shape[0] > 1 else logits

    chain.logits = adapted_models_differ
    passes = []
    global_logits = evaluation._global_logits
    monkeypatch.setattr(
        evaluation, "_global_logits", lambda c, p, x: passes.append(x.shape[0]) or global_logits(c, p, x)
    )
    result = evaluate(model, params, users, config, 2, hand_batched=chain)
    assert chain.scores_exactly is False and chain.scores_global_exactly is True
    assert sorted(passes[1:]) == [2, 3]  # after the probe's: the users of each test-split size, stacked
    reference = evaluate(model, params, users, config, 2)
    assert result.per_user_accuracy_before == reference.per_user_accuracy_before
    assert result.per_user_accuracy == reference.per_user_accuracy
    assert result.per_user_loss == reference.per_user_loss
    assert len(set(reference.per_user_accuracy_before)) > 1  # distinct numbers, not a vacuous match


class WatchedValues(torch.Tensor):
    """Records every torch operation that reads its values (its shape, size and device are not)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in ("__len__", "__get__", "size", "dim", "__hash__", "__eq__"):
            EVENTS.append("test-data-read")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_scoring_together_reads_no_test_data_before_every_adaptation_of_its_chunk_is_done():
    torch.manual_seed(0)
    model, chain = _paper_mlp()
    users = [
        UserSplit(u.train_x, u.train_y, u.test_x.as_subclass(WatchedValues), u.test_y.as_subclass(WatchedValues))
        for u in _users_of_two_test_sizes(2)
    ]
    EVENTS.clear()
    loss = make_loss_fn(model)
    evaluate(
        model,
        parameters_of(model),
        users,
        EvaluationConfig(0.1, 1, 8, 0, batched=True),
        0,
        loss_fn=lambda p, x, y: EVENTS.append("adaptation-step") or loss(p, x, y),
        hand_batched=chain,
    )
    if not chain.scores_exactly:
        pytest.skip("this CPU's batched kernels differ in the last bits: the users were scored one by one")
    # two chunks (the users of each test size): each adapted, then its test data read
    collapsed = [e for i, e in enumerate(EVENTS) if i == 0 or EVENTS[i - 1] != e]
    assert collapsed == ["adaptation-step", "test-data-read"] * 2


@pytest.mark.parametrize("adapt_steps,per_coordinate", [(1, False), (2, False), (1, True)])
def test_users_adapted_together_get_the_models_of_the_vmapped_sgd_steps_bit_for_bit(adapt_steps, per_coordinate):
    from torch.func import vmap

    from fedml_perfedavg.core.evaluation import _adapt_together

    torch.manual_seed(7)
    model, _ = _paper_mlp()
    users, params, loss = _users_of_two_test_sizes(3), parameters_of(model), make_loss_fn(model)
    step = {k: torch.full_like(v, 0.2) for k, v in params.items()} if per_coordinate else 0.3
    config = EvaluationConfig(0.3, adapt_steps, 8, 1, batched=True)
    ids = [4, 0, 9, 2, 7]
    batches = [
        adaptation_batches(u.train_x, u.train_y, adapt_steps, 8, generator_for(1, 2, i, Purpose.EVALUATION))
        for u, i in zip(users, ids)
    ]
    expected = vmap(lambda bx, by: sgd_steps(loss, params, bx, by, step))(
        torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    )
    got = _adapt_together(loss, params, users, ids, config, 2, step)
    assert all(torch.equal(got[k], expected[k]) for k in params)


@pytest.mark.parametrize("exact", [True, False])
def test_users_scored_one_by_one_by_the_chains_own_pass_get_the_networks_numbers(monkeypatch, exact):
    """Where the adapted models are scored user by user, each by the chain's model_logits (the
    modules' own operations, without functional_call) where the probe finds the network's bits, by
    functional_call where it does not; the per-user numbers are the network's either way."""
    from fedml_perfedavg.core import evaluation

    torch.manual_seed(9)
    model, chain = _paper_mlp()
    users, params = _users_of_two_test_sizes(3), parameters_of(model)
    config = EvaluationConfig(0.3, 1, 8, 1, batched=True)
    exact_logits, own_pass = chain.logits, chain.model_logits
    chain.logits = lambda p, x: exact_logits(p, x) * (1 + 1e-6 if next(iter(p.values())).shape[0] > 1 else 1)
    chain.model_logits = lambda p, x: own_pass(p, x) * (1 if exact else 1 + 1e-6)
    called = []
    logits_of = evaluation.logits_of
    monkeypatch.setattr(evaluation, "logits_of", lambda n, p, x: called.append(len(x)) or logits_of(n, p, x))
    evaluate(model, params, users, config, 2, hand_batched=chain)  # the probe answers once
    assert chain.scores_exactly is False and chain.scores_one_exactly is exact
    called.clear()
    result = evaluate(model, params, users, config, 2, hand_batched=chain)
    assert len(called) == (0 if exact else len(users))
    reference = evaluate(model, params, users, config, 2)
    assert result.per_user_accuracy == reference.per_user_accuracy
    assert result.per_user_loss == reference.per_user_loss
    assert len(set(reference.per_user_loss)) > 1
