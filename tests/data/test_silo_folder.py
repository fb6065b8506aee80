"""An organization's own folder: written whole, read back bit for bit, and refused, naming the
problem, when it was changed, damaged, made for another split, or is another rank's."""

import json

import pytest
import torch

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.data.silo_folder import (
    MANIFEST,
    TENSORS,
    check_split,
    export_users,
    folder_of,
    is_export,
    is_silo_folder,
    read_silo_folder,
)

SPLIT = {
    "dataset": "mnist",
    "partition_method": "paper",
    "random_seed": 0,
    "client_num_in_total": 2,
    "images_per_class": None,
    "test_images_per_class": None,
}


def _users():
    g = torch.Generator().manual_seed(0)
    return [
        UserSplit(
            torch.rand(6, 1, 28, 28, generator=g),
            torch.tensor([0, 1, 2, 0, 1, 2]),
            torch.rand(3, 1, 28, 28, generator=g),
            torch.tensor([2, 1, 0]),
        )
        for _ in range(2)
    ]


@pytest.fixture
def export(tmp_path):
    users = _users()
    export_users(str(tmp_path / "x"), users, "mnist", 10, SPLIT)
    return tmp_path / "x", users


def test_a_folder_reads_back_bit_for_bit(export):
    root, users = export
    assert is_export(str(root)) and is_silo_folder(folder_of(str(root), 2))
    silo = read_silo_folder(folder_of(str(root), 2))
    assert (silo.rank, silo.user_id, silo.dataset, silo.num_classes, silo.input_shape) == (
        2,
        1,
        "mnist",
        10,
        (1, 28, 28),
    )
    for got, sent in zip(silo.user, users[1]):
        assert torch.equal(got, sent) and got.dtype == sent.dtype


def _edit_manifest(folder, **changes):
    path = folder / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda f: (f / TENSORS).write_bytes((f / TENSORS).read_bytes()[:-8] + b"\x00" * 8), "does not match the hash"),
        (lambda f: (f / MANIFEST).write_text("[" * 5000), "not JSON"),
        (lambda f: (f / MANIFEST).write_text(" " * (2 << 20)), "more than a manifest can be"),
        (lambda f: _edit_manifest(f, train=1e300), "wrong type or range: ['train']"),
        (lambda f: _edit_manifest(f, user=0), "says rank 2 holds user 0; rank R holds user R-1"),
        (lambda f: _edit_manifest(f, format="pickle"), "of format 'pickle'"),
        (lambda f: _edit_manifest(f, evil=1), "must hold exactly"),
        (lambda f: (f / TENSORS).unlink(), f"{TENSORS} is missing"),
    ],
)
def test_a_changed_or_damaged_folder_is_refused_naming_the_problem(export, change, words):
    root, _ = export
    folder = root / "rank-2"
    change(folder)
    with pytest.raises(ConfigError) as err:
        read_silo_folder(str(folder))
    assert words in str(err.value) and "export-split" in str(err.value)


def test_a_folder_of_another_split_is_refused_naming_the_key(export):
    root, _ = export
    silo = read_silo_folder(folder_of(str(root), 1))
    check_split(silo, SPLIT, "f")
    with pytest.raises(ConfigError, match="it was exported for random_seed=0; this run has random_seed=1"):
        check_split(silo, {**SPLIT, "random_seed": 1}, "f")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_inputs_with_a_rewritten_hash_are_refused(tmp_path, value):
    """Issue 44: a folder whose content was changed and its sha256 rewritten still cannot train."""
    users = _users()
    users[1].train_x[3, 0, 5, 5] = value
    export_users(str(tmp_path / "x"), users, "mnist", 10, SPLIT)  # a consistent folder: hash of the bad content
    with pytest.raises(
        ConfigError, match=r"train_x holds 1 non-finite value\(s\) \(NaN or infinity\), whatever its hash"
    ):
        read_silo_folder(folder_of(str(tmp_path / "x"), 2))
    read_silo_folder(folder_of(str(tmp_path / "x"), 1))  # the other user's folder is fine
