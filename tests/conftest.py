import logging
import os

import pytest

from tests.helpers import MNIST_ROOT, mnist_available

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


# Whole tests that are slow by what they do (real MNIST, generated CIFAR files, whole grids).
SLOW_FIXTURES = {"mnist_root", "fake_cifar_root"}


def pytest_collection_modifyitems(config, items):
    """Tests are marked by what they do: "backend" for runs through FedML's loops, MPI, gRPC,
    subprocesses, real datasets or whole grids; "fast" for unit and property checks, which
    `pytest -m fast` runs alone in well under a minute. A test's own marker decides; without one,
    a test that uses a real dataset, or lives in tests/backends/, is "backend"."""
    for item in items:
        if item.get_closest_marker("fast") is not None:
            continue
        slow = (
            item.get_closest_marker("backend") is not None
            or "/backends/" in str(item.fspath)
            or bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))
        )
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
