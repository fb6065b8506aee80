"""Algorithms whose client takes tau gradient-type steps from the global model, the maths of
:mod:`fedml_perfedavg.core.client_maths`: Per-FedAvg's meta-steps (FO, HF, exact) and FedAvg's
plain SGD. Declaring that maths (:meth:`GradientSteps.standard_maths`) lets an engine compute it
its own way: hand-batched over a round's clients (core/hand_batched.py), or with DP-SGD's
per-sample clipping and noise (core/private_steps.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

from torch import Tensor

from ..core import client_maths
from ..core.client_maths import LocalBatches, LocalUpdateConfig, StepFigures
from ..core.private_draws import PrivateBatches
from ..core.private_steps import private_update
from ..core.types import Params
from .base import FederatedAlgorithm


class GradientSteps(FederatedAlgorithm):
    """An algorithm whose client maths is :func:`~fedml_perfedavg.core.client_maths.local_update`
    with the config its :meth:`standard_maths` returns (a subclass's one method)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Engines compute standard_maths' update their own way: maths of its own would be bypassed.
        own = [name for name in ("local_update", "local_training") if name in vars(cls)]
        if own and "standard_maths" not in vars(cls):
            raise TypeError(
                f"{cls.__name__} defines {own[0]}, but its standard_maths() still says its update is "
                f"client_maths.local_update: derive from FederatedAlgorithm instead, or return None there"
            )

    def standard_maths(self) -> LocalUpdateConfig:
        raise NotImplementedError(f"{type(self).__name__} must say its step: standard_maths() -> LocalUpdateConfig")

    def local_update(self, params: Params, batches: LocalBatches) -> Params:
        """``standard_update``'s local update from ``params`` (with DP-SGD's per-sample clipping
        and noise when ``batches`` are :class:`~fedml_perfedavg.core.private_draws.PrivateBatches`)."""
        standard = self.standard_update
        if standard is None:  # a subclass that said its maths is its own must define this method
            return super().local_update(params, batches)
        if isinstance(batches, PrivateBatches):
            return self.private_update(params, batches)[0]
        return self._update(params, batches, standard, None)

    def local_update_and_figures(self, params: Params, batches: LocalBatches) -> Tuple[Params, Tensor]:
        standard = self.standard_update
        if standard is None or isinstance(batches, PrivateBatches):
            return super().local_update_and_figures(params, batches)
        figures: List[StepFigures] = []
        trained = self._update(params, batches, standard, figures)
        return trained, client_maths.mean_figures(figures)

    def _update(
        self, params: Params, batches: LocalBatches, standard: LocalUpdateConfig, figures: Optional[List[StepFigures]]
    ) -> Params:
        steps = batches.x.shape[0]
        config = standard if steps == standard.local_steps else dataclasses.replace(standard, local_steps=steps)
        oracle = self.paths.gradient_oracle(self.loss_fn)
        return client_maths.local_update(self.loss_fn, params, batches, config, oracle, figures)

    def private_update(self, params: Params, batches: PrivateBatches) -> Tuple[Params, Optional[Tensor]]:
        """The local update with DP-SGD: by a Linear chain's outer products where the model is
        one, else per-sample gradients by torch.func (core/private_steps.py); and the client's adaptive
        clip bounds after it (None for a fixed C)."""
        privacy, paths, standard = self.settings.privacy, self.paths, self.standard_update
        assert privacy is not None and standard is not None
        chain = paths.private_chain(tuple(batches.x.shape[3:]))
        config = dataclasses.replace(standard, local_steps=batches.steps)
        return private_update(self.loss_fn, params, batches, config, privacy, chain, paths.forward_ad)
