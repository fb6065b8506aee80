"""A batched engine's minibatches: a round's every client's three minibatches (LocalBatches) at once.

Where the algorithm draws its minibatches the standard way (the keyed draws of
:meth:`~fedml_perfedavg.algorithms.base.FederatedAlgorithm.client_batches`), every user's training
data is put in one tensor and a round's minibatches are one gather per role, at the same keyed
indices; else each client's own draws are stacked.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..algorithms.base import FederatedAlgorithm, private_round_batches
from ..core.client_maths import LocalBatches
from ..core.hand_batched import IndexedInputs
from ..core.private_draws import (
    PrivateBatches,
    RoundBuffers,
    gathered_norms_are_exact,
    squared_norms,
    stack_private,
)
from ..core.types import UserSplit, gather_inputs, one_block
from .plan import ClientPlan


def stack_batches(batches: Sequence[LocalBatches]) -> LocalBatches:
    """Stack per-client ``LocalBatches`` (or DP-SGD's :class:`PrivateBatches`) along a new
    leading client dimension."""
    if isinstance(batches[0], PrivateBatches):
        return stack_private(batches)
    return LocalBatches(*(torch.stack(tensors) for tensors in zip(*batches)))


class Minibatches:
    """The minibatches of ``algorithm``'s clients over ``users``' training data."""

    def __init__(self, algorithm: FederatedAlgorithm, users: Sequence[UserSplit], plan: "ClientPlan") -> None:
        self.algorithm, self.users = algorithm, users
        self.sample_counts = [len(u.train_y) for u in users]
        # Minibatches the client maths never reads are not gathered (the plan says which).
        self._roles_read = plan.roles_read
        self.gathers = plan.gathers_keyed_batches
        self._private_buffers = RoundBuffers()  # DP-SGD's draws, kept from round to round
        self._private_norms: Dict[int, Optional[Tensor]] = {}  # each user's inputs' squared norms
        if self.gathers:
            # Users that share their tensors (replicas of one user's data) share one copy here too.
            first: dict = {}
            xs, ys, self._offsets, total = [], [], [], 0
            for u in users:
                key = (id(u.train_x), id(u.train_y))
                if key not in first:
                    first[key] = total
                    xs.append(u.train_x)
                    ys.append(u.train_y)
                    total += len(u.train_y)
                self._offsets.append(first[key])
            # the users' tensors as one: where they are consecutive views of one block (the paper's
            # split, data/loading.py), that block itself; else a copy
            self._all_x, self._all_y = one_block(xs), one_block(ys)

    @property
    def training_data(self) -> Tuple[Tensor, Tensor]:
        """All users' training data, concatenated (x, y), where :attr:`gathers`."""
        return self._all_x, self._all_y

    def round_batches(self, round_idx: int, clients: List[int], lazy_inputs: bool = False) -> LocalBatches:
        """The round's minibatches, stacked (clients, steps, batch, ...); with ``lazy_inputs`` (for
        the hand-batched path and DP-SGD's chain) their inputs as :class:`IndexedInputs` where they
        are gathered, DP-SGD's as :class:`~fedml_perfedavg.core.private_draws.PrivateInputs`."""
        hooks = self.algorithm.hooks
        if not self.gathers:
            labels = [hooks.client_labels(round_idx, c, self.users[c].train_y) for c in clients]
            if self._draws_private_round():
                data = [(self.users[c].train_x, labels[position]) for position, c in enumerate(clients)]
                norms = self._input_norms(clients) if lazy_inputs else None
                return private_round_batches(  # type: ignore[return-value]
                    self.algorithm, round_idx, clients, data, self._each, self._private_buffers, lazy_inputs, norms
                )

            def draw(position: int) -> LocalBatches:
                c = clients[position]
                inputs = self.algorithm.inputs_for_draws(self.users[c].train_x)
                return self.algorithm.client_batches(round_idx, c, inputs, labels[position])

            return stack_batches(self._each(draw, len(clients)))
        batches = self.gather(self.batch_index(round_idx, clients), lazy_inputs=lazy_inputs)
        if hooks.poisons_labels:  # a label map commutes with the gather: flip each client's gathered rows
            batches = batches.with_labels(
                lambda labels: torch.stack(
                    [hooks.client_labels(round_idx, c, labels[i]) for i, c in enumerate(clients)]
                )
            )
        return batches

    def release_buffers(self) -> None:
        """Let go of the memory kept from round to round (DP-SGD's draws: 80 MB for the paper's
        round); a later round allocates it again."""
        self._private_buffers = RoundBuffers()

    def _input_norms(self, clients: Sequence[int]) -> Optional[List[Tensor]]:
        """Each client's samples' squared input norms, each user's computed once, where they are the
        chain's bits for every one of them
        (:func:`~fedml_perfedavg.core.private_draws.gathered_norms_are_exact`); else None."""
        for user in clients:
            if user not in self._private_norms:
                x = self.users[user].train_x
                self._private_norms[user] = squared_norms(x) if gathered_norms_are_exact(x) else None
        norms = [self._private_norms[user] for user in clients]
        return None if any(n is None for n in norms) else norms  # type: ignore[return-value]

    def _draws_private_round(self) -> bool:
        """Whether the round's DP-SGD draws are the keyed ones (:func:`private_round_batches`): the
        algorithm draws its minibatches the standard way."""
        return self.algorithm.settings.privacy is not None and self.algorithm.draws_keyed_batches()

    def _each(self, draw: Callable[[int], Any], count: int) -> List[Any]:
        """``draw`` of each client position, in order. DP-SGD's draws (a normal per parameter per
        use, most of a private round's time) are each client's own generator's, so they run on
        torch's threads side by side, the same numbers as one after the other; an algorithm's own
        ``client_batches`` runs one client at a time."""
        threads = min(torch.get_num_threads(), count)
        if not self._draws_private_round() or threads < 2:
            return [draw(position) for position in range(count)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(draw, range(count)))

    def batch_index(self, round_idx: int, clients: List[int]) -> List[Tensor]:
        """Per minibatch of LocalBatches (three), the round's sample indices into all users' data concatenated,
        ``(clients, steps, size)``: the algorithm's keyed indices."""
        per_client = self.algorithm.batch_indices(round_idx, clients, [self.sample_counts[c] for c in clients])
        offsets = torch.tensor([self._offsets[c] for c in clients]).view(-1, 1, 1)
        return [torch.stack([idx[role] for idx in per_client]) + offsets for role in range(len(per_client[0]))]

    def gather(
        self, index: List[Tensor], data: Optional[Tuple[Tensor, Tensor]] = None, lazy_inputs: bool = False
    ) -> LocalBatches:
        """The minibatches at ``index`` (one gather per role) from ``data`` (default: this run's
        users, concatenated). With ``lazy_inputs`` the inputs are :class:`IndexedInputs`, gathered
        by the hand-batched local update one step at a time, into cache, as it reaches them."""
        x, y = data if data is not None else (self._all_x, self._all_y)
        tensors: List[Any] = []
        for role, role_index in enumerate(index):
            if role not in self._roles_read:  # never read: D's tensors stand in
                tensors += tensors[:2]
                continue
            role_index = role_index.to(x.device)
            flat = role_index.reshape(-1)  # index_select: the rows of x[index], in half the time
            inputs = (
                IndexedInputs(x, role_index.transpose(0, 1).contiguous())
                if lazy_inputs
                else gather_inputs(x, flat).view(*role_index.shape, *x.shape[1:])
            )
            tensors += [inputs, y.index_select(0, flat).view(role_index.shape)]
        return LocalBatches(*tensors)
