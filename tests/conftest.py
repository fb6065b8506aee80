import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


def mnist_available() -> bool:
    return (Path(MNIST_ROOT) / "MNIST" / "raw" / "train-images-idx3-ubyte").exists()


needs_mnist = pytest.mark.skipif(not mnist_available(), reason=f"real MNIST not found under {MNIST_ROOT}")


@pytest.fixture(scope="session")
def mnist_root() -> str:
    if not mnist_available():
        pytest.skip(f"real MNIST not found under {MNIST_ROOT}")
    return MNIST_ROOT


@pytest.fixture
def fake_cifar_root(tmp_path, monkeypatch):
    """Small generated CIFAR-10 files in torchvision's layout; md5 checks relaxed for them only."""
    from fedml_perfedavg.fedml_compat import make_torchvision_importable

    from .cifar_files import write_fake_cifar10

    make_torchvision_importable()
    import torchvision

    root = write_fake_cifar10(str(tmp_path / "cifar"), train_per_class=50, test_per_class=20)
    # Generated files cannot match CIFAR-10's published md5s; the rest is torchvision's real path.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    return root
