"""Each client's own state from one of its rounds to its next (an algorithm that declares
``keeps_client_state``), by client id. It stays with whoever holds the client: the algorithm
object in a single process; in FedML's MPI simulation the server, which sends a client's state
with its assignment and takes it back with its update (fedml_bridge/mpi.py); in data-owner
cross-silo the client's own silo, whose process trains that client alone (no other party ever
sees it)."""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional

import torch
from torch import Tensor

from ..core.types import StateDict


def _checked(client: object, state: object) -> Dict[str, Tensor]:
    """A client's state as received from another process: a dict of tensors under an int id."""
    if not isinstance(client, int) or isinstance(client, bool):
        raise ValueError(f"a client state's client id is {client!r}, not an int")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ValueError(f"client {client}'s state is not a dict of named tensors: {type(state).__name__}")
    return dict(state)


class ClientStates:
    """Clients' own states by id (an algorithm's ``client_states``)."""

    def __init__(self) -> None:
        self._states: Dict[int, Dict[str, Tensor]] = {}

    def get(self, client: int) -> Optional[Dict[str, Tensor]]:
        """Client ``client``'s state, or None before its first round."""
        return self._states.get(int(client))

    def put(self, client: int, state: StateDict) -> None:
        self._states[int(client)] = {k: v.detach() for k, v in state.items()}

    def of(self, clients: Iterable[int]) -> Dict[int, Dict[str, Tensor]]:
        """The states of ``clients`` that have one (what is sent with their assignment)."""
        return {int(c): self._states[int(c)] for c in clients if int(c) in self._states}

    def update(self, states: Mapping[int, StateDict]) -> None:
        """Take the states another process sends (checked: ids and tensors)."""
        for client, state in states.items():
            self._states[client] = _checked(client, state)

    def __len__(self) -> int:
        return len(self._states)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        """Every client's state, on the CPU, for a checkpoint."""
        return {c: {k: v.detach().cpu().clone() for k, v in s.items()} for c, s in sorted(self._states.items())}

    def load_state_dict(self, states: Mapping[int, StateDict], device: Optional[torch.device] = None) -> None:
        self._states = {}
        for client, state in states.items():
            self._states[client] = {k: v.to(device) if device else v for k, v in _checked(client, state).items()}
