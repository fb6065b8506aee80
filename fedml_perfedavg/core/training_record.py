"""Each round's training figures by client: the mean loss and accuracy of a client's local steps on
their minibatches D, at the iterate each step starts from (``core.client_maths.step_direction``:
the values of the gradient's own forward pass, so recording them costs no extra pass).

Wherever a client trains (the batched engine, FedML's sp loop, an MPI worker, a silo), its
algorithm object's record takes them; an MPI worker's and a silo's travel to the server with the
update; the server's :class:`~fedml_perfedavg.run.driver.RunDriver` takes the round's mean when
the round closes. What comes from another process is checked before it is kept."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

#: Rounds kept before the oldest is forgotten (a process that trains but never reports: a silo).
ROUNDS_KEPT = 4


def valid_figures(value: Any) -> bool:
    """Whether ``value`` is one client's figures as they travel: [loss, accuracy], the loss a finite
    number >= 0, the accuracy one in [0, 1] or None (a loss that has none)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return False
    loss, accuracy = value
    number = (int, float)
    if isinstance(loss, bool) or not isinstance(loss, number) or not math.isfinite(loss) or loss < 0:
        return False
    return accuracy is None or (
        not isinstance(accuracy, bool) and isinstance(accuracy, number) and 0.0 <= accuracy <= 1.0
    )


class TrainingRecord:
    """Round -> client -> (loss, accuracy or None); tensors are kept as computed (no device
    synchronisation while the round trains) and read when the round is taken or sent."""

    def __init__(self) -> None:
        self._rounds: Dict[int, Dict[int, Any]] = {}

    def _round(self, round_idx: int) -> Dict[int, Any]:
        for old in [r for r in self._rounds if r < round_idx - ROUNDS_KEPT]:
            del self._rounds[old]
        return self._rounds.setdefault(int(round_idx), {})

    def add(self, round_idx: int, clients: Sequence[int], figures: Tensor) -> None:
        """``figures`` (len(clients), 2) of ``clients``, trained in this process."""
        entries = self._round(round_idx)
        for position, client in enumerate(clients):
            entries[int(client)] = figures[position]

    def of(self, round_idx: int, clients: Sequence[int]) -> List[List[Any]]:
        """What this process sends of ``clients``: [client, loss, accuracy] for each that has finite
        figures (a client whose training diverged sends none)."""
        entries = self._rounds.get(int(round_idx), {})
        present = [int(c) for c in clients if int(c) in entries]
        pairs = _as_pairs([entries[c] for c in present])
        return [[client, *pair] for client, pair in zip(present, pairs) if pair is not None]

    def note(self, round_idx: int, client: int, figures: Any) -> None:
        """One client's figures as another process sent them, [loss, accuracy] (checked by the
        caller with :func:`valid_figures`)."""
        loss, accuracy = figures
        self._round(round_idx)[int(client)] = (float(loss), None if accuracy is None else float(accuracy))

    def take(self, round_idx: int) -> Optional[Dict[str, Any]]:
        """The round's record, forgotten here: the clients' mean loss and accuracy and how many
        clients they are, or None where no client of the round has finite figures."""
        entries = self._rounds.pop(int(round_idx), {})
        pairs = [pair for pair in _as_pairs(list(entries.values())) if pair is not None]
        if not pairs:
            return None
        accuracies = [a for _, a in pairs if a is not None]
        return {
            "round": int(round_idx),
            "train_loss": sum(loss for loss, _ in pairs) / len(pairs),
            "train_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
            "train_clients": len(pairs),
        }


def _as_pairs(entries: List[Any]) -> List[Optional[Tuple[float, Optional[float]]]]:
    """(loss, accuracy or None) of each entry (a tensor, or a pair another process sent), or None
    where its loss is not finite; the tensors are read in one transfer per device."""
    values: List[Any] = list(entries)
    by_device: Dict[Any, List[int]] = {}
    for position, entry in enumerate(entries):
        if isinstance(entry, Tensor):
            by_device.setdefault(entry.device, []).append(position)
    for positions in by_device.values():
        rows = torch.stack([entries[p].detach() for p in positions]).to("cpu", torch.float64).tolist()
        for position, row in zip(positions, rows):
            values[position] = row
    pairs: List[Optional[Tuple[float, Optional[float]]]] = []
    for loss, accuracy in values:
        if loss is None or not math.isfinite(loss):
            pairs.append(None)
        else:
            pairs.append((float(loss), None if accuracy is None or not math.isfinite(accuracy) else float(accuracy)))
    return pairs
