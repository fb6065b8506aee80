"""Loading MNIST / CIFAR-10 in torchvision's layout and splitting them over users as in the paper.

MNIST's four raw files are read here (the IDX format is a few bytes of header and the pixels): the
same bytes torchvision would give, without importing torchvision, which imports torch._dynamo and
costs every process of a run about 0.9 s of CPU (issue 54). torchvision reads CIFAR-10 (with its
checksums) and fetches either dataset when ``data_args.download`` asks for it."""

from __future__ import annotations

import difflib
import itertools
import logging
import math
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..core.errors import ConfigError
from ..core.types import UserSplit
from .partition import RESAMPLED, UserPlan, partition_indices, plan_users, resampled_indices

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetSpec:
    images_per_class: int  # the paper's ``a``
    input_shape: Tuple[int, int, int]
    num_classes: int
    expected_files: str  # where torchvision looks, relative to data_cache_dir
    train_class_counts: Tuple[int, ...]  # images per class in the published training set
    test_class_counts: Tuple[int, ...]


DATASETS: Dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        196,
        (1, 28, 28),
        10,
        "MNIST/raw/",
        (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
        (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
    ),
    "cifar10": DatasetSpec(68, (3, 32, 32), 10, "cifar-10-batches-py/", (5000,) * 10, (1000,) * 10),
}


@dataclass
class FederatedData:
    """Users' train/test tensors, plus what FedML needs to see them. ``user_ids`` names them
    where they are not users 0..n-1 (a silo holds its own user alone; the server of a
    data-owner run holds none)."""

    users: List[UserSplit]
    num_classes: int
    input_shape: Tuple[int, ...]
    user_ids: Optional[List[int]] = None

    @property
    def ids(self) -> List[int]:
        return list(range(len(self.users))) if self.user_ids is None else list(self.user_ids)

    def to(self, device: torch.device) -> "FederatedData":
        users = [UserSplit(*(t.to(device) for t in u)) for u in self.users]
        return FederatedData(users, self.num_classes, self.input_shape, self.user_ids)

    def describe(self) -> List[Dict[int, Tuple[int, int]]]:
        """Per user, {class: (train count, test count)}."""
        out = []
        for u in self.users:
            classes = sorted(set(u.train_y.tolist()) | set(u.test_y.tolist()))
            out.append({c: (int((u.train_y == c).sum()), int((u.test_y == c).sum())) for c in classes})
        return out


def default_test_images_per_class(images_per_class: int, train_size: int, test_size: int) -> int:
    """Test ``a``: the train ``a`` scaled by the test/train size ratio, rounded down to even."""
    return max(2, 2 * int(images_per_class * test_size / train_size / 2))


def check_paper_split(
    dataset: str,
    num_users: int,
    images_per_class: Optional[int],
    test_images_per_class: Optional[int],
    partition: str,
    seed: int,
) -> Tuple[int, int]:
    """The paper's split of ``dataset`` over ``num_users``, planned without the data: an even
    number of users, and enough images of each class in the training and test sets. Returns (the
    smallest user's training samples, the train ``a`` used); :class:`ConfigError` naming the key."""
    if dataset not in DATASETS:
        close = difflib.get_close_matches(str(dataset).lower(), list(DATASETS), n=1, cutoff=0.75)
        raise ConfigError(
            f"data_args.dataset={dataset!r}: the paper's split (data_args.partition_method={partition!r}) is "
            f"defined for {list(DATASETS)}" + (f"; did you mean {close[0]!r}?" if close else "")
        )
    if num_users < 2 or num_users % 2:
        raise ConfigError(
            f"train_args.client_num_in_total={num_users!r}: the paper's split "
            f"(data_args.partition_method={partition!r}) needs an even number >= 2"
        )
    spec = DATASETS[dataset]
    a = images_per_class or spec.images_per_class
    a_test = test_images_per_class or default_test_images_per_class(
        a, sum(spec.train_class_counts), sum(spec.test_class_counts)
    )
    for key, count, available in (
        ("images_per_class", a, spec.train_class_counts),
        ("test_images_per_class", a_test, spec.test_class_counts),
    ):
        plans = plan_users(num_users, count, partition, seed)
        resampled = partition in RESAMPLED  # each user draws on its own: one user's need, not all users'
        who, or_users = ("a user", "") if resampled else (f"{num_users} users", " or train_args.client_num_in_total")
        for cls, have in enumerate(available):
            counts = [p.class_counts.get(cls, 0) for p in plans]
            need = max(counts) if resampled else sum(counts)
            if need > have:
                raise ConfigError(
                    f"data_args.{key}={count!r}: {who} would need {need} images of class {cls}, but "
                    f"{dataset}'s {'training' if key == 'images_per_class' else 'test'} set has {have}; "
                    f"lower it{or_users}"
                )
    return min(p.total for p in plan_users(num_users, a, partition, seed)), a


def failing_checksum(cls: Any, root: str) -> List[str]:
    """The files of a torchvision dataset with published checksums (CIFAR's ``train_list`` and
    ``test_list``) that are present but fail their MD5."""
    import torchvision.datasets.cifar as cifar

    folder = os.path.join(root, getattr(cls, "base_folder", ""))
    files = [*getattr(cls, "train_list", []), *getattr(cls, "test_list", [])]
    return [
        name
        for name, md5 in files
        if os.path.isfile(os.path.join(folder, name)) and not cifar.check_integrity(os.path.join(folder, name), md5)
    ]


MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: str, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes with ``ndim`` dimensions (MNIST's: the bytes 0, 0, 8, ndim,
    then each dimension as a big-endian 32-bit count, then the data); ValueError if it is not one."""
    with open(path, "rb") as f:
        data = bytearray(f.read())  # writable, as torch.as_tensor wants
    start = 4 + 4 * ndim
    if len(data) < start or data[:4] != bytes([0, 0, 8, ndim]):
        raise ValueError(f"{os.path.basename(path)} does not start as an IDX file of {ndim} dimensions")
    dims = struct.unpack(f">{ndim}I", data[4:start])
    if len(data) - start != math.prod(dims):
        raise ValueError(f"{os.path.basename(path)} holds {len(data) - start} bytes of data; its header says {dims}")
    return np.frombuffer(data, dtype=np.uint8, offset=start).reshape(dims)


def _mnist_raw(root: str, train: bool) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """MNIST's images (N, 28, 28) and labels from its raw files under ``root``/MNIST/raw, where
    torchvision keeps them; None if one is missing (torchvision then fetches or names them)."""
    paths = [os.path.join(root, DATASETS["mnist"].expected_files, name) for name in MNIST_FILES[train]]
    if not all(os.path.isfile(path) for path in paths):
        return None
    images, labels = read_idx(paths[0], 3), read_idx(paths[1], 1)
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    return images, labels


def load_torchvision(dataset: str, root: str, download: bool) -> Tuple[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor]]:
    """((train_x, train_y), (test_x, test_y)): the images as stored, uint8 (N, C, H, W), scaled to
    [0, 1] where they are used (core/types.py: ``model_inputs``); class labels int64."""
    if dataset not in DATASETS:
        raise ConfigError(f"data_args.dataset={dataset!r} is not one of {sorted(DATASETS)}")
    splits = []
    expected = os.path.join(os.path.abspath(root), DATASETS[dataset].expected_files)
    for train in (True, False):
        try:
            raw = _mnist_raw(root, train) if dataset == "mnist" else None
            ds = _torchvision_dataset(dataset, root, train, download) if raw is None else _Arrays(*raw)
        except RuntimeError as err:
            damaged = failing_checksum(_torchvision_class(dataset), root)
            if damaged:  # torchvision says "not found or corrupted" for both
                raise ConfigError(
                    f"{dataset} under {expected}: {damaged} are there but fail torchvision's MD5 "
                    f"checksum (damaged, or not the python version of {dataset}): replace them "
                    f"(data_args.data_cache_dir={root!r})"
                ) from None
            if "not found" not in str(err).lower() and "download=true" not in str(err).lower():
                raise ConfigError(
                    f"{dataset} under {expected} cannot be read ({err}); the files may be damaged: "
                    f"replace them (data_args.data_cache_dir={root!r})"
                ) from None
            raise FileNotFoundError(
                f"{dataset} not found: expected its files under {expected} "
                f"(data_args.data_cache_dir={root!r}, data_args.download={download}). "
                f"Set data_args.download: true to fetch it, or point data_args.data_cache_dir at a copy. ({err})"
            ) from None
        except (AssertionError, ValueError, EOFError, OSError, pickle.UnpicklingError) as err:
            # torchvision asserts on an IDX file's magic number and size; CIFAR's batches are pickles
            raise ConfigError(
                f"{dataset} under {expected} is damaged or not {dataset} "
                f"({type(err).__name__}: {err or 'a file has the wrong header or size'}); replace "
                f"the files (data_args.data_cache_dir={root!r})"
            ) from None
        labels = torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)
        classes = DATASETS[dataset].num_classes
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
            raise ConfigError(
                f"{dataset} under {expected}: the {'training' if train else 'test'} labels hold "
                f"{int(labels.min())}..{int(labels.max())}, outside the {classes} classes 0..{classes - 1}; "
                f"the labels file is damaged or not {dataset}'s"
            )
        data = torch.as_tensor(np.asarray(ds.data))
        if data.ndim == 3:  # MNIST: (N, H, W)
            data = data.unsqueeze(1)
        else:  # CIFAR: (N, H, W, C)
            data = data.permute(0, 3, 1, 2)
        splits.append((data.contiguous(), labels))
    return splits[0], splits[1]


@dataclass(frozen=True)
class _Arrays:
    """A dataset read here, with the two attributes read of torchvision's."""

    data: np.ndarray
    targets: np.ndarray


def _torchvision_class(dataset: str) -> Any:
    from .torchvision_ops import make_torchvision_importable

    make_torchvision_importable()
    import torchvision

    return {"mnist": torchvision.datasets.MNIST, "cifar10": torchvision.datasets.CIFAR10}[dataset]


def _torchvision_dataset(dataset: str, root: str, train: bool, download: bool) -> Any:
    return _torchvision_class(dataset)(root=root, train=train, download=download)


def split_over_users(
    train: Tuple[Tensor, Tensor],
    test: Tuple[Tensor, Tensor],
    num_users: int,
    images_per_class: int,
    test_images_per_class: int,
    partition: str,
    seed: int,
) -> List[UserSplit]:
    """Apply the paper's partition to a train and a test set (same classes per user)."""
    train_plans: List[UserPlan] = plan_users(num_users, images_per_class, partition, seed)
    test_plans = plan_users(num_users, test_images_per_class, partition, seed)
    draw = resampled_indices if partition in RESAMPLED else partition_indices
    train_idx = draw(train[1].numpy(), train_plans, seed, f"data_args.images_per_class={images_per_class}")
    test_idx = draw(test[1].numpy(), test_plans, seed + 1, f"data_args.test_images_per_class={test_images_per_class}")
    # each user's tensors are consecutive views of one gather per split: the batched engine reads all
    # users' training data as one tensor, which is then this block itself, not a second copy of it
    train_rows, test_rows = [torch.as_tensor(i) for i in train_idx], [torch.as_tensor(i) for i in test_idx]
    train_x, train_y = (t[torch.cat(train_rows)] for t in train)
    test_x, test_y = (t[torch.cat(test_rows)] for t in test)
    train_at = [0, *itertools.accumulate(len(r) for r in train_rows)]
    test_at = [0, *itertools.accumulate(len(r) for r in test_rows)]
    return [
        UserSplit(train_x[a:b], train_y[a:b], test_x[c:d], test_y[c:d])
        for a, b, c, d in zip(train_at, train_at[1:], test_at, test_at[1:])
    ]


def load_federated(
    dataset: str,
    root: str,
    num_users: int,
    partition: str,
    seed: int,
    download: bool = False,
    images_per_class: Optional[int] = None,
    test_images_per_class: Optional[int] = None,
) -> FederatedData:
    """Load ``dataset`` and split it over ``num_users`` users with the paper's partition."""
    spec = DATASETS.get(dataset)
    if spec is None:
        raise ConfigError(f"data_args.dataset={dataset!r} is not one of {sorted(DATASETS)}")
    train, test = load_torchvision(dataset, root, download)
    a = images_per_class or spec.images_per_class
    a_test = test_images_per_class or default_test_images_per_class(a, len(train[1]), len(test[1]))
    users = split_over_users(train, test, num_users, a, a_test, partition, seed)
    logger.info("%s split over %d users (a=%d, test a=%d, %s)", dataset, num_users, a, a_test, partition)
    return FederatedData(users, spec.num_classes, spec.input_shape)
