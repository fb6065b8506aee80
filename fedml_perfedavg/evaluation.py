"""Personalized evaluation: adapt the global model on a user's training data, then test it.

The protocol is the same for every method, the FedAvg baseline included: each user takes
the global model, does ``adapt_steps`` SGD steps of size alpha on minibatches of its own
training data, and is tested on its own test split. Test data is only read after
adaptation has finished, and never by it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, NamedTuple, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from .algorithm import LossFn, Params, axpy
from .sampling import Purpose, batch_indices, generator_for


USERS_PER_CHUNK = 64


class UserSplit(NamedTuple):
    """One user's training and test tensors."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


@dataclass
class EvaluationResult:
    """Per-user accuracies (in [0, 1]) before and after the personalization step."""

    per_user_accuracy: List[float]
    per_user_accuracy_before: List[float]
    per_user_loss: List[float] = field(default_factory=list)

    @property
    def personalized_accuracy(self) -> float:
        return float(torch.tensor(self.per_user_accuracy).mean())

    @property
    def accuracy_before_adaptation(self) -> float:
        return float(torch.tensor(self.per_user_accuracy_before).mean())

    @property
    def personalized_accuracy_std(self) -> float:
        return float(torch.tensor(self.per_user_accuracy).std(unbiased=False))

    def metrics(self) -> dict:
        """Flat scalar metrics for logging."""
        return {
            "personalized_accuracy": self.personalized_accuracy,
            "personalized_accuracy_std": self.personalized_accuracy_std,
            "personalized_accuracy_min": min(self.per_user_accuracy),
            "accuracy_before_adaptation": self.accuracy_before_adaptation,
            "personalized_loss": float(torch.tensor(self.per_user_loss).mean()) if self.per_user_loss else float("nan"),
        }


def adaptation_batches(train_x: Tensor, train_y: Tensor, steps: int, batch_size: int,
                       generator: torch.Generator) -> tuple:
    """The (steps, batch) minibatches of the user's training data that adaptation uses."""
    (indices,) = batch_indices(len(train_y), steps, [min(batch_size, len(train_y))], generator)
    indices = indices.to(train_x.device)
    return train_x[indices], train_y[indices]


def sgd_steps(loss_fn: LossFn, params: Params, batches_x: Tensor, batches_y: Tensor, alpha: float) -> Params:
    """One alpha-step of SGD per leading index of ``batches_x`` / ``batches_y``."""
    grad_fn = grad(loss_fn)
    for t in range(batches_x.shape[0]):
        params = axpy(-alpha, grad_fn(params, batches_x[t], batches_y[t]), params)
    return params


def adapt(
    loss_fn: LossFn,
    params: Params,
    train_x: Tensor,
    train_y: Tensor,
    alpha: float,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
) -> Params:
    """``steps`` SGD steps of size ``alpha`` on minibatches of the user's training data."""
    return sgd_steps(loss_fn, params, *adaptation_batches(train_x, train_y, steps, batch_size, generator), alpha)


@torch.no_grad()
def _accuracy_and_loss(model: nn.Module, params: Params, x: Tensor, y: Tensor) -> tuple:
    logits = functional_call(model, params, (x,))
    loss = torch.nn.functional.cross_entropy(logits, y)
    return float((logits.argmax(dim=1) == y).float().mean()), float(loss)


def _score(model: nn.Module, params: Params, adapted_per_user: Iterable[Params],
           users: Sequence[UserSplit]) -> EvaluationResult:
    """Test each user's adapted model (and the global one) on that user's test split; the
    adapted models are produced lazily, so each user's adaptation ends before its test data
    is read."""
    after, before, losses = [], [], []
    for adapted, user in zip(adapted_per_user, users):
        accuracy, loss = _accuracy_and_loss(model, adapted, user.test_x, user.test_y)
        after.append(accuracy)
        losses.append(loss)
        before.append(_accuracy_and_loss(model, params, user.test_x, user.test_y)[0])
    return EvaluationResult(after, before, losses)


def evaluate_user(
    model: nn.Module, loss_fn: LossFn, params: Params, user: UserSplit, alpha: float, steps: int,
    batch_size: int, generator: torch.Generator,
) -> tuple:
    """(accuracy after, accuracy before, loss after) for one user."""
    adapted = adapt(loss_fn, params, user.train_x, user.train_y, alpha, steps, batch_size, generator)
    result = _score(model, params, [adapted], [user])
    return result.per_user_accuracy[0], result.per_user_accuracy_before[0], result.per_user_loss[0]


def personalized_evaluation(
    model: nn.Module,
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    alpha: float,
    adapt_steps: int,
    batch_size: int,
    seed: int,
    round_idx: int,
) -> EvaluationResult:
    """Evaluate ``params`` on every user with the personalized protocol (see module doc)."""
    adapted = (adapt(loss_fn, params, u.train_x, u.train_y, alpha, adapt_steps, batch_size,
                     generator_for(seed, round_idx, user_id, Purpose.EVALUATION))
               for user_id, u in enumerate(users))
    return _score(model, params, adapted, users)


def personalized_evaluation_batched(
    model: nn.Module,
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    alpha: float,
    adapt_steps: int,
    batch_size: int,
    seed: int,
    round_idx: int,
) -> EvaluationResult:
    """Same protocol and numbers as :func:`personalized_evaluation`, with the adaptation of
    users as vmapped computations over chunks of ``USERS_PER_CHUNK`` users (so memory stays
    bounded as n grows); needs ``batch_size`` <= every user's training data."""

    def adapted_models():
        for start in range(0, len(users), USERS_PER_CHUNK):
            chunk = range(start, min(start + USERS_PER_CHUNK, len(users)))
            batches = [adaptation_batches(users[i].train_x, users[i].train_y, adapt_steps, batch_size,
                                          generator_for(seed, round_idx, i, Purpose.EVALUATION)) for i in chunk]
            xs, ys = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
            adapted = vmap(lambda bx, by: sgd_steps(loss_fn, params, bx, by, alpha), in_dims=(0, 0))(xs, ys)
            yield from ({k: v[j] for k, v in adapted.items()} for j in range(len(chunk)))

    # test splits differ in size: one forward pass per user
    return _score(model, params, adapted_models(), users)
