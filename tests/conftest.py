import logging
import os

import pytest

from tests.helpers import MNIST_ROOT, mnist_available

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    # Backend runs (subprocesses, FedML's loops, MPI, gRPC) are marked "backend"; the rest
    # "fast": `pytest -m fast` runs those alone in about a minute.
    for item in items:
        slow = "/backends/" in str(item.fspath) or item.get_closest_marker("backend") is not None
        item.add_marker(pytest.mark.backend if slow else pytest.mark.fast)


@pytest.fixture(scope="session")
def mnist_root() -> str:
    if not mnist_available():
        pytest.skip(f"real MNIST not found under {MNIST_ROOT}")
    return MNIST_ROOT


@pytest.fixture
def fake_cifar_root(tmp_path, monkeypatch):
    """Small generated CIFAR-10 files in torchvision's layout; md5 checks relaxed for them only."""
    from fedml_perfedavg.data.torchvision_ops import make_torchvision_importable

    from tests.helpers_cifar import write_fake_cifar10

    make_torchvision_importable()
    import torchvision

    root = write_fake_cifar10(str(tmp_path / "cifar"), train_per_class=50, test_per_class=20)
    # Generated files cannot match CIFAR-10's published md5s; the rest is torchvision's real path.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    return root


@pytest.fixture(autouse=True)
def restore_logging_root():
    """FedML's ``fedml.init()`` (mlops_runtime_log.py) replaces ``logging.root``; a test that
    runs FedML's stock main in this process must not leave that to the next test's caplog."""
    root, level = logging.Logger.manager.root, logging.Logger.manager.root.level
    yield
    logging.root = logging.Logger.root = root
    root.setLevel(level)
