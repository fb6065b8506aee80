"""Personalized evaluation: adapt the global model on a user's training data, then test it.

The protocol is the same for every method, the FedAvg baseline included: each user takes
the global model, does ``adapt_steps`` SGD steps of size alpha on minibatches of its own
training data, and is tested on its own test split. Test data is only read after that
user's adaptation has finished, and never by it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from .client_maths import axpy
from .functional import logits_of, make_loss_fn
from .sampling import Purpose, batch_indices, batch_indices_of_many, generator_for
from .hand_batched import HandBatchedGradients
from .types import LossFn, Params, UserSplit, gather_inputs, input_dtype, model_inputs

if TYPE_CHECKING:
    from .privacy import DPSGD

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
    privacy: Optional["DPSGD"] = None  # DP-SGD: each personalization step is a use of the mechanism


#: The evaluation protocol's own per-user metrics, the same for every method: accuracy after the
#: personalization step, accuracy of the global model itself (before it), and the loss after it.
ACCURACY, ACCURACY_BEFORE, LOSS = "accuracy", "accuracy_before_adaptation", "loss"
PROTOCOL_METRICS = (ACCURACY, ACCURACY_BEFORE, LOSS)


#: Names an algorithm's own metric may not take: an evaluation's record already uses them.
RESERVED_NAMES = frozenset(
    {*PROTOCOL_METRICS, "round", "stationarity", "epsilon", "train_seconds", "wall_seconds", "evaluated_users"}
    | {"missing_users", "personalized_accuracy", "personalized_accuracy_std", "personalized_accuracy_min"}
    | {"personalized_loss", "new_users"}
)
RESERVED_PREFIXES = ("random_iterate_", "new_user_", "per_user_", "eval/", "silo/", "final/")
MAX_OWN_METRICS = 16  # what a silo may send (the wire's bound) and an algorithm may declare


def check_metric_names(owner: str, names: Sequence[str]) -> None:
    """TypeError unless ``names`` (an algorithm's ``metric_names``) are distinct identifiers of
    at most 64 characters that no evaluation record uses already, at most :data:`MAX_OWN_METRICS`."""
    if not isinstance(names, tuple):
        raise TypeError(f"{owner}.metric_names is a {type(names).__name__}: give a tuple of names")
    problems = [
        name
        for name in names
        if not (isinstance(name, str) and name.isidentifier() and len(name) <= 64)
        or name in RESERVED_NAMES
        or name.startswith(RESERVED_PREFIXES)
    ]
    if problems or len(set(names)) != len(names) or len(names) > MAX_OWN_METRICS:
        raise TypeError(
            f"{owner}.metric_names={names!r}: give at most {MAX_OWN_METRICS} distinct identifiers of at most 64 "
            f"characters, none of {sorted(RESERVED_NAMES)} and none starting {RESERVED_PREFIXES}"
            + (f" (not: {problems})" if problems else "")
        )


def finite_figure(value: Any, what: str) -> float:
    """``value`` (a number, or a tensor of one element) as a float: ValueError naming ``what``
    unless it is finite."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}: a finite number is needed")
    return float(value)


@dataclass
class EvaluationResult:
    """Per-user metrics by name, a value for each user (users 0..n-1, or ``user_ids``: a
    federated evaluation that some users missed): the protocol's (:data:`PROTOCOL_METRICS`) and
    any an algorithm adds of its own (``FederatedAlgorithm.metric_names``)."""

    per_user: Dict[str, List[float]]
    user_ids: Optional[List[int]] = None

    @classmethod
    def of(
        cls,
        accuracy: List[float],
        before: List[float],
        loss: Sequence[float] = (),
        user_ids: Optional[List[int]] = None,
    ) -> "EvaluationResult":
        """The protocol's figures of each user (accuracy after and before the step, the loss)."""
        per_user = {ACCURACY: list(accuracy), ACCURACY_BEFORE: list(before)}
        if loss:
            per_user[LOSS] = list(loss)
        return cls(per_user, user_ids)

    @classmethod
    def from_record(cls, record: Dict[str, Any]) -> "EvaluationResult":
        """A result as :meth:`record` wrote it (a checkpoint), or as checkpoints before named
        metrics did (``per_user_accuracy``, ...)."""
        if "per_user" in record:
            return cls({k: list(v) for k, v in record["per_user"].items()}, record.get("user_ids"))
        return cls.of(
            record["per_user_accuracy"],
            record["per_user_accuracy_before"],
            record.get("per_user_loss") or (),
            record.get("user_ids"),
        )

    def record(self) -> Dict[str, Any]:
        return {"per_user": {k: list(v) for k, v in self.per_user.items()}, "user_ids": self.user_ids}

    @property
    def ids(self) -> List[int]:
        return list(range(len(self.per_user_accuracy))) if self.user_ids is None else list(self.user_ids)

    @property
    def per_user_accuracy(self) -> List[float]:
        return self.per_user[ACCURACY]

    @property
    def per_user_accuracy_before(self) -> List[float]:
        return self.per_user[ACCURACY_BEFORE]

    @property
    def per_user_loss(self) -> List[float]:
        return self.per_user.get(LOSS, [])

    @property
    def own_names(self) -> List[str]:
        """The names of the metrics an algorithm added (beyond the protocol's)."""
        return [name for name in self.per_user if name not in PROTOCOL_METRICS]

    def with_own(self, own: Dict[str, List[float]]) -> "EvaluationResult":
        """This result with an algorithm's own per-user metrics added (a value for each user)."""
        for name, values in own.items():
            if name in PROTOCOL_METRICS:
                raise ValueError(f"own metric {name!r} is the evaluation protocol's ({', '.join(PROTOCOL_METRICS)})")
            if len(values) != len(self.per_user_accuracy):
                raise ValueError(f"own metric {name!r}: {len(values)} values for {len(self.ids)} users")
        return EvaluationResult({**self.per_user, **{k: list(v) for k, v in own.items()}}, self.user_ids)

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
        picked = {name: [values[i] for i in positions] for name, values in self.per_user.items()}
        return EvaluationResult(picked, None if self.user_ids is None else [self.user_ids[i] for i in positions])

    def metrics(self) -> Dict[str, float]:
        """Flat scalar metrics for logging: the protocol's, then each own metric's mean over users."""
        return {
            "personalized_accuracy": self.personalized_accuracy,
            "personalized_accuracy_std": self.personalized_accuracy_std,
            "personalized_accuracy_min": min(self.per_user_accuracy),
            "accuracy_before_adaptation": self.accuracy_before_adaptation,
            "personalized_loss": float(torch.tensor(self.per_user_loss).mean()) if self.per_user_loss else float("nan"),
            **{name: float(torch.tensor(self.per_user[name], dtype=torch.float64).mean()) for name in self.own_names},
        }


def accuracy_of(correct: int, total: int) -> float:
    """``correct / total`` as the evaluation computes an accuracy (a float32 mean of 0/1 values,
    returned as a Python float): a count a silo reports gives the same number as evaluating here."""
    return float(torch.tensor(correct / total, dtype=torch.float32))


def adaptation_batches(
    train_x: Tensor, train_y: Tensor, steps: int, batch_size: int, generator: torch.Generator
) -> Tuple[Tensor, Tensor]:
    """The (steps, batch) minibatches of the user's training data that adaptation uses."""
    (indices,) = batch_indices(len(train_y), steps, [min(batch_size, len(train_y))], generator)
    indices = indices.to(train_x.device)
    return model_inputs(train_x[indices]), train_y[indices]


def sgd_steps(
    loss_fn: LossFn, params: Params, batches_x: Tensor, batches_y: Tensor, alpha: Union[float, Params]
) -> Params:
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
def _accuracy_and_loss(
    network: nn.Module, params: Params, x: Tensor, y: Tensor, chain: Optional[HandBatchedGradients] = None
) -> tuple:
    """(accuracy, loss) of the model at ``params`` on ``x``, ``y``; by the ``chain``'s own pass
    where its probe found the network's bits there (:func:`_scores_together_exactly`)."""
    exact = chain is not None and chain.scores_one_exactly
    x = model_inputs(x)
    logits = chain.model_logits(params, x) if exact else logits_of(network, params, x)  # type: ignore[union-attr]
    loss = torch.nn.functional.cross_entropy(logits, y)
    return float((logits.argmax(dim=1) == y).float().mean()), float(loss)


def _adapted_one_by_one(
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    user_ids: Sequence[int],
    config: EvaluationConfig,
    round_idx: int,
    step: Union[float, Params],
    chain: Optional[HandBatchedGradients] = None,
    clip_bounds: Optional[Mapping[int, float]] = None,
) -> Iterator[Params]:
    """Each user's adapted model in turn. With ``config.privacy`` the steps are DP-SGD's (its
    accuracy leaves the user): Poisson minibatches of expected size ``batch_size``, per-sample
    gradients clipped and noised (``chain``: a Linear chain's form, which clips without forming them);
    with adaptive clipping at the user's own D bound (``clip_bounds``, by user id; the starting
    bound for a user not trained yet), releasing no count."""
    from .private_draws import draw_private_batches
    from .private_steps import private_sgd_steps

    for user_id, user in zip(user_ids, users):
        if config.privacy is None:
            generator = generator_for(config.seed, round_idx, user_id, Purpose.EVALUATION)
            batches = adaptation_batches(user.train_x, user.train_y, config.adapt_steps, config.batch_size, generator)
            yield sgd_steps(loss_fn, params, *batches, step)
            continue
        assert not isinstance(step, dict)  # the run's rules refuse learned step sizes with DP-SGD
        generator = generator_for(config.seed, round_idx, user_id, Purpose.PRIVATE_EVALUATION, config.privacy.secret)
        private = draw_private_batches(
            user.train_x, user.train_y, [config.batch_size], config.adapt_steps, params, generator
        )
        yield private_sgd_steps(loss_fn, params, private, step, personalization_dp(config, user_id, clip_bounds), chain)


def personalization_dp(
    config: EvaluationConfig, user_id: int, clip_bounds: Optional[Mapping[int, float]] = None
) -> "DPSGD":
    """The DP-SGD of user ``user_id``'s personalization step: the run's, and with adaptive clipping
    a fixed C at the user's own D bound (``clip_bounds``; the starting bound where it has none)."""
    dp = config.privacy
    assert dp is not None
    if not dp.adaptive:
        return dp
    bound = dp.max_grad_norm if clip_bounds is None else clip_bounds.get(int(user_id), dp.max_grad_norm)
    return dataclasses.replace(dp, clip="fixed", max_grad_norm=float(bound))


def _adapt_together(
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    user_ids: Sequence[int],
    config: EvaluationConfig,
    round_idx: int,
    step_size: Union[float, Params],
) -> Params:
    """The adapted models of ``users`` (every one with at least ``batch_size`` training samples),
    stacked: one vmapped computation, the numbers of :func:`_adapted_one_by_one`."""
    generators = [generator_for(config.seed, round_idx, user_id, Purpose.EVALUATION) for user_id in user_ids]
    indices = batch_indices_of_many(
        [len(u.train_y) for u in users], config.adapt_steps, [config.batch_size], generators
    )
    first = users[0]
    steps_and_size = (config.adapt_steps, config.batch_size)
    batches_x = torch.empty(
        (len(users), *steps_and_size, *first.train_x.shape[1:]),
        dtype=input_dtype(first.train_x),
        device=first.train_x.device,
    )
    batches_y = first.train_y.new_empty((len(users), *steps_and_size))
    for position, (user, (index,)) in enumerate(zip(users, indices)):  # each user's rows written in place
        rows = index.to(user.train_x.device).reshape(-1)
        gather_inputs(user.train_x, rows, batches_x[position].view(len(rows), *user.train_x.shape[1:]))
        torch.index_select(user.train_y, 0, rows, out=batches_y[position].view(len(rows)))
    if config.adapt_steps == 1 and not isinstance(step_size, dict):
        # One step of size alpha: sgd_steps' numbers, its axpy (-alpha g, then + w) done outside
        # vmap where the gradients lie, not in two fresh tensors of every user's size.
        adapted = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params, batches_x[:, 0], batches_y[:, 0])
        return {k: adapted[k].mul_(-step_size).add_(params[k]) for k in params}
    return vmap(lambda bx, by: sgd_steps(loss_fn, params, bx, by, step_size), in_dims=(0, 0))(batches_x, batches_y)


def _adapted_in_chunks(
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    user_ids: Sequence[int],
    config: EvaluationConfig,
    round_idx: int,
    step_size: Union[float, Params],
) -> Iterator[Params]:
    for start in range(0, len(users), USERS_PER_CHUNK):
        chunk = slice(start, start + USERS_PER_CHUNK)
        adapted = _adapt_together(loss_fn, params, users[chunk], user_ids[chunk], config, round_idx, step_size)
        yield from ({k: v[j] for k, v in adapted.items()} for j in range(len(users[chunk])))


def _score(
    network: nn.Module, params: Params, adapted_per_user: Iterable[Params], users: Sequence[UserSplit]
) -> EvaluationResult:
    # The adapted models are produced lazily: each user's adaptation ends before its test
    # data is read. Test splits differ in size: one forward pass per user.
    after, before, losses = [], [], []
    for adapted, user in zip(adapted_per_user, users):
        accuracy, loss = _accuracy_and_loss(network, adapted, user.test_x, user.test_y)
        after.append(accuracy)
        losses.append(loss)
        before.append(_accuracy_and_loss(network, params, user.test_x, user.test_y)[0])
    return EvaluationResult.of(after, before, losses)


def _evaluate_together(
    hand_batched: HandBatchedGradients,
    network: nn.Module,
    loss_fn: LossFn,
    params: Params,
    users: Sequence[UserSplit],
    user_ids: Sequence[int],
    config: EvaluationConfig,
    round_idx: int,
    step_size: Union[float, Params],
    test_stacks: Optional[dict],
    adapted_together: bool,
) -> EvaluationResult:
    """The numbers of adapting in chunks and :func:`_score`, for users of a Linear chain: the users
    of each test-split size adapted together, then the global model scored by one batched pass,
    and the adapted models by one too where that gives every user's logits bit for bit
    (``adapted_together``, :func:`_scores_together_exactly`), else user by user (a CPU whose
    per-user products split their sums over its threads: MKL's on 2 threads of an Intel Xeon).
    ``test_stacks`` keeps the stacked test splits from one evaluation to the next."""
    after, before, losses = [0.0] * len(users), [0.0] * len(users), [0.0] * len(users)
    by_size: dict = {}
    for position, user in enumerate(users):
        by_size.setdefault(len(user.test_y), []).append(position)
    for members in by_size.values():
        for start in range(0, len(members), USERS_PER_CHUNK):
            chunk = members[start : start + USERS_PER_CHUNK]
            group = [users[i] for i in chunk]
            adapted = _adapt_together(
                loss_fn, params, group, [user_ids[i] for i in chunk], config, round_idx, step_size
            )
            # each user's adaptation has ended before its test data is read
            x, y = _stacked_test_splits(group, test_stacks)
            x = model_inputs(x)  # the stacks are kept as stored (uint8 images: a quarter of the bytes)
            with torch.no_grad():
                logits_before = _global_logits(hand_batched, params, x)
                accuracy_before = (logits_before.argmax(dim=-1) == y).float().mean(dim=1).tolist()
                if adapted_together:
                    logits = hand_batched.logits(adapted, x)
                    accuracy = (logits.argmax(dim=-1) == y).float().mean(dim=1).tolist()
                for row, i in enumerate(chunk):
                    before[i] = accuracy_before[row]
                    if adapted_together:
                        after[i] = accuracy[row]
                        losses[i] = float(torch.nn.functional.cross_entropy(logits[row], y[row]))
                    else:
                        own = {k: v[row] for k, v in adapted.items()}
                        after[i], losses[i] = _accuracy_and_loss(
                            network, own, group[row].test_x, group[row].test_y, hand_batched
                        )
    return EvaluationResult.of(after, before, losses)


def _global_logits(hand_batched: HandBatchedGradients, params: Params, x: Tensor) -> Tensor:
    """The global model's logits of stacked test splits ``x`` (U, n, ...): one pass over all rows."""
    rows = hand_batched.logits({k: v.unsqueeze(0) for k, v in params.items()}, x.reshape(1, -1, *x.shape[2:]))
    return rows.view(x.shape[0], x.shape[1], -1)


_TEST_STACKS_BYTES = 256 * 2**20  # what test_stacks may hold: the paper's 50 users take 19 MB


def _stacked_test_splits(users: Sequence[UserSplit], test_stacks: Optional[dict]) -> tuple:
    """The test splits of ``users`` (all of one size) stacked, from ``test_stacks`` if it has them."""
    key = tuple((id(u.test_x), id(u.test_y)) for u in users)
    if test_stacks is not None and key in test_stacks:
        return test_stacks[key][1]
    stacks = torch.stack([u.test_x for u in users]), torch.stack([u.test_y for u in users])
    if test_stacks is not None:
        held = sum(x.numel() * x.element_size() for _, (x, _) in test_stacks.values())
        if held + stacks[0].numel() * stacks[0].element_size() <= _TEST_STACKS_BYTES:
            # the splits themselves are kept too, so the ids in the key stay theirs
            test_stacks[key] = ([(u.test_x, u.test_y) for u in users], stacks)
    return stacks


def _scores_together_exactly(
    hand_batched: HandBatchedGradients, network: nn.Module, params: Params, users: Sequence[UserSplit]
) -> bool:
    """Whether the batched passes of :func:`_evaluate_together` give the per-user passes' logits bit
    for bit here (it depends on the matrix kernels: decided once per hand_batched, by a probe);
    :attr:`HandBatchedGradients.scores_global_exactly` says the same of the global model's pass alone."""
    if hand_batched.scores_exactly is None:
        # random inputs of the test splits' shape: the probe reads no test data
        sample = users[0].test_x
        x = torch.randn(3, *sample.shape, generator=torch.Generator().manual_seed(0))
        x = x.to(sample.device, input_dtype(sample))
        shifted = [{k: v + 0.01 * (j + 1) for k, v in params.items()} for j in range(len(x))]
        with torch.no_grad():
            together = hand_batched.logits({k: torch.stack([p[k] for p in shifted]) for k in params}, x)
            before = _global_logits(hand_batched, params, x)
            hand_batched.scores_global_exactly = all(
                torch.equal(before[j], logits_of(network, params, x[j])) for j in range(len(x))
            )
            hand_batched.scores_exactly = hand_batched.scores_global_exactly and all(
                torch.equal(together[j], logits_of(network, shifted[j], x[j])) for j in range(len(x))
            )
            hand_batched.scores_one_exactly = all(
                torch.equal(hand_batched.model_logits(shifted[j], x[j]), logits_of(network, shifted[j], x[j]))
                for j in range(len(x))
            )
    return hand_batched.scores_exactly


def personalized_params(
    network: nn.Module,
    params: Params,
    user: UserSplit,
    user_id: int,
    config: EvaluationConfig,
    round_idx: int,
    loss_fn: Optional[LossFn] = None,
    step_sizes: Optional[Params] = None,
    hand_batched: Optional[HandBatchedGradients] = None,
    clip_bounds: Optional[Mapping[int, float]] = None,
) -> Params:
    """``params`` after user ``user_id``'s personalization step on its training data: the model
    :func:`evaluate` tests for that user at ``round_idx`` (the same keyed minibatches; with DP-SGD
    the same noise and bound, so it is the model whose figures were released)."""
    step = config.alpha if step_sizes is None else {k: step_sizes[k] for k in params}
    loss_fn = loss_fn if loss_fn is not None else make_loss_fn(network)
    one = _adapted_one_by_one(loss_fn, params, [user], [user_id], config, round_idx, step, hand_batched, clip_bounds)
    return next(one)


def evaluate(
    network: nn.Module,
    params: Params,
    users: Sequence[UserSplit],
    config: EvaluationConfig,
    round_idx: int,
    user_ids: Optional[Sequence[int]] = None,
    loss_fn: Optional[LossFn] = None,
    step_sizes: Optional[Params] = None,
    hand_batched: Optional[HandBatchedGradients] = None,
    test_stacks: Optional[dict] = None,
    clip_bounds: Optional[Mapping[int, float]] = None,
) -> EvaluationResult:
    """Personalized evaluation of ``params`` on ``users`` (see the module doc).

    ``network`` is a functional network (:func:`fedml_perfedavg.core.functional.functional_network`);
    ``user_ids`` key each user's adaptation batches (default 0..len(users)-1), so one silo
    evaluating user 7 draws what the server's evaluation of all users draws for user 7.
    ``step_sizes`` replaces alpha with per-coordinate step sizes (an algorithm that learns them).
    ``hand_batched``, the network's hand-batched form where it is a Linear hand_batched, scores users together
    where that gives the same bits (``config.batched``), keeping the stacked test splits in
    ``test_stacks`` (a dict the caller holds on to) for the next evaluation. ``clip_bounds``: with
    DP-SGD's adaptive clipping, each user's D bound by user id (:func:`personalization_dp`)."""
    user_ids = list(range(len(users))) if user_ids is None else list(user_ids)
    step = config.alpha if step_sizes is None else {k: step_sizes[k] for k in params}
    if len(user_ids) != len(users):
        raise ValueError(f"{len(user_ids)} user ids for {len(users)} users")
    loss_fn = loss_fn if loss_fn is not None else make_loss_fn(network)
    if config.privacy is not None:
        adapted = _adapted_one_by_one(
            loss_fn, params, users, user_ids, config, round_idx, step, hand_batched, clip_bounds
        )
        return _score(network, params, adapted, users)
    stackable = len(users) > 1 and all(len(u.train_y) >= config.batch_size for u in users)
    if config.batched and stackable and hand_batched is not None:
        adapted_together = _scores_together_exactly(hand_batched, network, params, users)
        if adapted_together or hand_batched.scores_global_exactly:
            return _evaluate_together(
                hand_batched,
                network,
                loss_fn,
                params,
                users,
                user_ids,
                config,
                round_idx,
                step,
                test_stacks,
                adapted_together,
            )
    adapt = _adapted_in_chunks if config.batched and stackable else _adapted_one_by_one
    return _score(network, params, adapt(loss_fn, params, users, user_ids, config, round_idx, step), users)
