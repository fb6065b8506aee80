"""One organization's data as a folder of its own: what ``fedml-perfedavg export-split`` writes and
a silo in data-owner mode (``comm_args.silo_data: own``) reads.

    rank-R/silo.json           the manifest: format, rank, user, dataset, classes, shapes, counts, the
                               split it came from, the SHA-256 of the tensors file
    rank-R/data.safetensors    train_x, train_y, test_x, test_y (safetensors: arrays only, no pickle)

Silo rank R owns user R-1. The folder is self-contained: an organization can be handed it alone.
Reading it trusts nothing in it: the manifest is size-capped strict JSON checked field by field,
the tensors file must match the manifest's hash, names, dtypes, shapes and label range.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.errors import ConfigError
from ..core.types import UserSplit

FORMAT = "fedml-perfedavg silo data, version 1"
MANIFEST, TENSORS = "silo.json", "data.safetensors"
MAX_MANIFEST_BYTES = 1 << 20
ROLES = ("train_x", "train_y", "test_x", "test_y")
# The keys of a run's config that define a split (a folder made for another split is refused).
SPLIT_KEYS = (
    "dataset",
    "partition_method",
    "random_seed",
    "client_num_in_total",
    "images_per_class",
    "test_images_per_class",
)
INPUT_DTYPES = {  # the sample dtypes a folder or a silo's announcement may name
    "uint8": torch.uint8,  # images, scaled to [0, 1] where they are used (core/types.py: model_inputs)
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


def folder_of(root: str, rank: int) -> str:
    """Where rank ``rank``'s folder lies in an export."""
    return os.path.join(root, f"rank-{rank}")


def is_silo_folder(path: str) -> bool:
    """True when ``path`` holds a silo's folder (its manifest)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def is_export(path: str) -> bool:
    """True when ``path`` holds an export (rank-1/ at least)."""
    return is_silo_folder(folder_of(path, 1))


@dataclass(frozen=True)
class SiloData:
    """A silo's own user: its data, its id (= rank - 1), and what the manifest says of it."""

    user: UserSplit
    user_id: int
    rank: int
    dataset: str
    num_classes: int
    input_shape: Tuple[int, ...]
    split: Dict[str, Any]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_silo_folder(
    folder: str, user: UserSplit, rank: int, dataset: str, num_classes: int, split: Dict[str, Any]
) -> None:
    """Rank ``rank``'s folder (user ``rank - 1``): the tensors, then the manifest that names
    their hash (a folder without a manifest is not a silo's folder: a write cut short shows)."""
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank {rank}: silos are ranks 1..n")
    os.makedirs(folder, exist_ok=True)
    tensors = {role: t.detach().cpu().contiguous().clone() for role, t in zip(ROLES, user)}  # no shared storage
    path = os.path.join(folder, TENSORS)
    save_file(tensors, path + ".tmp")
    os.replace(path + ".tmp", path)
    classes = sorted(set(user.train_y.tolist()) | set(user.test_y.tolist()))
    manifest = {
        "format": FORMAT,
        "rank": rank,
        "user": rank - 1,
        "dataset": dataset,
        "num_classes": num_classes,
        "input_shape": list(user.train_x.shape[1:]),
        "input_dtype": str(user.train_x.dtype).split(".")[-1],
        "train": len(user.train_y),
        "test": len(user.test_y),
        "classes": classes,
        "split": split,
        "sha256": _sha256(path),
    }
    with open(os.path.join(folder, MANIFEST + ".tmp"), "w") as stream:
        json.dump(manifest, stream, indent=2, allow_nan=False)
    os.replace(os.path.join(folder, MANIFEST + ".tmp"), os.path.join(folder, MANIFEST))


def _fail(folder: str, problem: str) -> ConfigError:
    return ConfigError(
        f"data_args.data_cache_dir={folder!r}: {problem}; export the split again "
        f"(fedml-perfedavg export-split --cf CONFIG --out DIR) and give this silo its DIR/rank-R"
    )


def _whole(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**31


def _read_manifest(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise _fail(folder, f"cannot read {MANIFEST} ({err.strerror})") from None
    if size > MAX_MANIFEST_BYTES:
        raise _fail(folder, f"{MANIFEST} is {size} bytes, more than a manifest can be ({MAX_MANIFEST_BYTES})")
    try:
        with open(path, "rb") as stream:
            manifest = json.loads(stream.read().decode("utf-8"), parse_constant=lambda name: None)
    except OSError as err:
        raise _fail(folder, f"cannot read {MANIFEST} ({err.strerror})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _fail(folder, f"{MANIFEST} is not JSON ({type(err).__name__})") from None
    expected = {
        "format",
        "rank",
        "user",
        "dataset",
        "num_classes",
        "input_shape",
        "input_dtype",
        "train",
        "test",
        "classes",
        "split",
        "sha256",
    }
    if not isinstance(manifest, dict) or set(manifest) != expected:
        raise _fail(folder, f"{MANIFEST} must hold exactly {sorted(expected)}")
    if manifest["format"] != FORMAT:
        raise _fail(folder, f"{MANIFEST} is of format {str(manifest['format'])[:60]!r}, not {FORMAT!r}")
    checks = {
        "rank": _whole(manifest["rank"], 1),
        "user": _whole(manifest["user"]),
        "num_classes": _whole(manifest["num_classes"], 1),
        "train": _whole(manifest["train"], 1),
        "test": _whole(manifest["test"], 1),
        "dataset": isinstance(manifest["dataset"], str) and 0 < len(manifest["dataset"]) <= 64,
        "input_shape": isinstance(manifest["input_shape"], list)
        and len(manifest["input_shape"]) <= 8
        and all(_whole(d, 1) for d in manifest["input_shape"]),
        "input_dtype": manifest["input_dtype"] in INPUT_DTYPES,
        "classes": isinstance(manifest["classes"], list)
        and 0 < len(manifest["classes"]) <= 100_000
        and all(_whole(c) for c in manifest["classes"]),
        "split": isinstance(manifest["split"], dict) and set(manifest["split"]) <= set(SPLIT_KEYS),
        "sha256": isinstance(manifest["sha256"], str) and len(manifest["sha256"]) == 64,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise _fail(folder, f"{MANIFEST} has fields of the wrong type or range: {bad}")
    if manifest["user"] != manifest["rank"] - 1:
        raise _fail(
            folder, f"{MANIFEST} says rank {manifest['rank']} holds user {manifest['user']}; rank R holds user R-1"
        )
    return manifest


def read_silo_folder(folder: str) -> SiloData:
    """The user in ``folder``, checked against its manifest (see the module doc)."""
    from safetensors.torch import load_file

    manifest = _read_manifest(folder)
    path = os.path.join(folder, TENSORS)
    if not os.path.isfile(path):
        raise _fail(folder, f"{TENSORS} is missing")
    if _sha256(path) != manifest["sha256"]:
        raise _fail(folder, f"{TENSORS} does not match the hash in {MANIFEST} (changed or damaged)")
    try:
        tensors = load_file(path)
    except Exception as err:  # noqa: BLE001 - safetensors' own error types for bad bytes
        raise _fail(folder, f"{TENSORS} is not a safetensors file ({type(err).__name__})") from None
    if set(tensors) != set(ROLES):
        raise _fail(folder, f"{TENSORS} must hold exactly {list(ROLES)}")
    shape, dtype = tuple(manifest["input_shape"]), INPUT_DTYPES[manifest["input_dtype"]]
    for side, count in (("train", manifest["train"]), ("test", manifest["test"])):
        x, y = tensors[f"{side}_x"], tensors[f"{side}_y"]
        if tuple(x.shape) != (count, *shape) or x.dtype != dtype:
            raise _fail(folder, f"{side}_x is {tuple(x.shape)} {x.dtype}, the manifest says {(count, *shape)} {dtype}")
        if tuple(y.shape) != (count,) or y.dtype != torch.int64:
            raise _fail(folder, f"{side}_y is {tuple(y.shape)} {y.dtype}, the manifest says ({count},) int64")
        if count and (int(y.min()) < 0 or int(y.max()) >= manifest["num_classes"]):
            raise _fail(folder, f"{side}_y holds labels outside 0..{manifest['num_classes'] - 1}")
        if x.is_floating_point() and not bool(torch.isfinite(x).all()):
            # the hash says the file is the one the manifest names, not that what it holds can train
            bad = int((~torch.isfinite(x)).sum())
            raise _fail(folder, f"{side}_x holds {bad} non-finite value(s) (NaN or infinity), whatever its hash says")
    user = UserSplit(*(tensors[role] for role in ROLES))
    return SiloData(
        user,
        manifest["user"],
        manifest["rank"],
        manifest["dataset"],
        manifest["num_classes"],
        shape,
        dict(manifest["split"]),
    )


def check_split(silo: SiloData, config_split: Dict[str, Any], folder: str) -> None:
    """A folder made for another split (another seed, another number of users, ...) than the run's
    is refused, naming the key and both values."""
    for key in SPLIT_KEYS:
        if key in silo.split and key in config_split and silo.split[key] != config_split[key]:
            raise _fail(
                folder, f"it was exported for {key}={silo.split[key]!r}; this run has {key}={config_split[key]!r}"
            )


def export_users(
    out_dir: str,
    users: Sequence[UserSplit],
    dataset: str,
    num_classes: int,
    split: Dict[str, Any],
    ranks: Optional[Sequence[int]] = None,
) -> List[str]:
    """``out_dir/rank-R/`` for user R-1 of ``users`` (every user, or ``ranks``); returns the folders."""
    chosen = list(ranks) if ranks is not None else list(range(1, len(users) + 1))
    folders = []
    for rank in chosen:
        folder = folder_of(out_dir, rank)
        write_silo_folder(folder, users[rank - 1], rank, dataset, num_classes, split)
        folders.append(folder)
    return folders
