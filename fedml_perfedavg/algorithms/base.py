"""The round protocol every algorithm follows, in the spirit of a Flower ``Strategy``; no maths.

An algorithm object owns what happens in a round, with the round number always passed in:

    sample_clients(round)                                  -> client ids
    client_update(round, client, global_state, x, y)       -> ClientUpdate
    aggregate(round, updates, global_state)                -> new global state
    evaluate(round, global_state, users)                   -> EvaluationResult

FedML's sp loop, its MPI simulator, its cross-silo server and client, and the batched engine
call these and nothing else of the algorithm. An algorithm is one file: a subclass that gives
its client's maths as :meth:`FederatedAlgorithm.local_update` (a pure function of the starting
parameters and the minibatches, so the batched engine can ``vmap`` it over the clients of a
round) or, to send back more than parameters, :meth:`FederatedAlgorithm.local_training`, and
declares its own settings as a ``Settings`` dataclass of
:func:`~fedml_perfedavg.core.settings.setting` fields (they join the config, its docs table and
the cross-silo fingerprint). Optional hooks: :meth:`~FederatedAlgorithm.client_batches` (other
minibatches), :meth:`~FederatedAlgorithm.combine` (the server's side),
:meth:`~FederatedAlgorithm.refinement_step_sizes` (a learned personalization step),
:meth:`~FederatedAlgorithm.initial_server_state` (the server's own tensors beside the model) and
:meth:`~FederatedAlgorithm.user_metrics` (per-user figures of its own, named in ``metric_names``).
Per-FedAvg and FedAvg's local SGD are :class:`~.gradient_steps.GradientSteps` algorithms: their
maths is :mod:`fedml_perfedavg.core.client_maths`, which engines may compute their own way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
from collections import OrderedDict
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    FrozenSet,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Type,
    cast,
)

import torch
from torch import Tensor, nn

from ..core import adaptive_clipping
from ..core.client_maths import LocalBatches, LocalUpdateConfig
from ..core.evaluation import EvaluationConfig, EvaluationResult, check_metric_names, evaluate, finite_figure
from ..core.functional import functional_network, make_loss_fn
from ..core.guards import apply_divergence_policy, is_finite, nonfinite_clients
from ..core.private_draws import PrivateBatches, RoundBuffers, draw_private_batches, draw_private_round
from ..core.privacy import DPSGD
from ..core.settings import check_settings, settings_of
from ..core.sampling import (
    Purpose,
    batch_indices_of_many,
    generator_for,
    keyed_order,
    sample_clients,
    sample_local_batches,
)
from ..core.types import Params, StateDict, UserSplit, model_inputs
from .client_states import ClientStates
from .client_step import ClientStep, choose_client_step
from .model_probe import ModelPaths, probe
from ..core.training_record import TrainingRecord
from .update_screen import screen_for

logger = logging.getLogger(__name__)

AGGREGATIONS = ("uniform", "sample_weighted")


DIVERGENCE_POLICIES = ("stop", "skip_client")


@dataclass(frozen=True)
class AlgorithmSettings:
    """What an algorithm object needs to know, whatever runs it (typed, no FedML)."""

    seed: int
    client_num_in_total: int
    client_num_per_round: int
    local_steps: int  # tau
    alpha: float  # the personalization step of F (and of every method's evaluation)
    beta: float  # the step size applied to the model (FedML's learning_rate)
    batch_sizes: Tuple[int, int, int]  # |D|, |D'|, |D''|
    evaluation: EvaluationConfig
    new_user_fraction: float = 0.0
    aggregation: str = "uniform"
    on_divergence: str = "stop"
    max_update_norm: Optional[float] = None
    max_update_ratio: Optional[float] = 1.0
    max_skipped_rounds: int = 3
    update_norm_factor: Optional[float] = None  # the bound relative to accepted updates (update_screen.py)
    max_weight_ratio: Optional[float] = None
    privacy: Optional[DPSGD] = None  # DP-SGD in the local steps and the evaluation's (core/privacy.py)
    own: Any = None  # the algorithm's own settings (an instance of its ``Settings``), or None
    # A data owner's silo's per-run secret, by client id, in the key of that client's minibatch
    # draws beside (seed, round, client): two runs never send identical inputs (docs/security.md).
    draw_secrets: Mapping[int, bytes] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # One DP-SGD policy: the evaluation's personalization step is a use of the run's own mechanism,
        # so ``evaluation.privacy`` always is ``privacy`` (a silo's keyed policy, set once, reaches both).
        if self.evaluation.privacy is not self.privacy:
            object.__setattr__(self, "evaluation", dataclasses.replace(self.evaluation, privacy=self.privacy))

    @classmethod
    def from_config(cls, config: Any, own_settings: Optional[type] = None) -> "AlgorithmSettings":
        """The settings a run config (:class:`fedml_perfedavg.run.config.Config`) asks for, with
        the algorithm's own (``own_settings``, its ``Settings`` dataclass) read from it by name."""
        privacy = config.privacy
        own = None
        if own_settings is not None:
            own = own_settings(**{f.name: config.setting(f.name) for f in settings_of(own_settings)})
        return cls(
            seed=config.common.random_seed,
            client_num_in_total=config.train.client_num_in_total,
            client_num_per_round=config.train.client_num_per_round,
            local_steps=config.train.local_steps,
            alpha=config.train.alpha,
            beta=config.train.beta,
            batch_sizes=config.batch_sizes,
            evaluation=EvaluationConfig(
                alpha=config.train.alpha,
                adapt_steps=config.validation.adapt_steps,
                batch_size=config.train.batch_size,
                seed=config.common.random_seed,
            ),  # its privacy is the run's (__post_init__)
            new_user_fraction=config.train.new_user_fraction,
            aggregation=config.train.aggregation,
            on_divergence=config.train.on_divergence,
            max_update_norm=config.train.max_update_norm,
            max_update_ratio=config.train.max_update_ratio,
            max_skipped_rounds=config.train.max_skipped_rounds,
            update_norm_factor=config.train.update_norm_factor,
            max_weight_ratio=config.train.max_weight_ratio,
            privacy=privacy,
            own=own,
        )


class RoundHooks:
    """What may act on a round between the algorithm's own steps, the same on every backend:
    FedML's differential privacy, attacks and defenses
    (:class:`fedml_perfedavg.fedml_bridge.safeguards.FedMLSafeguards`). This default changes
    nothing. Client hooks run wherever the client trains; server hooks inside
    :meth:`FederatedAlgorithm.aggregate`."""

    #: True when :meth:`client_labels` may change labels (an engine must then call it).
    poisons_labels: bool = False
    #: True when :meth:`client_result` may change a client's model.
    changes_client_results: bool = False

    def client_labels(self, round_idx: int, client_id: int, y: Tensor) -> Tensor:
        """The labels a client trains on this round (a data-poisoning attack flips them)."""
        return y

    def client_result(self, round_idx: int, client_id: int, state: StateDict) -> StateDict:
        """What a client sends after training (local DP adds noise to it)."""
        return state

    def before_aggregation(
        self, round_idx: int, updates: List[Tuple[float, StateDict]], global_state: StateDict
    ) -> List[Tuple[float, StateDict]]:
        """The updates as the server's aggregation sees them (a model attack replaces some;
        central DP clips them); runs before the update checks."""
        return updates

    def filter_updates(
        self, round_idx: int, updates: List[Tuple[float, StateDict]], global_state: StateDict
    ) -> List[Tuple[float, StateDict]]:
        """The accepted updates a defense keeps (or reshapes) before they are combined."""
        return updates

    def combine(
        self,
        round_idx: int,
        updates: List[Tuple[float, StateDict]],
        global_state: StateDict,
        base: "Callable[[List[Tuple[float, StateDict]]], StateDict]",
    ) -> StateDict:
        """The new global state from the kept updates: ``base`` (the algorithm's own average)
        unless a defense aggregates its own way."""
        return base(updates)

    def after_aggregation(self, round_idx: int, state: StateDict, global_state: StateDict) -> StateDict:
        """The new global model as published (central DP adds noise to it)."""
        return state


NO_HOOKS = RoundHooks()


class ClientUpdate(NamedTuple):
    """What one client returns: its sample count and its new model state."""

    num_samples: int
    state: StateDict


def initial_global_state(algorithm: "FederatedAlgorithm", model: nn.Module) -> "OrderedDict[str, Tensor]":
    """The global state a run starts from: ``model``'s state, then the algorithm's own tensors
    beside it (:meth:`FederatedAlgorithm.initial_server_state`). Every backend carries it whole
    (FedML's "model params" are this state); ValueError if a name of the algorithm's is the model's."""
    state = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    extra = algorithm.initial_server_state(state)
    clash = sorted(set(extra) & set(state))
    if clash:
        raise ValueError(f"{algorithm.label}.initial_server_state names tensors of the model's own: {clash}")
    state.update((k, v.detach().clone()) for k, v in extra.items())
    return state


def average(updates: Sequence[Tuple[float, StateDict]], weighting: str) -> "OrderedDict[str, Tensor]":
    """Average of client models: plain (``uniform``, Algorithm 1) or by sample count."""
    if not updates:
        raise ValueError("cannot aggregate an empty list of client updates")
    if weighting == "uniform":
        weights = [1.0 / len(updates)] * len(updates)
    elif weighting == "sample_weighted":
        total = float(sum(n for n, _ in updates))
        weights = [n / total for n, _ in updates]
    else:
        raise ValueError(f"train_args.aggregation={weighting!r} is not one of {list(AGGREGATIONS)}")
    keys = updates[0][1].keys()
    averaged: "OrderedDict[str, Tensor]" = OrderedDict()
    for k in keys:
        first = updates[0][1][k]
        if first.is_floating_point():
            averaged[k] = cast(Tensor, sum(w * sd[k] for w, (_, sd) in zip(weights, updates)))
        else:  # an integer buffer (BatchNorm's num_batches_tracked) stays an integer
            summed = cast(Tensor, sum(w * sd[k].double() for w, (_, sd) in zip(weights, updates)))
            averaged[k] = summed.round().to(first.dtype)
    return averaged


def _private_generator(algorithm: "FederatedAlgorithm", round_idx: int, client_id: int) -> torch.Generator:
    """The generator of a client's DP-SGD draws in a round, keyed by (seed, round, client) and the
    party's secret."""
    settings = algorithm.settings
    secret = None if settings.privacy is None else settings.privacy.secret
    return generator_for(settings.seed, round_idx, client_id, Purpose.PRIVATE_TRAINING, secret)


def private_batches(
    algorithm: "FederatedAlgorithm", round_idx: int, client_id: int, x: Tensor, y: Tensor
) -> PrivateBatches:
    """DP-SGD's Poisson minibatches and noise for a client's round, keyed by (seed, round, client)."""
    settings, standard = algorithm.settings, algorithm.standard_update
    assert standard is not None  # DP-SGD runs only the standard maths (checked when it is built)
    generator = _private_generator(algorithm, round_idx, client_id)
    roles = standard.step.batch_roles
    bounds = algorithm.clip_bounds_of(client_id)
    return draw_private_batches(
        x, y, settings.batch_sizes[:roles], settings.local_steps, algorithm._shapes, generator, bounds
    )


def private_round_batches(
    algorithm: "FederatedAlgorithm",
    round_idx: int,
    clients: Sequence[int],
    data: Sequence[Tuple[Tensor, Tensor]],
    each: Callable[[Callable[[int], Any], int], List[Any]],
    buffers: Optional[RoundBuffers] = None,
    lazy_inputs: bool = False,
    input_norms: Optional[Sequence[Tensor]] = None,
) -> PrivateBatches:
    """:func:`private_batches` of each of ``clients`` (their training ``data``), stacked client
    first, the same numbers, drawn into the stacked tensors (:func:`draw_private_round`; in
    ``buffers`` where given; the inputs left to gather with ``lazy_inputs``, with the clients'
    ``input_norms`` where given)."""
    settings, standard = algorithm.settings, algorithm.standard_update
    assert standard is not None
    roles = standard.step.batch_roles
    return draw_private_round(
        data,
        settings.batch_sizes[:roles],
        settings.local_steps,
        algorithm._shapes,
        [_private_generator(algorithm, round_idx, c) for c in clients],
        [algorithm.clip_bounds_of(c) for c in clients],
        each,
        buffers,
        lazy_inputs,
        input_norms,
    )


def check_declarations(cls: "type[FederatedAlgorithm]") -> None:
    """TypeError for an algorithm class whose declarations do not match its methods: an engine
    that trains many clients at once must know what a client sends back, or a local_training of
    its own that changed buffers would be silently dropped."""
    if "local_training" in vars(cls) and not cls.returns_whole_state:
        raise TypeError(
            f"{cls.__name__} defines local_training: declare returns_whole_state = True (a client "
            f"sends back its whole state), or give its maths as local_update(params, batches)"
        )
    if "local_training_with_state" in vars(cls) and not cls.keeps_client_state:
        raise TypeError(f"{cls.__name__} defines local_training_with_state: declare keeps_client_state = True")
    check_metric_names(cls.__name__, cls.metric_names)
    if bool(cls.metric_names) != (cls.user_metrics is not FederatedAlgorithm.user_metrics):
        raise TypeError(
            f"{cls.__name__}: metric_names and user_metrics go together (one declares what the other gives)"
        )


def own_metrics(
    algorithm: "FederatedAlgorithm",
    round_idx: int,
    global_state: StateDict,
    users: Sequence[UserSplit],
    user_ids: Sequence[int],
) -> Dict[str, List[float]]:
    """Each user's figures of the algorithm's own (``metric_names``), by name: ValueError for a
    user whose ``user_metrics`` gives other names or a value that is not a finite number."""
    names = algorithm.metric_names
    own: Dict[str, List[float]] = {name: [] for name in names}
    for user_id, user in zip(user_ids, users):
        as_model_takes = UserSplit(model_inputs(user.train_x), user.train_y, model_inputs(user.test_x), user.test_y)
        figures = algorithm.user_metrics(round_idx, global_state, as_model_takes, int(user_id))
        if not isinstance(figures, dict) or set(figures) != set(names):
            given = sorted(figures) if isinstance(figures, dict) else type(figures).__name__
            raise ValueError(
                f"{algorithm.label}.user_metrics gave {given} for user {user_id}; its metric_names are {list(names)}"
            )
        for name in names:
            own[name].append(finite_figure(figures[name], f"{algorithm.label}.user_metrics' {name} of user {user_id}"))
    return own


def with_own_settings(cls: "type[FederatedAlgorithm]", settings: AlgorithmSettings) -> AlgorithmSettings:
    """``settings`` with ``cls``'s own (its ``Settings``; their defaults where none were given),
    checked against their declaration."""
    if cls.Settings is None:
        return settings
    own = settings.own if settings.own is not None else cls.Settings()
    if not isinstance(own, cls.Settings):
        raise TypeError(f"{cls.name}: settings.own is a {type(own).__name__}, not its {cls.Settings.__name__}")
    check_settings(own)
    return dataclasses.replace(settings, own=own)


_OWN_MATHS = (
    "its client maths is its own, which DP-SGD's per-sample clipping and noise do not reach; only "
    "algorithms on the standard local update run it (PerFedAvg, FedAvgUpdate)"
)


def dp_refusal(cls: Type["FederatedAlgorithm"]) -> Optional[str]:
    """Why DP-SGD cannot run algorithm class ``cls``, or None: its own per-user figures, or client
    maths of its own (in its words, ``dp_refusal_reason``). The one owner of that decision: the
    config's rules ask it when the settings are read, the algorithm when it is built."""
    if cls.metric_names:
        return f"its own per-user figures {list(cls.metric_names)} would be released with no DP-SGD account of them"
    if cls.returns_whole_state or cls.keeps_client_state:
        return cls.dp_refusal_reason or _OWN_MATHS
    return None


def refuse_own_maths_under_dp(algorithm: "FederatedAlgorithm") -> None:
    """DP-SGD reaches only the standard local update: :class:`ConfigError` for an algorithm
    whose client maths is its own (:func:`dp_refusal`, or no standard update on this model)."""
    privacy = algorithm.settings.privacy
    if privacy is not None:
        why = dp_refusal(type(algorithm)) or (_OWN_MATHS if algorithm.standard_update is None else None)
        privacy.check_algorithm(algorithm.name, why)


class FederatedAlgorithm:
    """Base of every algorithm in the registry: the round protocol, no maths of its own. It holds
    no model weights (global states come in and go out explicitly); its state, the aggregation's
    record and any clients' own states, is in :meth:`state_dict` for checkpoints."""

    name: ClassVar[str] = "base"
    #: The algorithm's own settings: a frozen dataclass of :func:`~fedml_perfedavg.core.settings.setting`
    #: fields (section ``train_args``; keys named after the algorithm), or None. They join the
    #: config, its docs table and the cross-silo fingerprint; ``settings.own`` holds their values.
    Settings: ClassVar[Optional[type]] = None
    #: True when a client sends back its whole state, buffers and server state included (its
    #: :meth:`local_training` changes them, as FedAvgARUBA's does), not only its parameters.
    returns_whole_state: ClassVar[bool] = False
    #: True when each client keeps a state of its own from one of its rounds to its next
    #: (:meth:`initial_client_state`, :meth:`local_training_with_state`; see client_states.py).
    keeps_client_state: ClassVar[bool] = False
    #: The minibatches of :class:`LocalBatches` (0: ``x, y``; 1: ``second_*``; 2: ``third_*``) its
    #: own maths reads (an engine gathers only these); the standard maths' step says (plan.py).
    batch_roles: ClassVar[FrozenSet[int]] = frozenset({0, 1, 2})
    #: The per-user figures :meth:`user_metrics` adds to every evaluation, beside the protocol's
    #: (accuracy after and before the personalization step, loss): reported, logged, in wandb, in
    #: ``show``, and sent by a data owner's silo to the server.
    metric_names: ClassVar[Tuple[str, ...]] = ()
    #: Why DP-SGD cannot reach this algorithm's own client maths, in its words (:func:`dp_refusal`;
    #: None: the general reason).
    dp_refusal_reason: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declarations(cls)

    def __init__(self, model: nn.Module, settings: AlgorithmSettings) -> None:
        self.settings = with_own_settings(type(self), settings)
        #: The client's maths when it is core.client_maths' local update (resolved once, here).
        self.standard_update: Optional[LocalUpdateConfig] = self.standard_maths()
        refuse_own_maths_under_dp(self)
        self.hooks: RoundHooks = NO_HOOKS
        self.network = functional_network(model)
        self.loss_fn = make_loss_fn(self.network)
        self.parameter_names = [name for name, _ in model.named_parameters()]
        self._shapes = {name: torch.empty(p.shape, dtype=p.dtype) for name, p in model.named_parameters()}  # DP noise's
        self.paths = ModelPaths(self.network)  # what the model allows; set by :meth:`probe_model`
        self.screen = screen_for(self.parameter_names, settings)
        self.aggregate_calls = 0
        self.client_states = ClientStates()  # kept only by an algorithm that keeps_client_state
        #: The clients' training figures, by round (training_record.py), where :attr:`reports_training`.
        self.training = TrainingRecord()
        self._test_stacks: dict = {}  # the evaluation's stacked test splits, kept between evaluations

    def standard_maths(self) -> Optional[LocalUpdateConfig]:
        """The config of :func:`fedml_perfedavg.core.client_maths.local_update` when that is this
        algorithm's client maths (an engine may then compute it its own way: hand-batched, or
        under DP-SGD), or None: its :meth:`local_update` is its own. Read once, at construction."""
        return None

    @property
    def holds_client_states(self) -> bool:
        """Whether each client keeps a state from one of its rounds to its next: the algorithm's own
        (:attr:`keeps_client_state`), or DP-SGD's adaptive clip bounds (core/adaptive_clipping.py).
        Whoever holds a client holds its state (client_states.py)."""
        privacy = self.settings.privacy
        return self.keeps_client_state or (privacy is not None and privacy.adaptive)

    def clip_bounds_of(self, client_id: int) -> Optional[Tensor]:
        """Client ``client_id``'s adaptive clip bounds now, one per minibatch role (its starting
        bounds before its first round), or None without adaptive clipping."""
        privacy, standard = self.settings.privacy, self.standard_update
        if privacy is None or not privacy.adaptive or standard is None:
            return None
        kept = self.client_states.get(client_id)
        if kept is not None and adaptive_clipping.STATE_KEY in kept:
            return kept[adaptive_clipping.STATE_KEY]
        return adaptive_clipping.initial_bounds(standard.step.batch_roles, privacy.max_grad_norm)

    def private_update(self, params: Params, batches: PrivateBatches) -> Tuple[Params, Optional[Tensor]]:
        """DP-SGD's local update of the standard maths, and the client's adaptive clip bounds
        after it (None for a fixed C): an algorithm of gradient steps gives it (gradient_steps.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no DP-SGD update")

    @property
    def reports_training(self) -> bool:
        """Whether a client's training figures (its local steps' mean loss and accuracy on D) are
        recorded: for the standard maths without DP-SGD (they are functions of the private data,
        released with no account of them); an algorithm with maths of its own gives none."""
        return self.standard_update is not None and self.settings.privacy is None

    def local_update_and_figures(self, params: Params, batches: LocalBatches) -> Tuple[Params, Tensor]:
        """:meth:`local_update` and the update's training figures, (2,): its steps' mean loss and
        accuracy (only where :attr:`reports_training`)."""
        raise NotImplementedError(f"{type(self).__name__} records no training figures")

    @property
    def rejected(self) -> Dict[int, int]:
        """Round -> client updates rejected (:class:`UpdateScreen`; the driver adds the silos' refused uploads)."""
        return self.screen.rejected

    @classmethod
    def from_config(cls, model: nn.Module, config: Any) -> "FederatedAlgorithm":
        """The algorithm for ``model`` as a run config asks for it."""
        return cls(model, AlgorithmSettings.from_config(config, cls.Settings))

    def use_hooks(self, hooks: RoundHooks) -> None:
        """Act on every round with ``hooks`` (FedML's DP, attacks and defenses, on every backend)."""
        self.hooks = hooks

    @property
    def label(self) -> str:
        """How logs and errors name this algorithm."""
        return self.name

    def probe_model(self, global_state: StateDict, x: Tensor, y: Tensor) -> List[str]:
        """Probe once, on a batch ``x, y`` of the run's size, what the model allows and set ``paths``
        by it (model_probe.py): a line for each fallback, saying why, or ModelMismatch."""
        return probe(self, global_state, model_inputs(x), y)

    # -- sample ---------------------------------------------------------------------------
    def sample_clients(self, round_idx: int) -> List[int]:
        """The round's clients, uniformly without replacement, keyed by (seed, round)."""
        s = self.settings
        return sample_clients(s.seed, round_idx, s.client_num_in_total, s.client_num_per_round, s.new_user_fraction)

    def keyed_order(self, round_idx: int) -> List[int]:
        """Every training user in the round's keyed order, :meth:`sample_clients`'s first."""
        s = self.settings
        return keyed_order(s.seed, round_idx, s.client_num_in_total, s.client_num_per_round, s.new_user_fraction)

    # -- client update --------------------------------------------------------------------
    def client_batches(self, round_idx: int, client_id: int, x: Tensor, y: Tensor) -> LocalBatches:
        """Three independent minibatches for each local step (:class:`LocalBatches`), keyed by
        (seed, round, client) (with DP-SGD, Poisson minibatches and the noise of each use: :class:`PrivateBatches`)."""
        if self.settings.privacy is not None:
            return private_batches(self, round_idx, client_id, x, y)  # type: ignore[return-value]
        generator = self._training_generator(round_idx, client_id)
        return sample_local_batches(x, y, self.settings.local_steps, self.settings.batch_sizes, generator)

    def _training_generator(self, round_idx: int, client_id: int) -> torch.Generator:
        """The generator of a client's minibatches in a round: keyed by (seed, round, client) and,
        in a data owner's silo, its run secret."""
        s = self.settings
        return generator_for(s.seed, round_idx, client_id, Purpose.LOCAL_TRAINING, s.draw_secrets.get(client_id))

    def batch_indices(self, round_idx: int, clients: Sequence[int], num_samples: Sequence[int]) -> List[List[Tensor]]:
        """Per client of ``clients`` (with ``num_samples`` training samples each), the sample
        indices of :meth:`client_batches` (three, each ``(steps, size)``), the same numbers,
        drawn together, so an engine can gather every client's batches at once."""
        generators = [self._training_generator(round_idx, c) for c in clients]
        return batch_indices_of_many(num_samples, self.settings.local_steps, self.settings.batch_sizes, generators)

    def local_update(self, params: Params, batches: LocalBatches) -> Params:
        """The client's maths: a pure function of the starting parameters and the minibatches
        (the batched engine vmaps it over the clients of a round), one step per leading index
        of ``batches`` (``local_steps`` of them; fewer give the iterate after that many steps).
        Every algorithm gives its own (or its own :meth:`local_training`)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no client maths: define local_update(params, batches), or "
            f"local_training(state, batches) with returns_whole_state = True"
        )

    def local_training(self, state: StateDict, batches: LocalBatches) -> StateDict:
        """The client's whole update as a pure function of its starting state (parameters and
        buffers). The default trains the parameters with :meth:`local_update` and returns the
        buffers as received; an algorithm that sends more than a model back (statistics in its
        server state, as FedAvgARUBA's squared gradients) overrides this and sets
        :attr:`returns_whole_state`."""
        params, buffers = self.split_state(state)
        return {**buffers, **self.local_update(params, batches)}

    def initial_server_state(self, model_state: StateDict) -> StateDict:
        """Tensors of the algorithm's own that go with the global model on every backend, never
        registered on the model (FedAvgARUBA's learned rates; :func:`initial_global_state`)."""
        return {}

    def initial_client_state(self, client_id: int, global_state: StateDict) -> StateDict:
        """A client's own state before its first round (only with :attr:`keeps_client_state`)."""
        return {}

    def local_training_with_state(
        self, state: StateDict, batches: LocalBatches, client_state: StateDict
    ) -> Tuple[StateDict, StateDict]:
        """The update of a client that keeps a state of its own: (what it sends back, as
        :meth:`local_training` returns it; its own new state, which it keeps)."""
        return self.local_training(state, batches), client_state

    def split_state(self, state: StateDict) -> Tuple[Params, StateDict]:
        """(trainable parameters, the rest: buffers) of a model state."""
        params = {k: state[k] for k in self.parameter_names}
        return params, {k: v for k, v in state.items() if k not in params}

    def check_client_result(self, round_idx: int, client_id: int, params: Params) -> None:
        """The divergence guard: non-finite parameters stop the run or drop the client."""
        if not is_finite(params):
            apply_divergence_policy(self.settings.on_divergence, round_idx, client_id, self.label)

    def client_minibatches(self, round_idx: int, client_id: int, x: Tensor, y: Tensor) -> LocalBatches:
        """The client's minibatches of round ``round_idx`` (:meth:`client_batches`) on its labels
        as the round's hooks give them (a label-flipping attack)."""
        return self.client_batches(
            round_idx, client_id, self.inputs_for_draws(x), self.hooks.client_labels(round_idx, client_id, y)
        )

    def draws_keyed_batches(self) -> bool:
        """Whether the minibatches are :meth:`client_batches`' own keyed draws (not an algorithm's)."""
        return type(self).client_batches is FederatedAlgorithm.client_batches

    def inputs_for_draws(self, x: Tensor) -> Tensor:
        """A client's training inputs as :meth:`client_batches` takes them: the keyed draws scale
        stored uint8 images row by row as they gather them; an algorithm's own draws get
        :func:`~fedml_perfedavg.core.types.model_inputs` of all of them."""
        return x if self.draws_keyed_batches() else model_inputs(x)

    def client_update(
        self, round_idx: int, client_id: int, global_state: StateDict, x: Tensor, y: Tensor
    ) -> ClientUpdate:
        """One client's local training from ``global_state`` on its data (x, y), then what follows
        any client's (:meth:`finish_clients`)."""
        batches = self.client_minibatches(round_idx, client_id, x, y)
        kept = self.client_states.get(client_id) if self.keeps_client_state else None
        with torch.no_grad():  # torch.func computes the gradients; no autograd graph is kept
            result = self.client_step(client_id, global_state, batches, kept)
        (update,) = self.finish_clients(
            round_idx,
            [client_id],
            [len(y)],
            {k: v.unsqueeze(0) for k, v in result.state.items()},
            global_state,
            None if result.figures is None else result.figures.unsqueeze(0),
            None if result.own is None else [result.own],
        )
        return update

    @functools.cached_property
    def client_step(self) -> ClientStep:
        """How this algorithm's clients train (client_step.py), chosen once: what
        :meth:`client_update` runs for a client, and what the batched engine vmaps."""
        return choose_client_step(self)

    def finish_clients(
        self,
        round_idx: int,
        clients: Sequence[int],
        samples: Sequence[int],
        trained: StateDict,
        global_state: StateDict,
        figures: Optional[Tensor] = None,
        own_states: Optional[Sequence[Dict[str, Any]]] = None,
    ) -> List[ClientUpdate]:
        """What follows the local training of ``clients``, however it was computed (one client by
        :meth:`client_update`, a round's clients at once by the batched engine): the divergence
        guard, the clients' training figures ((clients, 2), where recorded) and their own states
        kept, and the round's result hook on what each sends. ``trained``: each key stacked client
        first (the parameters, or whole states); a key of ``global_state`` it lacks (a buffer) is
        sent as the global model has it."""
        diverged = nonfinite_clients({k: trained[k] for k in self.parameter_names})
        for position in diverged:  # stops the run, or (skip_client) the aggregation drops the update
            self.check_client_result(round_idx, clients[position], {k: v[position] for k, v in trained.items()})
        if figures is not None:
            self.training.add(round_idx, list(clients), figures)
        if own_states is not None:  # a dropped update leaves the client's own state as it was
            for position, (client, own) in enumerate(zip(clients, own_states)):
                if position not in diverged:
                    self.client_states.put(client, own)
        return [
            ClientUpdate(
                count,
                self.hooks.client_result(
                    round_idx,
                    client,
                    OrderedDict((k, trained[k][i] if k in trained else global_state[k]) for k in global_state),
                ),
            )
            for i, (client, count) in enumerate(zip(clients, samples))
        ]

    # -- aggregate ------------------------------------------------------------------------
    def aggregate(
        self,
        round_idx: int,
        updates: Sequence[Tuple[float, StateDict]],
        global_state: StateDict,
        clients: Optional[Sequence[str]] = None,
    ) -> StateDict:
        """The new global model: the average (``settings.aggregation``) of the updates the
        screen accepts (update_screen.py; ``clients``: who sent each, for its record); a round
        with none keeps the global model, and ``max_skipped_rounds`` such rounds stop the run."""
        self.aggregate_calls += 1
        updates = self.hooks.before_aggregation(round_idx, list(updates), global_state)
        accepted = self.screen.accept(round_idx, updates, global_state, clients)
        if accepted:
            accepted = self.hooks.filter_updates(round_idx, accepted, global_state)
            combined = self.hooks.combine(
                round_idx, accepted, global_state, lambda kept: self.combine(round_idx, kept, global_state)
            )
            return self.hooks.after_aggregation(round_idx, combined, global_state)
        return self.keep_global(round_idx, global_state)

    def aggregate_secure_mean(self, round_idx: int, mean_delta: Any, global_state: StateDict) -> StateDict:
        """The new global model from the securely summed weighted mean of the clients' parameter
        deltas (``mean_delta``: flat, in :attr:`parameter_names`' order), the only aggregate a
        server that sees no single update holds: the screen's checks are each client's clipping,
        and :meth:`combine` is the mean (secure aggregation refuses an algorithm that overrides it).
        Buffers stay the global model's, as :meth:`combine` keeps them; the round's hooks after
        aggregation (central DP's noise) apply as to a plain average."""
        from ..secagg.vectors import unflatten

        self.aggregate_calls += 1
        delta = unflatten(mean_delta, global_state, self.parameter_names)
        combined = OrderedDict((k, (v + delta[k]) if k in delta else v.clone()) for k, v in global_state.items())
        return self.hooks.after_aggregation(round_idx, combined, global_state)

    def keep_global(self, round_idx: int, global_state: StateDict) -> StateDict:
        """A round with nothing to aggregate (no update accepted, or a secure round that could not
        finish) keeps the global model and counts as skipped (``max_skipped_rounds`` such rounds stop
        the run)."""
        self.screen.skip(round_idx)
        return OrderedDict((k, v.clone()) for k, v in global_state.items())

    def combine(
        self, round_idx: int, accepted: Sequence[Tuple[float, StateDict]], global_state: StateDict
    ) -> StateDict:
        """The new global state from the accepted updates (at least one): their parameters'
        average (``settings.aggregation``; Algorithm 1's plain average by default). Buffers stay
        the global model's: a client of the standard maths returns them as it received them
        (BatchNorm's running statistics are neither updated nor averaged), so what a client
        sends there is noise or a lie, and an integer counter stays an integer."""
        averaged = average(accepted, self.settings.aggregation)
        if self.returns_whole_state:
            return averaged
        parameters = set(self.parameter_names)
        return OrderedDict((k, averaged[k] if k in parameters else global_state[k].clone()) for k in averaged)

    # -- evaluate -------------------------------------------------------------------------
    def evaluate(
        self,
        round_idx: int,
        global_state: StateDict,
        users: Sequence[UserSplit],
        user_ids: Optional[Sequence[int]] = None,
        batched: bool = True,
    ) -> EvaluationResult:
        """Personalized evaluation (one alpha-step on each user's training data, then its test
        split), the same for every algorithm."""
        params, _ = self.split_state(global_state)
        config = self.settings.evaluation
        shape = tuple(users[0].test_x.shape[1:]) if users else None
        batched = batched and self.paths.batches_evaluation(shape)
        if config.batched != batched:
            config = dataclasses.replace(config, batched=batched)
        result = evaluate(
            self.network,
            params,
            users,
            config,
            round_idx,
            user_ids=user_ids,
            loss_fn=self.loss_fn,
            step_sizes=self.refinement_step_sizes(global_state),
            hand_batched=self.paths.hand_batched_form(shape),
            test_stacks=self._test_stacks,
            clip_bounds=self.evaluation_clip_bounds(range(len(users)) if user_ids is None else user_ids),
        )
        ids = range(len(users)) if user_ids is None else user_ids
        return result.with_own(own_metrics(self, round_idx, global_state, users, ids)) if self.metric_names else result

    def evaluation_clip_bounds(self, user_ids: Iterable[int]) -> Optional[Dict[int, float]]:
        """With adaptive clipping, each of ``user_ids``' bound of its personalization step: its D
        bound now (core/evaluation.py's ``personalization_dp``); else None."""
        bounds = {}
        for user in user_ids:
            own = self.clip_bounds_of(int(user))
            if own is None:
                return None
            bounds[int(user)] = float(own[0])
        return bounds

    def clip_bounds_record(self) -> Dict[str, Dict[str, List[float]]]:
        """summary.json's ``dp_clip_bounds``: with adaptive clipping, the bounds of each user whose
        state this process holds (every trained user on sp and MPI; none on a data owners' server),
        one per minibatch role; else nothing."""
        privacy = self.settings.privacy
        if privacy is None or not privacy.adaptive:
            return {}
        states = self.client_states.state_dict().items()
        bounds = {str(c): [float(b) for b in s[adaptive_clipping.STATE_KEY]] for c, s in states}
        return {"dp_clip_bounds": bounds} if bounds else {}

    def user_metrics(self, round_idx: int, global_state: StateDict, user: UserSplit, user_id: int) -> Dict[str, float]:
        """One user's figures of :attr:`metric_names` at an evaluation of ``global_state`` (a
        client's own state: ``self.client_states.get(user_id)``); a finite number each."""
        return {}

    def refinement_step_sizes(self, global_state: StateDict) -> Optional[Params]:
        """Per-coordinate step sizes of the personalization step at evaluation, or None for
        alpha (every method but one that learns its own, as FedAvgARUBA)."""
        return None

    def describe(self, global_state: StateDict) -> Dict[str, float]:
        """Extra scalars about the algorithm's state, logged with each evaluation: here, with
        adaptive clipping, each role's bound (D, D', D''), its median over the users trained so far
        (where this process holds their states: sp, MPI's server)."""
        bounds = self.clip_bounds_record().get("dp_clip_bounds")
        if not bounds:
            return {}
        roles = len(next(iter(bounds.values())))
        names = ("dp_clip_bound_d", "dp_clip_bound_d_prime", "dp_clip_bound_d_second")[:roles]
        return {name: statistics.median(own[i] for own in bounds.values()) for i, name in enumerate(names)}

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The aggregation's record, for checkpoints."""
        own = {"client_states": self.client_states.state_dict()} if self.holds_client_states else {}
        return {**self.screen.state_dict(), "aggregate_calls": self.aggregate_calls, **own}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.screen.load_state_dict(state)
        self.aggregate_calls = int(state.get("aggregate_calls", 0))
        self.client_states.load_state_dict(state.get("client_states", {}))
