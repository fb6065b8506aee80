"""MNIST read from its raw files here: torchvision's bytes, without importing torchvision."""

import subprocess
import sys

import pytest
import torch

from fedml_perfedavg.data import loading

from tests.helpers import MNIST_ROOT, needs_mnist


@needs_mnist
@pytest.mark.fast
def test_mnist_read_here_gives_torchvision_s_tensors_bit_for_bit():
    ours = loading.load_torchvision("mnist", MNIST_ROOT, False)
    for train, (x, y) in zip((True, False), ours):
        reference = loading._torchvision_dataset("mnist", MNIST_ROOT, train, False)
        assert torch.equal(x, reference.data.unsqueeze(1).float().div_(255.0)) and x.is_contiguous()
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
