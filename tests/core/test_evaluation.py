"""The personalized evaluation protocol: adapt on train data only, then test."""
import torch

from fedml_perfedavg.core.evaluation import EvaluationConfig, adaptation_batches, evaluate, sgd_steps
from fedml_perfedavg.core.functional import make_loss_fn, parameters_of
from fedml_perfedavg.core.sampling import Purpose, generator_for
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.models import MLP


def personalized_evaluation(model, loss_fn, params, users, alpha, adapt_steps, batch_size, seed, round_idx,
                            batched=False):
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
    return [UserSplit(torch.randn(30, 6), torch.randint(0, 3, (30,)), torch.randn(12, 6), torch.randint(0, 3, (12,)))
            for _ in range(num)]


def test_evaluation_never_touches_test_data_before_adaptation_is_done():
    torch.manual_seed(0)
    model = MLP(6, 3, (5,))
    loss = make_loss_fn(model)

    def watched_loss(params, x, y):
        EVENTS.append("adaptation-step")
        assert not isinstance(x, WatchedTensor)
        return loss(params, x, y)

    users = [UserSplit(u.train_x, u.train_y, u.test_x.as_subclass(WatchedTensor), u.test_y.as_subclass(WatchedTensor))
             for u in _users(1)]
    EVENTS.clear()
    personalized_evaluation(model, watched_loss, parameters_of(model), users, alpha=0.1, adapt_steps=3,
                            batch_size=8, seed=0, round_idx=0)
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
    assert personalized_evaluation(model, loss, parameters_of(model), users, **args).per_user_accuracy == \
        a.per_user_accuracy


def test_personalized_accuracy_is_the_mean_over_users_of_the_adapted_models_accuracy():
    torch.manual_seed(1)
    model = MLP(6, 3, (5,))
    loss = make_loss_fn(model)
    users = _users(3)
    params = parameters_of(model)
    result = personalized_evaluation(model, loss, params, users, alpha=0.5, adapt_steps=1, batch_size=8, seed=3,
                                     round_idx=7)
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
    result = personalized_evaluation(model, make_loss_fn(model), parameters_of(model), _users(3), alpha=0.5,
                                     adapt_steps=0, batch_size=8, seed=0, round_idx=0)
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
