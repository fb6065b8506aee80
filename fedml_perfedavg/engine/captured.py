"""A round's local training replayed as one CUDA graph (``device_args.capture_rounds``).

On a GPU the hand-batched round is thousands of small kernels, each launched from Python: an HF
round of the paper's MLP took 26-42 ms eager on an H200, the same kernels 3.7 ms replayed as one
graph (benchmarks/RESULTS.md, "CUDA"). What the graph holds is the computation only: the gathers
of the round's minibatches at indices the host drew (the algorithm's keyed draws, copied in
every round) and every client's local update from the global model copied in; its outputs are
copied out. What decides (the sampling, the divergence guard, the update screen, the
aggregation, the record) runs after it as on the eager path, on those outputs. The kernels are
the eager path's, so are the bits.

Off CUDA the same steps run uncaptured: the inputs copied into the same kept buffers, the
function called on them, its outputs written into kept buffers and copied out (what a test on a
CPU checks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..core.types import Params

logger = logging.getLogger(__name__)

#: The function a graph holds: (parameters to start from, the round's minibatch indices per role)
#: -> (the clients' stacked parameters, their training figures (clients, 2) or None).
Training = Callable[[Params, List[Tensor]], Tuple[Params, Optional[Tensor]]]

#: Calls before a capture, on a side stream, as CUDA graphs need (cuBLAS handles, the oracle's buffers).
WARMUP_CALLS = 3


@dataclass
class _Replay:
    """One shape's kept inputs, and its graph and outputs once captured."""

    start: Params
    index: List[Tensor]
    graph: Optional["torch.cuda.CUDAGraph"] = None
    outputs: Optional[Tuple[Params, Optional[Tensor]]] = None

    def load(self, start: Params, index: List[Tensor]) -> None:
        for k, v in start.items():
            self.start[k].copy_(v)
        for kept, given in zip(self.index, index):
            kept.copy_(given)

    def keep(self, outputs: Tuple[Params, Optional[Tensor]]) -> None:
        """Write uncaptured ``outputs`` into this shape's kept outputs, as a replay writes its graph's."""
        if self.outputs is None:
            self.outputs = outputs
            return
        trained, figures = self.outputs
        for k, v in outputs[0].items():
            trained[k].copy_(v)
        if figures is not None and outputs[1] is not None:
            figures.copy_(outputs[1])


class CapturedTraining:
    """``training`` over kept input buffers, one per input shape: on CUDA captured as a graph at
    its first call and replayed after; elsewhere called on the kept buffers (the same steps)."""

    def __init__(self, training: Training, device: torch.device) -> None:
        self.training = training
        self.device = device
        self.captures = device.type == "cuda"
        self._replays: Dict[tuple, _Replay] = {}

    def __call__(self, start: Params, index: List[Tensor]) -> Tuple[Params, Optional[Tensor]]:
        """The training of ``start`` (on this device) at ``index`` (host or device), copied out of
        the graph's memory (its next replay writes it again)."""
        key = (tuple((k, v.shape, v.dtype) for k, v in start.items()), tuple(i.shape for i in index))
        replay = self._replays.get(key)
        if replay is None:
            replay = _Replay(
                {k: torch.empty_like(v, memory_format=torch.contiguous_format) for k, v in start.items()},
                [torch.empty(i.shape, dtype=i.dtype, device=self.device) for i in index],
            )
            replay.load(start, index)
            if self.captures:
                try:
                    self._capture(replay)
                except Exception as err:  # noqa: BLE001 - said, and the same steps still run
                    replay.graph, replay.outputs = None, None
                    logger.warning(
                        "device_args.capture_rounds=True: this round's local training could not be captured "
                        "as a CUDA graph (%s: %s); it runs uncaptured",
                        type(err).__name__,
                        err,
                    )
            self._replays[key] = replay
        else:
            replay.load(start, index)
        if replay.graph is not None:
            replay.graph.replay()
        else:  # the graph's outputs are memory it writes at every replay: so are these
            replay.keep(self.training(replay.start, replay.index))
        assert replay.outputs is not None
        trained, figures = replay.outputs
        return {k: v.clone() for k, v in trained.items()}, None if figures is None else figures.clone()

    @property
    def graphs(self) -> int:
        """How many input shapes replay a captured graph."""
        return sum(replay.graph is not None for replay in self._replays.values())

    def _capture(self, replay: _Replay) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self.training(replay.start, replay.index)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replay.outputs = self.training(replay.start, replay.index)
        replay.graph = graph
        clients = next(iter(replay.outputs[0].values())).shape[0]
        logger.info("captured a round's local training of %d clients as one CUDA graph", clients)
