"""FedML's ``ClientTrainer`` / ``ServerAggregator`` as thin shims over an algorithm object.

FedML's loops call these hooks; each forwards to the algorithm object with the round number
read in one place, :func:`round_of`, from ``args.round_idx``: FedML's own convention
(cross_silo/client/fedml_trainer.py and simulation/mpi/fedavg/FedAVGTrainer.py set it before
``train``; the bridge's sp and cross-silo adapters set it where FedML forgets).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..algorithms.base import FederatedAlgorithm, initial_global_state
from ..core.evaluation import EvaluationResult, personalized_params
from ..core.types import StateDict, UserSplit
from ..data.fedml_format import client_samples, users_from_fedml_dataset
from .bootstrap import import_fedml
from .safeguards import without_safeguards

import_fedml()  # torchvision needs its op schemas before FedML imports it
from fedml.core import ClientTrainer, ServerAggregator  # noqa: E402

logger = logging.getLogger(__name__)


def aggregate_with_hooks(aggregator: Any, updates: List[Tuple[float, StateDict]]) -> Tuple[StateDict, list, list]:
    """A ``ServerAggregator``'s round as FedML's own servers run it (core/alg_frame/
    server_aggregator.py: ``on_before_aggregation``, ``aggregate``, ``on_after_aggregation``):
    the one adapter the sp loop, the MPI server and the cross-silo server call, for the plugin's
    aggregator or a user's. Returns the new global model, the updates the hooks kept, and their
    positions among those given."""
    kept, positions = aggregator.on_before_aggregation(updates)
    return aggregator.on_after_aggregation(aggregator.aggregate(kept)), kept, positions


def round_of(args: Any) -> int:
    """The current round, as FedML's loops publish it (``args.round_idx``)."""
    round_idx = getattr(args, "round_idx", None)
    if round_idx is None:
        raise RuntimeError(
            "args.round_idx is not set: the FedML loop running this trainer did not say which round "
            "it is (the plugin's adapters set it; a custom loop must set args.round_idx)"
        )
    return int(round_idx)


def state_copy(model: nn.Module) -> "OrderedDict[str, Tensor]":
    """A detached CPU copy of the model's state."""
    return OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())


class CarriesGlobalState:
    """What FedML carries as "model params" for a plugin algorithm: the global state, that is the
    model's state and the algorithm's own tensors beside it (``initial_server_state``: FedAvgARUBA's
    learned rates), which are kept here, never registered on the model. FedML's ``ClientTrainer`` and
    ``ServerAggregator`` get and set a model's ``state_dict`` alone (core/alg_frame/)."""

    model: nn.Module
    algorithm: FederatedAlgorithm

    def _carry_server_state(self) -> None:
        self._model_keys = frozenset(self.model.state_dict())  # fixed: the model's names never change
        state = initial_global_state(self.algorithm, self.model)
        self.server_state = OrderedDict((k, v) for k, v in state.items() if k not in self._model_keys)

    def global_state(self, device: Optional[torch.device] = None) -> Dict[str, Tensor]:
        """The current global state (on ``device``)."""
        state = {**self.model.state_dict(), **self.server_state}
        return state if device is None else {k: v.to(device) for k, v in state.items()}

    def get_model_params(self) -> "OrderedDict[str, Tensor]":
        state = state_copy(self.model)
        state.update((k, v.detach().cpu().clone()) for k, v in self.server_state.items())
        return state

    def set_model_params(self, model_parameters: Dict[str, Tensor]) -> None:
        extra = [k for k in model_parameters if k not in self._model_keys]
        if sorted(extra) != sorted(self.server_state):
            raise ValueError(
                f"a global state whose tensors beside the model are {sorted(extra)}; "
                f"{self.algorithm.label} carries {sorted(self.server_state)}"
            )
        self.model.load_state_dict({k: v for k, v in model_parameters.items() if k not in self.server_state})
        self.server_state = OrderedDict((k, model_parameters[k].detach().clone()) for k in self.server_state)


class AlgorithmClientTrainer(CarriesGlobalState, ClientTrainer):
    """FedML's client side of any plugin algorithm: ``train`` is one ``client_update``."""

    def __init__(self, model: nn.Module, args: Any, algorithm: FederatedAlgorithm) -> None:
        super().__init__(model, without_safeguards(args))  # FedML's singletons off: the algorithm applies them
        self.args = args
        self.algorithm = algorithm
        self.train_calls = 0
        # (client, role) -> (FedML data, x, y): converted once while the client's data stays the same object.
        self._tensors: Dict[Tuple[int, str], Tuple[Any, Tensor, Tensor]] = {}
        self.local_train_dataset = None
        self._carry_server_state()

    # FedML's ClientTrainer poisons data in update_dataset and adds local DP noise in
    # on_after_local_training (core/alg_frame/client_trainer.py), through process-wide singletons
    # that FedML's own trainers re-enable; the algorithm's round hooks do both, on every backend.
    def update_dataset(self, local_train_dataset, local_test_dataset, local_sample_number) -> None:
        self.local_train_dataset, self.local_test_dataset = local_train_dataset, local_test_dataset
        self.local_sample_number = local_sample_number

    def on_before_local_training(self, train_data, device, args) -> None:
        pass

    def on_after_local_training(self, train_data, device, args) -> None:
        pass

    def tensors(self, data: Any, device: torch.device, role: str = "training") -> Tuple[Tensor, Tensor]:
        """(x, y) of this client's FedML ``role`` data on ``device``, converted once (again only
        when FedML hands another object for the same client and role)."""
        key = (int(self.id), role)
        cached = self._tensors.get(key)
        if cached is None or cached[0] is not data:
            x, y = client_samples(data, f"client {self.id}'s {role} data")
            cached = self._tensors[key] = (data, x.to(device), y.to(device))
        return cached[1], cached[2]

    def train(self, train_data, device, args) -> None:
        """The algorithm's client update of this client (``self.id``) from the current model."""
        self.local_train_dataset = train_data
        x, y = self.tensors(train_data, device)
        update = self.algorithm.client_update(round_of(args), int(self.id), self.global_state(device), x, y)
        self.set_model_params(update.state)
        self.train_calls += 1

    def test(self, test_data, device, args) -> Dict[str, float]:
        """Personalized test of this client (adapt on its training data, then test): the model
        received at the start of round ``args.round_idx``."""
        if self.local_train_dataset is None:
            raise RuntimeError("test() needs the client's training data: call update_dataset() or train() first")
        train_x, train_y = self.tensors(self.local_train_dataset, device)
        test_x, test_y = self.tensors(test_data, device, "test")
        result = self.algorithm.evaluate(
            round_of(args),
            self.global_state(device),
            [UserSplit(train_x, train_y, test_x, test_y)],
            user_ids=[int(self.id)],
            batched=False,
        )
        total = len(test_y)
        own = {name: result.per_user[name][0] for name in result.own_names}  # the algorithm's own figures
        return {
            "test_correct": result.per_user_accuracy[0] * total,
            "test_total": total,
            "test_loss": result.per_user_loss[0] * total,
            "test_correct_before_adaptation": result.per_user_accuracy_before[0] * total,
            **({"test_own_metrics": own} if own else {}),
        }

    def personalized(self, round_idx: int, global_state: StateDict) -> StateDict:
        """``global_state`` after this client's personalization step on its training data: the
        model its evaluation of round ``round_idx`` tested (a data owner keeps it)."""
        if self.local_train_dataset is None:
            raise RuntimeError("personalized() needs the client's training data: call update_dataset() first")
        device = next(iter(global_state.values())).device
        x, y = self.tensors(self.local_train_dataset, device)
        params, _ = self.algorithm.split_state(global_state)
        adapted = personalized_params(
            self.algorithm.network,
            params,
            UserSplit(x, y, x[:0], y[:0]),
            int(self.id),
            self.algorithm.settings.evaluation,
            round_idx,
            self.algorithm.loss_fn,
            self.algorithm.refinement_step_sizes(global_state),
            self.algorithm.paths.hand_batched_form(tuple(x.shape[1:])),
            self.algorithm.evaluation_clip_bounds([int(self.id)]),  # adaptive clipping: the user's bound, as evaluated
        )
        return {**global_state, **{k: v.detach() for k, v in adapted.items()}}


class AlgorithmServerAggregator(CarriesGlobalState, ServerAggregator):
    """FedML's server side of any plugin algorithm: ``aggregate`` is the algorithm's
    ``aggregate`` (update checks included), ``test_all`` its personalized evaluation."""

    def __init__(
        self,
        model: nn.Module,
        args: Any,
        algorithm: FederatedAlgorithm,
        on_evaluation: Optional[Callable[[int, EvaluationResult], None]] = None,
    ) -> None:
        super().__init__(model, without_safeguards(args))  # FedML's singletons off: the algorithm applies them
        self.args = args
        self.algorithm = algorithm
        self.on_evaluation = on_evaluation
        self.senders: Optional[List[str]] = None  # who sent the next round's updates, where known
        self._carry_server_state()

    # FedML's ServerAggregator applies DP clipping and noise, model attacks and defenses in
    # on_before/on_after_aggregation (core/alg_frame/server_aggregator.py); here the algorithm's
    # aggregate does, through its round hooks, the same on every backend.
    def on_before_aggregation(self, raw_client_model_or_grad_list: List[Tuple[float, StateDict]]):
        return raw_client_model_or_grad_list, list(range(len(raw_client_model_or_grad_list)))

    def on_after_aggregation(self, aggregated_model_or_grad: StateDict) -> StateDict:
        return aggregated_model_or_grad

    def aggregate(self, raw_client_model_or_grad_list: List[Tuple[float, StateDict]]) -> StateDict:
        # Who sent each update, where the loop knows (the cross-silo server sets it each round).
        senders, self.senders = self.senders, None
        params = self.get_model_params()
        return self.algorithm.aggregate(round_of(self.args), raw_client_model_or_grad_list, params, senders)

    def test(self, test_data, device, args) -> Dict[str, float]:
        """Accuracy of the global model (no personalization) on ``test_data``."""
        x, y = client_samples(test_data, "test data")
        self.model.to(device).eval()
        with torch.no_grad():
            logits = self.model(x.to(device))
            loss = torch.nn.functional.cross_entropy(logits, y.to(device), reduction="sum")
        return {
            "test_correct": float((logits.argmax(1) == y.to(device)).sum()),
            "test_total": len(y),
            "test_loss": float(loss),
        }

    def test_all(self, train_data_local_dict, test_data_local_dict, device, args) -> bool:
        """Personalized evaluation of every client, reported to ``on_evaluation``."""
        dataset = [None] * 5 + [train_data_local_dict, test_data_local_dict]
        users = users_from_fedml_dataset(dataset, device)
        result = self.algorithm.evaluate(round_of(args), self.global_state(device), users)
        if self.on_evaluation is not None:
            self.on_evaluation(round_of(args), result)
        return True


def create_fedml_pair(
    algorithm: FederatedAlgorithm,
    model: nn.Module,
    args: Any,
    on_evaluation: Optional[Callable[[int, EvaluationResult], None]] = None,
) -> Tuple[AlgorithmClientTrainer, AlgorithmServerAggregator]:
    """The (ClientTrainer, ServerAggregator) pair FedML's loops call for ``algorithm``.

    The trainer gets its own copy of the model: FedML's sp loop trains clients in place, and
    the aggregator's model must stay the global model."""
    import copy

    return (
        AlgorithmClientTrainer(copy.deepcopy(model), args, algorithm),
        AlgorithmServerAggregator(model, args, algorithm, on_evaluation),
    )
