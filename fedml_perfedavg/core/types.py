"""Types shared by the core, the algorithms, the data layer and the FedML bridge."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence

import torch
from torch import Tensor

Params = Dict[str, Tensor]
"""Trainable parameters by name, as ``nn.Module.named_parameters`` names them."""

StateDict = Dict[str, Tensor]
"""A full model state (parameters and buffers), what FedML sends between server and clients."""

LossFn = Callable[[Params, Tensor, Tensor], Tensor]
"""``loss(params, x, y)``: a scalar loss as a pure function of the parameters."""


class UserSplit(NamedTuple):
    """One user's training and test tensors; inputs may be stored uint8 images, which every reader
    takes through :func:`model_inputs` or :func:`gather_inputs`."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


IMAGE_SCALE = 255
"""uint8 images are stored as read and scaled by this where they are used, as torchvision's
``ToTensor`` scales them: a quarter of float32's bytes, the same float32 numbers."""


def model_inputs(x: Tensor) -> Tensor:
    """``x`` as the model takes it: stored uint8 images as float32 in [0, 1] (``x / 255``,
    torchvision's ``ToTensor``), anything else as it is."""
    return x.float().div_(IMAGE_SCALE) if x.dtype == torch.uint8 else x


def input_dtype(x: Tensor) -> torch.dtype:
    """The dtype of :func:`model_inputs` of ``x``."""
    return torch.float32 if x.dtype == torch.uint8 else x.dtype


def gather_inputs(data: Tensor, rows: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``model_inputs(data[rows])`` (``rows`` one-dimensional), into ``out`` where given: a
    uint8 store's rows are scaled after the gather, so only the rows read become float32."""
    if data.dtype != torch.uint8:
        return torch.index_select(data, 0, rows, out=out)
    picked = torch.index_select(data, 0, rows)
    if out is None:
        return picked.float().div_(IMAGE_SCALE)
    return out.copy_(picked).div_(IMAGE_SCALE)


def one_block(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.cat(tensors)``, without a copy where they lie one after another in one storage
    (the same values either way: the view covers exactly their elements, in order)."""
    first = tensors[0]
    start, expected = first.storage_offset(), first.storage_offset()
    storage = first.untyped_storage()
    for t in tensors:
        same = t.untyped_storage().data_ptr() == storage.data_ptr() and t.dtype == first.dtype
        if not same or not t.is_contiguous() or t.storage_offset() != expected or t.shape[1:] != first.shape[1:]:
            return torch.cat(list(tensors))
        expected += t.numel()
    rows = sum(len(t) for t in tensors)
    return first.new_empty(0).set_(storage, int(start), (rows, *first.shape[1:]))  # type: ignore[call-overload]


class RoundDriver(Protocol):
    """The run's side of a round, called by every backend adapter (FedML's sp loop, its MPI
    server, its cross-silo server, the batched engine): which clients train (the algorithm's
    keyed sampling), and what happens once the new global model exists (evaluation on the run's
    schedule, progress, checkpoints). The cross-silo server also records what only it sees
    (:class:`~fedml_perfedavg.silo.server.records.SiloRecords`)."""

    def sample_clients(self, round_idx: int) -> List[int]: ...

    def round_finished(self, round_idx: int, global_state: StateDict) -> None: ...

    def evaluates(self, round_idx: int) -> bool:
        """Whether the model after this round is evaluated (the run's schedule)."""

    def record_training(self, round_idx: int, client: int, figures: List[Any]) -> None:
        """A client's training figures [loss, accuracy] of ``round_idx`` from the process that
        trained it (an MPI worker, a silo)."""

    def record_failure(self, why: str) -> None:
        """Another process ends the run (a failing MPI rank): the run's record says so."""
