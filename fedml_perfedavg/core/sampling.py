"""Randomness that depends only on (seed, round, client, purpose), never on process layout.

Client sampling and every minibatch are drawn from generators keyed this way, so the
single-process, MPI and cross-silo runs of one config draw the same numbers.
"""

from __future__ import annotations

import contextlib
import random
from enum import IntEnum
from typing import Iterable, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .client_maths import LocalBatches
from .types import model_inputs


class Purpose(IntEnum):
    CLIENT_SAMPLING = 0
    LOCAL_TRAINING = 1
    EVALUATION = 2
    INITIALISATION = 3
    HOLD_OUT = 4
    RANDOM_ITERATE = 5
    # Draws made by code that uses the global generators (FedML's DP mechanisms, attacks and
    # defenses), run inside :func:`keyed_global_randomness`.
    LOCAL_PRIVACY = 6
    CENTRAL_PRIVACY = 7
    ATTACK = 8
    DEFENSE = 9
    # DP-SGD's Poisson minibatches and noise (fedml_perfedavg.core.private_draws): training, evaluation.
    PRIVATE_TRAINING = 10
    PRIVATE_EVALUATION = 11


def _key(seed: int, round_idx: int, client_id: int, purpose: Purpose, secret: Optional[bytes] = None) -> int:
    words = [int(seed), int(round_idx) + 1, int(client_id) + 1, int(purpose)]
    if secret is not None:  # a party's own secret: nobody without it can predict these draws
        words += np.frombuffer(secret, dtype="<u4").tolist()
    entropy = np.random.SeedSequence(words)
    return int(entropy.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def generator_for(
    seed: int, round_idx: int, client_id: int, purpose: Purpose, secret: Optional[bytes] = None
) -> torch.Generator:
    """A CPU torch generator seeded from the key (seed, round, client, purpose), and ``secret``
    (a multiple of 4 bytes) where the draws must be the holder's alone (a data owner's DP noise)."""
    generator = torch.Generator()
    generator.manual_seed(_key(seed, round_idx, client_id, purpose, secret))
    return generator


@contextlib.contextmanager
def keyed_global_randomness(seed: int, round_idx: int, client_id: int, purpose: Purpose) -> Iterator[None]:
    """Run code that draws from the global generators (torch's CPU generator, numpy's, Python's
    ``random``) with all three seeded from the key, and restore them afterwards: FedML's DP
    mechanisms and attacks draw that way, and keyed they draw the same on every backend."""
    key = _key(seed, round_idx, client_id, purpose)
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(key)  # the CPU generator alone, as fork_rng saved
        np.random.seed(key % (2**32))
        random.seed(key)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def held_out_users(seed: int, client_num_in_total: int, new_user_fraction: float) -> List[int]:
    """The users kept out of training to measure how the model suits new users (sorted)."""
    count = int(round(new_user_fraction * client_num_in_total))
    if count == 0:
        return []
    generator = generator_for(seed, -1, -1, Purpose.HOLD_OUT)
    return sorted(torch.randperm(client_num_in_total, generator=generator)[:count].tolist())


def sample_clients(
    seed: int, round_idx: int, client_num_in_total: int, client_num_per_round: int, new_user_fraction: float = 0.0
) -> List[int]:
    """Uniformly sample ``client_num_per_round`` distinct training users for a round, sorted.

    Users held out by ``new_user_fraction`` are never sampled."""
    excluded = set(held_out_users(seed, client_num_in_total, new_user_fraction))
    pool = [c for c in range(client_num_in_total) if c not in excluded]
    if client_num_per_round >= len(pool):
        return pool
    generator = generator_for(seed, round_idx, -1, Purpose.CLIENT_SAMPLING)
    chosen = torch.randperm(len(pool), generator=generator)[:client_num_per_round]
    return sorted(pool[i] for i in chosen.tolist())


def keyed_order(
    seed: int, round_idx: int, client_num_in_total: int, client_num_per_round: int, new_user_fraction: float = 0.0
) -> List[int]:
    """Every training user in the round's keyed order: its first ``client_num_per_round`` are
    :func:`sample_clients`'s (same key, same permutation), the rest follow in the order that takes a
    lost one's place (cross-silo secure rounds: ``secagg_args.reserve_silos``)."""
    excluded = set(held_out_users(seed, client_num_in_total, new_user_fraction))
    pool = [c for c in range(client_num_in_total) if c not in excluded]
    if client_num_per_round >= len(pool):
        return pool
    generator = generator_for(seed, round_idx, -1, Purpose.CLIENT_SAMPLING)
    return [pool[i] for i in torch.randperm(len(pool), generator=generator).tolist()]


def with_reserves(order: Sequence[int], count: int, lost: Iterable[int], reserves: int) -> List[int]:
    """The round's users (sorted) when ``lost`` users cannot take part: the keyed ``order``'s first
    ``count``, each lost one's place taken by the next user of the order that is not lost, within
    the first ``count + reserves``."""
    gone = set(lost)
    return sorted([u for u in order[: count + reserves] if u not in gone][:count])


def reserve_problem(order: Sequence[int], count: int, reserves: int, users: Sequence[int]) -> Optional[str]:
    """Why ``users`` cannot be a round's users under :func:`with_reserves` (None: they can): at most
    ``count`` distinct users, all among the keyed order's first ``count + reserves``."""
    allowed = list(order[: count + reserves])
    if len(set(users)) != len(users) or len(users) > count or not set(users) <= set(allowed):
        return (
            f"{sorted(users)} is not the keyed sample with lost users replaced: at most {count} of the round's "
            f"keyed order's first {count} + secagg_args.reserve_silos={reserves} ({sorted(allowed)})"
        )
    return None


def random_iterate_step(seed: int, round_idx: int, local_steps: int) -> int:
    """t_k, uniform on 0..local_steps-1: the local step whose iterates the server averages in
    the paper's remark after Theorem 4.5 (keyed by (seed, round))."""
    generator = generator_for(seed, round_idx, -1, Purpose.RANDOM_ITERATE)
    return int(torch.randint(local_steps, (1,), generator=generator))


def batch_indices(num_samples: int, steps: int, batch_sizes: Sequence[int], generator: torch.Generator) -> List[Tensor]:
    """For each batch size, a ``(steps, size)`` index tensor; each row is drawn without
    replacement and independently of every other row and batch role."""
    return batch_indices_of_many([num_samples], steps, batch_sizes, [generator])[0]


def batch_indices_of_many(
    num_samples: Sequence[int], steps: int, batch_sizes: Sequence[int], generators: Sequence[torch.Generator]
) -> List[List[Tensor]]:
    """:func:`batch_indices` of several clients (their sample counts and generators), the same
    numbers: each client's keys come from its own generator, and the selection runs once for all
    clients of one size (topk treats each row alike, ties included, however many rows it has)."""
    largest = max(batch_sizes)
    for count in num_samples:
        if largest > count:
            raise ValueError(f"batch size {largest} is larger than the client's {count} training samples")
    # The positions of the `largest` smallest of i.i.d. uniform keys are a uniformly random
    # ordered subset: steps * roles independent draws without replacement per client.
    keys = [
        torch.rand(steps, len(batch_sizes), count, generator=generator)
        for count, generator in zip(num_samples, generators)
    ]
    by_size: dict = {}
    for position, count in enumerate(num_samples):
        by_size.setdefault(count, []).append(position)
    chosen: List[Tensor] = [torch.empty(0)] * len(keys)
    for members in by_size.values():
        together = keys[members[0]].unsqueeze(0) if len(members) == 1 else torch.stack([keys[p] for p in members])
        picked = together.topk(largest, dim=-1, largest=False).indices
        for row, position in enumerate(members):
            chosen[position] = picked[row]
    return [[indices[:, role, :size] for role, size in enumerate(batch_sizes)] for indices in chosen]


def sample_local_batches(
    x: Tensor, y: Tensor, steps: int, batch_sizes: Sequence[int], generator: torch.Generator
) -> LocalBatches:
    """Three independent minibatches (:class:`LocalBatches`) for each of ``steps`` local steps."""
    adapt, meta, hessian = batch_indices(len(y), steps, batch_sizes, generator)
    index = lambda idx: (model_inputs(x[idx.to(x.device)]), y[idx.to(y.device)])  # noqa: E731
    return LocalBatches(*index(adapt), *index(meta), *index(hessian))
