"""The local update of every client of a computation, one step at a time through ``torch.compile``.

``device_args.compile_local_update`` on a chain of Linear layers. The eager path computes the
step in reused buffers (:meth:`~.hand_batched.HandBatchedGradients.local_update`), which a tracer
cannot follow; here the step is the allocating arithmetic over the same oracle
(:class:`~.client_maths.FunctionalSteps`, whose eager numbers are the buffered path's bit for
bit), which torch.compile traces whole: inductor fuses the elementwise kernels between the
matrix products (activations and their derivatives, the softmax, the updates), and on CUDA
the step is replayed as a graph. One step is compiled, not the loop: the graph is tau times
smaller and serves every step and every round (compile times and speed: benchmarks/RESULTS.md,
"The compiled local update"). Fused kernels sum in other orders, so the results differ from the eager path's
in the last bits (benchmarks/RESULTS.md); the eager path stays the default.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from .client_maths import FunctionalSteps, Gradients, LocalBatches, LocalUpdateConfig, StepFigures, step_direction
from .hand_batched import IndexedInputs
from .types import Params


class CompiledLocalUpdate:
    """``config``'s local update by ``oracle`` (clients first, as the hand-batched oracle computes
    them), each step one call of a compiled function (``mode``: torch.compile's; under CUDA graphs,
    "reduce-overhead", what a step returns is copied out of the graph's memory)."""

    def __init__(self, oracle: Gradients, config: LocalUpdateConfig, mode: str = "default") -> None:
        self.oracle, self.config = oracle, config
        self._step = torch.compile(self._one_step, mode=mode, dynamic=False, fullgraph=True)
        # CUDA graphs' outputs are the graph's memory, written again by its next replay
        self._copy_out: Callable[[Optional[torch.Tensor]], Any] = _copy if mode == "reduce-overhead" else _same

    def _one_step(self, w: Params, batch: LocalBatches, record: bool) -> Tuple[Params, Optional[StepFigures]]:
        steps = FunctionalSteps(self.oracle, batch, self.config.step)
        figures: Optional[List[StepFigures]] = [] if record else None
        direction = step_direction(steps, w, 0, self.config.alpha, self.config.delta, figures)
        return steps.move(w, direction, self.config.beta), figures[0] if figures else None

    def _batch_at(self, batches: LocalBatches, t: int) -> LocalBatches:
        """Step ``t``'s minibatches with a step dimension of one; a role the step does not read
        gets D's (its tensors stand in for it, as the engine's gather does)."""
        tensors: List[Any] = []
        for role in range(3):
            if role >= self.config.step.batch_roles:
                tensors += tensors[:2]
                continue
            x, y = batches[2 * role], batches[2 * role + 1]
            inputs = x.step(t) if isinstance(x, IndexedInputs) else x[t]  # gathered here, outside the graph
            tensors += [inputs.unsqueeze(0), y[t].unsqueeze(0)]
        return LocalBatches(*tensors)

    def __call__(self, params: Params, batches: LocalBatches, figures: Optional[List[StepFigures]] = None) -> Params:
        """Every client's local update from ``params`` (client first) on ``batches`` (step first;
        inputs may be :class:`IndexedInputs`); ``figures``: each step's training figures are appended."""
        w = {k: v.contiguous() for k, v in params.items()}  # one layout every step: one graph
        for t in range(self.config.local_steps):
            w, step_figures = self._step(w, self._batch_at(batches, t), figures is not None)
            if figures is not None:
                assert step_figures is not None
                figures.append(StepFigures(*(self._copy_out(value) for value in step_figures)))
        return {k: self._copy_out(v) for k, v in w.items()}


def _copy(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if value is None else value.clone()


def _same(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return value
