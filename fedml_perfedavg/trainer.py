"""FedML glue: the client trainer and server aggregator that run Per-FedAvg (and FedAvg).

The maths lives in :mod:`fedml_perfedavg.algorithm` and :mod:`fedml_perfedavg.evaluation`;
these classes adapt it to FedML's ``ClientTrainer`` / ``ServerAggregator`` hooks.
"""
from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .fedml_compat import import_fedml

import_fedml()  # torchvision needs its op schemas before FedML imports it
from fedml.core import ClientTrainer, ServerAggregator  # noqa: E402

from .algorithm import LocalUpdateConfig, local_update, make_loss_fn
from .config import Config
from .evaluation import UserSplit, evaluate_user, personalized_evaluation
from .guards import RunStopped, apply_divergence_policy, is_finite, update_problem
from .reporting import RunRecorder
from .sampling import Purpose, generator_for, sample_local_batches

logger = logging.getLogger(__name__)


def update_config_of(config: Config, method: str) -> LocalUpdateConfig:
    """The local-update hyperparameters a config asks for."""
    return LocalUpdateConfig(method=method, variant=config.perfedavg_variant, alpha=config.alpha,
                             beta=config.beta, delta=config.delta, local_steps=config.local_steps)


def tensors_of(data: Any) -> Tuple[Tensor, Tensor]:
    """(x, y) behind a FedML data loader over a ``TensorDataset`` (or an (x, y) pair)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        return data[0], data[1]
    dataset = getattr(data, "dataset", None)
    tensors = getattr(dataset, "tensors", None)
    if tensors is None or len(tensors) != 2:
        raise TypeError(f"expected a DataLoader over a TensorDataset(x, y), got {type(data).__name__}")
    return tensors[0], tensors[1]


def _state_dict_copy(model: nn.Module) -> "OrderedDict[str, Tensor]":
    return OrderedDict((k, v.detach().cpu().clone()) for k, v in model.state_dict().items())


class PerFedAvgTrainer(ClientTrainer):
    """Runs one client's local update (Per-FedAvg fo/hf/exact, or FedAvg's local SGD)."""

    def __init__(self, model: nn.Module, args: Any, config: Config, update: LocalUpdateConfig) -> None:
        super().__init__(model, args)
        self.config = config
        self.update = update
        self.loss_fn = make_loss_fn(model)
        self.batch_sizes = (config.batch_size, config.meta_batch_size, config.hessian_batch_size)
        self.local_train_dataset = None
        self.train_calls = 0

    def get_model_params(self) -> "OrderedDict[str, Tensor]":
        return _state_dict_copy(self.model)

    def set_model_params(self, model_parameters: Dict[str, Tensor]) -> None:
        self.model.load_state_dict(model_parameters)

    def train(self, train_data, device, args) -> None:
        """``local_steps`` steps from the current global model on this client's data."""
        self.local_train_dataset = train_data
        x, y = tensors_of(train_data)
        self.model.to(device)
        round_idx = int(getattr(args, "round_idx", 0) or 0)
        generator = generator_for(self.config.random_seed, round_idx, int(self.id), Purpose.LOCAL_TRAINING)
        batches = sample_local_batches(x, y, self.update.local_steps, self.batch_sizes, generator)
        batches = type(batches)(*(t.to(device) for t in batches))
        params = {k: p.detach() for k, p in self.model.named_parameters()}
        new_params = local_update(self.loss_fn, params, batches, self.update)
        if not is_finite(new_params):
            apply_divergence_policy(self.config, round_idx, int(self.id))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(new_params[name])
        self.train_calls += 1

    def test(self, test_data, device, args) -> Dict[str, float]:
        """Personalized test of this client: adapt on its training data, then test."""
        if self.local_train_dataset is None:
            raise RuntimeError("test() needs the client's training data: call update_dataset() or train() first")
        train_x, train_y = tensors_of(self.local_train_dataset)
        test_x, test_y = tensors_of(test_data)
        user = UserSplit(train_x.to(device), train_y.to(device), test_x.to(device), test_y.to(device))
        params = {k: p.detach() for k, p in self.model.to(device).named_parameters()}
        generator = generator_for(self.config.random_seed, int(getattr(args, "round_idx", 0) or 0), int(self.id),
                                  Purpose.EVALUATION)
        accuracy, before, loss = evaluate_user(self.model, self.loss_fn, params, user, self.config.alpha,
                                               self.config.adapt_steps, self.config.batch_size, generator)
        total = len(test_y)
        return {"test_correct": accuracy * total, "test_total": total, "test_loss": loss * total,
                "test_correct_before_adaptation": before * total}


def average(updates: Sequence[Tuple[float, Dict[str, Tensor]]], weighting: str) -> "OrderedDict[str, Tensor]":
    """Average of client models: plain (``uniform``, Algorithm 1) or by sample count."""
    if not updates:
        raise ValueError("cannot aggregate an empty list of client updates")
    if weighting == "uniform":
        weights = [1.0 / len(updates)] * len(updates)
    elif weighting == "sample_weighted":
        total = float(sum(n for n, _ in updates))
        weights = [n / total for n, _ in updates]
    else:
        raise ValueError(f"train_args.aggregation={weighting!r} is not one of ['uniform', 'sample_weighted']")
    keys = updates[0][1].keys()
    return OrderedDict((k, sum(w * sd[k] for w, (_, sd) in zip(weights, updates))) for k in keys)


class PerFedAvgAggregator(ServerAggregator):
    """Averages client models and runs the personalized evaluation of all users."""

    def __init__(self, model: nn.Module, args: Any, config: Config, recorder: Optional[RunRecorder] = None) -> None:
        super().__init__(model, args)
        self.config = config
        self.recorder = recorder
        self.loss_fn = make_loss_fn(model)
        self.aggregate_calls = 0
        self.skipped_rounds = 0
        self.rejected: Dict[int, int] = {}  # round -> rejected client updates

    def get_model_params(self) -> "OrderedDict[str, Tensor]":
        return _state_dict_copy(self.model)

    def set_model_params(self, model_parameters: Dict[str, Tensor]) -> None:
        self.model.load_state_dict(model_parameters)

    def on_before_aggregation(self, raw_client_model_or_grad_list):
        """Reject client updates that do not fit the global model (keys, shapes, dtypes,
        finiteness, ``max_update_norm``); the round goes on with the rest."""
        round_idx = int(getattr(self.args, "round_idx", 0) or 0)
        reference = self.get_model_params()
        accepted = []
        for position, (samples, update) in enumerate(raw_client_model_or_grad_list):
            problem = update_problem(update, reference, self.config.max_update_norm)
            if problem is None:
                accepted.append((samples, update))
            else:
                logger.warning("round %d: rejected client update %d: %s", round_idx, position, problem)
        rejected = len(raw_client_model_or_grad_list) - len(accepted)
        if rejected:
            self.rejected[round_idx] = rejected
        if accepted:
            return super().on_before_aggregation(accepted)
        self.skipped_rounds += 1
        logger.error("round %d: no acceptable client update; the global model is kept (%d such rounds, "
                     "train_args.max_skipped_rounds=%d)", round_idx, self.skipped_rounds,
                     self.config.max_skipped_rounds)
        if self.skipped_rounds >= self.config.max_skipped_rounds:
            raise RunStopped(f"{self.skipped_rounds} rounds had no acceptable client update "
                             f"(train_args.max_skipped_rounds={self.config.max_skipped_rounds}); last at round {round_idx}")
        return [], []

    def aggregate(self, raw_client_model_or_grad_list: List[Tuple[float, Dict[str, Tensor]]]):
        self.aggregate_calls += 1
        if not raw_client_model_or_grad_list:  # every update was rejected: keep the global model
            return self.get_model_params()
        return average(raw_client_model_or_grad_list, self.config.aggregation)

    def on_after_aggregation(self, aggregated_model_or_grad):
        aggregated = super().on_after_aggregation(aggregated_model_or_grad)
        if self.recorder is not None:
            self.recorder.round_finished(int(getattr(self.args, "round_idx", 0) or 0))
        return aggregated

    def test(self, test_data, device, args) -> Dict[str, float]:
        """Accuracy of the global model (no personalization) on ``test_data``."""
        x, y = tensors_of(test_data)
        self.model.to(device).eval()
        with torch.no_grad():
            logits = self.model(x.to(device))
            loss = torch.nn.functional.cross_entropy(logits, y.to(device), reduction="sum")
        return {"test_correct": float((logits.argmax(1) == y.to(device)).sum()), "test_total": len(y),
                "test_loss": float(loss)}

    def evaluate_users(self, users: Sequence[UserSplit], round_idx: int):
        """Personalized evaluation of the current global model on ``users``."""
        params = {k: p.detach() for k, p in self.model.named_parameters()}
        return personalized_evaluation(self.model, self.loss_fn, params, users, self.config.alpha,
                                       self.config.adapt_steps, self.config.batch_size,
                                       self.config.random_seed, round_idx)

    def test_all(self, train_data_local_dict, test_data_local_dict, device, args) -> bool:
        """Personalized evaluation of every user; recorded and logged."""
        users = [UserSplit(*(t.to(device) for t in (*tensors_of(train_data_local_dict[i]),
                                                     *tensors_of(test_data_local_dict[i]))))
                 for i in sorted(train_data_local_dict)]
        self.model.to(device)
        round_idx = int(getattr(args, "round_idx", 0) or 0)
        result = self.evaluate_users(users, round_idx)
        if self.recorder is not None:
            self.recorder.record_evaluation(round_idx, result)
        return True


def _create(model: nn.Module, config: Config, args: Any, recorder: Optional[RunRecorder], method: str):
    update = update_config_of(config, method)
    # The trainer gets its own copy: FedML's sp loop trains clients in place, and the aggregator's
    # model must stay the global model (it is the reference that client updates are checked against).
    trainer = PerFedAvgTrainer(copy.deepcopy(model), args, config, update)
    return trainer, PerFedAvgAggregator(model, args, config, recorder)


def create_perfedavg(model: nn.Module, config: Config, args: Any, recorder: Optional[RunRecorder] = None):
    """Registry factory for Per-FedAvg (variant from ``train_args.perfedavg_variant``)."""
    return _create(model, config, args, recorder, "perfedavg")


def create_fedavg(model: nn.Module, config: Config, args: Any, recorder: Optional[RunRecorder] = None):
    """Registry factory for the FedAvg baseline (local SGD, step size beta)."""
    return _create(model, config, args, recorder, "fedavg")
