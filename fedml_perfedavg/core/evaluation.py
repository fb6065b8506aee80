"""Personalized evaluation: adapt the global model on a user's training data, then test it.

The protocol is the same for every method, the FedAvg baseline included: each user takes
the global model, does ``adapt_steps`` SGD steps of size alpha on minibatches of its own
training data, and is tested on its own test split. Test data is only read after that
user's adaptation has finished, and never by it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from .algorithm import axpy
from .functional import logits_of, make_loss_fn
from .sampling import Purpose, batch_indices, generator_for
from .types import LossFn, Params, UserSplit

USERS_PER_CHUNK = 64  # batched adaptation: users per vmapped call (bounds memory as n grows)


@dataclass(frozen=True)
class EvaluationConfig:
    """How the personalized evaluation adapts each user's copy of the global model.

    ``batched`` adapts users as vmapped computations over chunks of users (same numbers as
    one user at a time); it needs ``batch_size`` <= every user's training data and falls
    back to one user at a time otherwise."""

    alpha: float
    adapt_steps: int = 1
    batch_size: int = 40
    seed: int = 0
    batched: bool = True


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

    def subset(self, positions: Sequence[int]) -> "EvaluationResult":
        """The result restricted to the users at ``positions``."""
        pick = lambda values: [values[i] for i in positions]  # noqa: E731
        return EvaluationResult(pick(self.per_user_accuracy), pick(self.per_user_accuracy_before),
                                pick(self.per_user_loss) if self.per_user_loss else [])

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


def sgd_steps(loss_fn: LossFn, params: Params, batches_x: Tensor, batches_y: Tensor,
              alpha: Union[float, Params]) -> Params:
    """One step of SGD per leading index of ``batches_x`` / ``batches_y``, of size ``alpha``
    (a number, or per-coordinate sizes by parameter name)."""
    grad_fn = grad(loss_fn)
    for t in range(batches_x.shape[0]):
        g = grad_fn(params, batches_x[t], batches_y[t])
        if isinstance(alpha, dict):
            params = {k: params[k] - alpha[k] * g[k] for k in params}
        else:
            params = axpy(-alpha, g, params)
    return params


@torch.no_grad()
def _accuracy_and_loss(network: nn.Module, params: Params, x: Tensor, y: Tensor) -> tuple:
    logits = logits_of(network, params, x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return float((logits.argmax(dim=1) == y).float().mean()), float(loss)


def _adapted_one_by_one(loss_fn: LossFn, params: Params, users: Sequence[UserSplit], user_ids: Sequence[int],
                        config: EvaluationConfig, round_idx: int, step: Union[float, Params]) -> Iterator[Params]:
    for user_id, user in zip(user_ids, users):
        generator = generator_for(config.seed, round_idx, user_id, Purpose.EVALUATION)
        batches = adaptation_batches(user.train_x, user.train_y, config.adapt_steps, config.batch_size, generator)
        yield sgd_steps(loss_fn, params, *batches, step)


def _adapted_in_chunks(loss_fn: LossFn, params: Params, users: Sequence[UserSplit], user_ids: Sequence[int],
                       config: EvaluationConfig, round_idx: int, step_size: Union[float, Params]) -> Iterator[Params]:
    step = vmap(lambda bx, by: sgd_steps(loss_fn, params, bx, by, step_size), in_dims=(0, 0))
    for start in range(0, len(users), USERS_PER_CHUNK):
        chunk = range(start, min(start + USERS_PER_CHUNK, len(users)))
        batches = [adaptation_batches(users[i].train_x, users[i].train_y, config.adapt_steps, config.batch_size,
                                      generator_for(config.seed, round_idx, user_ids[i], Purpose.EVALUATION))
                   for i in chunk]
        adapted = step(torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]))
        yield from ({k: v[j] for k, v in adapted.items()} for j in range(len(chunk)))


def _score(network: nn.Module, params: Params, adapted_per_user: Iterable[Params],
           users: Sequence[UserSplit]) -> EvaluationResult:
    # The adapted models are produced lazily: each user's adaptation ends before its test
    # data is read. Test splits differ in size: one forward pass per user.
    after, before, losses = [], [], []
    for adapted, user in zip(adapted_per_user, users):
        accuracy, loss = _accuracy_and_loss(network, adapted, user.test_x, user.test_y)
        after.append(accuracy)
        losses.append(loss)
        before.append(_accuracy_and_loss(network, params, user.test_x, user.test_y)[0])
    return EvaluationResult(after, before, losses)


def evaluate(network: nn.Module, params: Params, users: Sequence[UserSplit], config: EvaluationConfig,
             round_idx: int, user_ids: Optional[Sequence[int]] = None, loss_fn: Optional[LossFn] = None,
             step_sizes: Optional[Params] = None) -> EvaluationResult:
    """Personalized evaluation of ``params`` on ``users`` (see the module doc).

    ``network`` is a functional network (:func:`fedml_perfedavg.core.functional.functional_network`);
    ``user_ids`` key each user's adaptation batches (default 0..len(users)-1), so one silo
    evaluating user 7 draws what the server's evaluation of all users draws for user 7.
    ``step_sizes`` replaces alpha with per-coordinate step sizes (an algorithm that learns them)."""
    user_ids = list(range(len(users))) if user_ids is None else list(user_ids)
    step = config.alpha if step_sizes is None else {k: step_sizes[k] for k in params}
    if len(user_ids) != len(users):
        raise ValueError(f"{len(user_ids)} user ids for {len(users)} users")
    loss_fn = loss_fn if loss_fn is not None else make_loss_fn(network)
    stackable = len(users) > 1 and all(len(u.train_y) >= config.batch_size for u in users)
    adapt = _adapted_in_chunks if config.batched and stackable else _adapted_one_by_one
    return _score(network, params, adapt(loss_fn, params, users, user_ids, config, round_idx, step), users)
