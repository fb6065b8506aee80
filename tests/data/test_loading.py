"""MNIST read from its raw files here: torchvision's bytes, without importing torchvision."""

import subprocess
import sys

import pytest
import torch

from fedml_perfedavg.core.types import model_inputs
from fedml_perfedavg.data import loading

from tests.helpers import MNIST_ROOT, needs_mnist


@needs_mnist
@pytest.mark.fast
def test_mnist_read_here_gives_torchvision_s_tensors_bit_for_bit():
    ours = loading.load_torchvision("mnist", MNIST_ROOT, False)
    for train, (x, y) in zip((True, False), ours):
        reference = loading._torchvision_dataset("mnist", MNIST_ROOT, train, False)
        # stored as read (uint8), the model's inputs torchvision's ToTensor numbers bit for bit
        assert x.dtype == torch.uint8 and torch.equal(x, reference.data.unsqueeze(1)) and x.is_contiguous()
        assert torch.equal(model_inputs(x), reference.data.unsqueeze(1).float().div_(255.0))
        assert torch.equal(y, reference.targets) and y.dtype == torch.long
    assert [len(y) for _, y in ours] == [60000, 10000]


@needs_mnist
@pytest.mark.backend  # a fresh interpreter
def test_loading_mnist_imports_no_torchvision():
    code = (
        "import sys; from fedml_perfedavg.data.loading import load_federated; "
        f"data = load_federated('mnist', {MNIST_ROOT!r}, 50, 'paper', 0); "
        "print(len(data.users), 'torchvision' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["50", "False", "False"], out


@pytest.mark.fast
def test_an_idx_file_whose_header_or_size_is_wrong_is_refused(tmp_path):
    good = bytes([0, 0, 8, 1]) + (3).to_bytes(4, "big") + bytes([1, 2, 3])
    (tmp_path / "ok").write_bytes(good)
    assert loading.read_idx(str(tmp_path / "ok"), 1).tolist() == [1, 2, 3]
    for name, data, words in (
        ("magic", bytes([0, 0, 9, 1]) + good[4:], "does not start as an IDX file of 1 dimensions"),
        ("short", good[:-1], "holds 2 bytes of data; its header says (3,)"),
        ("empty", b"", "does not start as an IDX file"),
    ):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            loading.read_idx(str(tmp_path / name), 1)


@pytest.mark.fast
def test_the_paper_split_is_held_once_and_the_batched_engine_reads_it_without_a_second_copy():
    """Issue 80 item 3, a part: each user's tensors are views of one gather per split, and the
    engine's all-users tensor is that block itself (it was ``torch.cat`` of them: every user's data
    twice), the same values as the copy; users that are not one block are still copied."""
    from fedml_perfedavg.core.types import one_block

    generator = torch.Generator().manual_seed(0)
    train = (torch.rand(600, 1, 4, 4, generator=generator), torch.arange(600) % 10)
    test = (torch.rand(300, 1, 4, 4, generator=generator), torch.arange(300) % 10)
    users = loading.split_over_users(train, test, 4, 10, 4, "paper", 0)
    for u, expected in zip(users, loading.split_over_users(train, test, 4, 10, 4, "paper", 0)):
        assert all(torch.equal(a, b) for a, b in zip(u, expected))
    xs = [u.train_x for u in users]
    whole = one_block(xs)
    assert (
        torch.equal(whole, torch.cat(xs)) and whole.untyped_storage().data_ptr() == xs[0].untyped_storage().data_ptr()
    )
    assert (
        one_block([u.train_y for u in users]).untyped_storage().data_ptr()
        == users[0].train_y.untyped_storage().data_ptr()
    )
    picked = [xs[0], xs[2]]  # not one after another: a copy, the same values
    copied = one_block(picked)
    assert (
        torch.equal(copied, torch.cat(picked))
        and copied.untyped_storage().data_ptr() != xs[0].untyped_storage().data_ptr()
    )
    # each user's rows are the rows its indices pick from the split (the old per-user gather)
    rows = loading.partition_indices(train[1].numpy(), loading.plan_users(4, 10, "paper", 0), 0, "a")
    assert all(torch.equal(u.train_x, train[0][torch.as_tensor(r)]) for u, r in zip(users, rows))
