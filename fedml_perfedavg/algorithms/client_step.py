"""One client's local training, chosen once from what its algorithm declares, and the one
function that every backend runs for a client: FedML's per-client loops through
``client_update``, the batched engine vmapped over a round's clients (engine/batched.py), as
torch.optim's functional ``sgd()`` runs one update on one tensor or on many from a single switch.

What follows the training (the divergence guard, the figures, the own states kept, the result
hook) is :meth:`FederatedAlgorithm.finish_clients`'s, for one client and for many alike. The
engines' own batched kernels (hand-batched matrix products, the DP-SGD chain) compute the same
standard maths for many clients at once; engine/plan.py decides when they apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, ClassVar, Dict, Optional, Protocol, Tuple

from torch import Tensor

from ..core import adaptive_clipping
from ..core.client_maths import LocalBatches
from ..core.private_draws import PrivateBatches
from ..core.types import Params, StateDict


class Trains(Protocol):
    """What a client step reads of its algorithm (a :class:`~.base.FederatedAlgorithm`) and calls back."""

    settings: Any
    returns_whole_state: ClassVar[bool]
    keeps_client_state: ClassVar[bool]

    @property
    def reports_training(self) -> bool: ...

    def split_state(self, state: StateDict) -> Tuple[Params, StateDict]: ...

    def local_update(self, params: Params, batches: LocalBatches) -> Params: ...

    def local_update_and_figures(self, params: Params, batches: LocalBatches) -> Tuple[Params, Tensor]: ...

    def local_training(self, state: StateDict, batches: LocalBatches) -> StateDict: ...

    def initial_client_state(self, client_id: int, global_state: StateDict) -> StateDict: ...

    def local_training_with_state(
        self, state: StateDict, batches: LocalBatches, client_state: StateDict
    ) -> Tuple[StateDict, StateDict]: ...

    def private_update(self, params: Params, batches: PrivateBatches) -> Tuple[Params, Optional[Tensor]]: ...


class StepKind(str, Enum):
    OWN_STATE = "with a state of the client's own (local_training_with_state)"
    PRIVATE = "DP-SGD (private_update; with adaptive clipping the client keeps its clip bounds)"
    FIGURES = "its training figures recorded (local_update_and_figures)"
    PLAIN = "plain (local_update, or local_training on the whole state)"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ClientResult:
    """One client's training: the state it sends (parameters and buffers), its training figures
    (2,) or None, and its own state to keep (or None)."""

    state: StateDict
    figures: Optional[Tensor] = None
    own: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class ClientStep:
    """How ``algorithm``'s clients train, chosen once (:func:`choose_client_step`)."""

    algorithm: Trains
    kind: StepKind

    @property
    def whole_state(self) -> bool:
        """Whether the training starts from the whole state (parameters and buffers), not the parameters alone."""
        return self.kind is StepKind.OWN_STATE or (self.kind is StepKind.PLAIN and self.algorithm.returns_whole_state)

    @property
    def pure(self) -> Callable[[StateDict, LocalBatches], Any]:
        """The training as a pure function of where it starts (:attr:`whole_state`) and the
        minibatches, returning what it trained (and, with :attr:`records_figures`, the figures):
        what ``__call__`` runs for one client and the batched engine vmaps over many. Only the
        plain step and the one with figures are such a function."""
        algorithm = self.algorithm
        if self.kind is StepKind.FIGURES:
            return algorithm.local_update_and_figures
        if self.kind is StepKind.PLAIN:
            return algorithm.local_training if algorithm.returns_whole_state else algorithm.local_update
        raise TypeError(f"the client step {self.kind!r} is not a pure function of the start and the minibatches")

    @property
    def records_figures(self) -> bool:
        return self.kind is StepKind.FIGURES

    def __call__(
        self, client_id: int, global_state: StateDict, batches: LocalBatches, own: Optional[Dict[str, Any]]
    ) -> ClientResult:
        """Client ``client_id``'s training from ``global_state`` on ``batches``, with its own state
        kept from its last round (None: its first)."""
        algorithm = self.algorithm
        start = {k: v.detach() for k, v in global_state.items()}
        if self.kind is StepKind.OWN_STATE:
            own = algorithm.initial_client_state(client_id, start) if own is None else own
            new_state, own = algorithm.local_training_with_state(start, batches, own)
            return ClientResult(new_state, None, own)
        params, buffers = algorithm.split_state(start)
        if self.kind is StepKind.PRIVATE:
            assert isinstance(batches, PrivateBatches)
            trained_params, bounds = algorithm.private_update(params, batches)  # bounds: None for a fixed C
            own = None if bounds is None else {adaptive_clipping.STATE_KEY: bounds}
            return ClientResult({**buffers, **trained_params}, None, own)
        out = self.pure(start if self.whole_state else params, batches)
        trained, figures = out if self.records_figures else (out, None)
        return ClientResult(trained if self.whole_state else {**buffers, **trained}, figures)


def choose_client_step(algorithm: Trains, record_figures: bool = True) -> ClientStep:
    """``algorithm``'s client step, from what it declares: a state of the client's own, DP-SGD
    (only for the standard maths: core/privacy.py's DPSGD.check_algorithm), the training figures
    where the algorithm reports them (``record_figures=False`` leaves them out), else its plain update."""
    if algorithm.keeps_client_state:
        return ClientStep(algorithm, StepKind.OWN_STATE)
    if algorithm.settings.privacy is not None:
        return ClientStep(algorithm, StepKind.PRIVATE)
    if record_figures and algorithm.reports_training and not algorithm.returns_whole_state:
        return ClientStep(algorithm, StepKind.FIGURES)
    return ClientStep(algorithm, StepKind.PLAIN)
