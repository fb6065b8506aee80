"""The paper's non-i.i.d. partition of a labelled dataset over n users (Fallah et al., Sec. 5).

With n users and ``a`` images per class: users 0..n/2-1 hold ``a`` images of each of the
classes 0-4; users n/2..n-1 hold a/2 images of one class in 0-4 and 2a images of one class
in 5-9. In the "diff. hetero" variant the second-half users lose their a/2 images. Each
class of 0-4 and of 5-9 is given to the same number of second-half users (a balanced
assignment, shuffled by the seed), so the split never asks for more images of one class
than the dataset has.

``paper_resampled`` keeps the paper's per-user class counts but draws each user's images on its
own, from all of its classes' images (none twice within a user; users may share images): a
population larger than the dataset (tens of thousands of users of the paper's size), for
measuring scale rather than for the paper's figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from ..core.errors import ConfigError

PARTITIONS = ("paper", "paper_diff_hetero", "paper_resampled")
#: Partitions whose users draw their images independently of each other (users may share images).
RESAMPLED = ("paper_resampled",)
LOW_CLASSES = (0, 1, 2, 3, 4)
HIGH_CLASSES = (5, 6, 7, 8, 9)


@dataclass(frozen=True)
class UserPlan:
    """How many images of each class one user gets."""

    class_counts: Dict[int, int]

    @property
    def total(self) -> int:
        return sum(self.class_counts.values())


def plan_users(num_users: int, images_per_class: int, partition: str, seed: int) -> List[UserPlan]:
    """The per-user class counts of the paper's split (no data needed)."""
    if partition not in PARTITIONS:
        raise ConfigError(f"data_args.partition_method={partition!r} is not one of {PARTITIONS}")
    if num_users < 2 or num_users % 2:
        raise ConfigError(f"train_args.client_num_in_total={num_users!r}: the paper's split needs an even number >= 2")
    if images_per_class < 2 or images_per_class % 2:
        raise ConfigError(f"data_args.images_per_class={images_per_class!r}: must be an even number >= 2 (a/2 is used)")
    a, half = images_per_class, num_users // 2
    rng = np.random.default_rng([seed, 7])
    low = rng.permutation(np.resize(LOW_CLASSES, half))
    high = rng.permutation(np.resize(HIGH_CLASSES, half))
    plans = [UserPlan({c: a for c in LOW_CLASSES}) for _ in range(half)]
    for i in range(half):
        counts = {int(high[i]): 2 * a}
        if partition != "paper_diff_hetero":
            counts = {int(low[i]): a // 2, **counts}
        plans.append(UserPlan(counts))
    return plans


def partition_indices(
    labels: np.ndarray, plans: List[UserPlan], seed: int, key: str = "data_args.images_per_class"
) -> List[np.ndarray]:
    """Draw disjoint sample indices for each user's plan from ``labels``; ``key`` names the
    setting that sized the plans, for the error when the data holds too few images."""
    rng = np.random.default_rng([seed, 11])
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in range(int(labels.max()) + 1)}
    users = []
    for user_id, plan in enumerate(plans):
        chosen = []
        for cls, count in plan.class_counts.items():
            pool = pools.get(cls, [])
            if len(pool) < count:
                held = int((labels == cls).sum())
                raise ConfigError(
                    f"{key}: user {user_id} needs {count} images of class {cls} but the data holds {held} of "
                    f"that class for {len(plans)} users and only {len(pool)} are left; lower it"
                )
            chosen.extend(pool[:count])
            del pool[:count]
        users.append(np.sort(np.asarray(chosen, dtype=np.int64)))
    return users


def resampled_indices(labels: np.ndarray, plans: List[UserPlan], seed: int, key: str) -> List[np.ndarray]:
    """Each user's sample indices for its plan, drawn on its own (keyed by seed and user) from all
    the images of each of its classes: none twice within a user, any number of users."""
    pools = {c: np.flatnonzero(labels == c) for c in range(int(labels.max()) + 1)}
    users = []
    for user_id, plan in enumerate(plans):
        rng = np.random.default_rng([seed, 13, user_id])
        chosen = []
        for cls, count in plan.class_counts.items():
            pool = pools.get(cls, np.empty(0, dtype=np.int64))
            if len(pool) < count:
                raise ConfigError(
                    f"{key}: user {user_id} needs {count} images of class {cls} but the data holds "
                    f"{len(pool)}; lower it"
                )
            chosen.append(pool[rng.choice(len(pool), count, replace=False)])
        users.append(np.sort(np.concatenate(chosen)))
    return users
