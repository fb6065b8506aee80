import logging
import os
import tempfile
import types

import pytest

from tests.helpers import MNIST_ROOT, REPO, mnist_available

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# Tests give their processes a HOME of their own; matplotlib (accuracy.png at a run's end) would
# build its font cache, seconds of CPU, in each of them: one cache for the whole suite instead.
os.environ.setdefault("MPLCONFIGDIR", os.path.join(tempfile.gettempdir(), "fedml-perfedavg-tests-matplotlib"))


def _worker_ports() -> None:
    """Under pytest-xdist, each worker's launches choose ports from a range of their own (2,000
    ports from 12000 up, below the kernel's ephemeral range), inherited by every process a test
    starts: two tests side by side can never pick the same port."""
    from fedml_perfedavg.net.addresses import PORTS_VARIABLE

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        low = 12000 + 2000 * (int(worker[2:]) % 10)
        os.environ[PORTS_VARIABLE] = f"{low}-{low + 1999}"


_worker_ports()


def _one_torch_thread_per_worker() -> None:
    """Under pytest-xdist the workers share the machine's cores: each computes on one torch thread,
    and so does every process its tests start (OMP_NUM_THREADS, unless set already; a test that
    compares thread counts sets its own). With a thread per core in each, four workers on two
    cores took 2,204 s of CPU for the suite, against 1,930 s with one thread each (2026-11-28)."""
    if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_one_torch_thread_per_worker()


def _fork_server() -> None:
    """Under pytest-xdist, the tests' own ``python -m fedml_perfedavg`` processes are forked from a
    server that imported torch, FedML and gRPC once (tests/zygote.py says which commands, and why;
    ``TESTS_FRESH_PROCESSES=1`` starts every one as a fresh interpreter)."""
    from tests import zygote

    if zygote.enabled():
        import subprocess

        subprocess.Popen = zygote.ForkedPopen  # type: ignore[misc]


_fork_server()


# Whole tests that are slow by what they do (real MNIST, generated CIFAR files, whole grids).
SLOW_FIXTURES = {"mnist_root", "fake_cifar_root"}


# Each slow test's measured wall time (seconds, under 4 workers; tests/durations.json): under
# pytest-xdist the longest start first, so no worker is left with one at the end while the others
# wait (xdist's load scheduling with --maxschedchunk 1 hands tests out in this order as workers free
# up; by default it gave the first worker the first quarter of the list at once).
DURATIONS = REPO / "tests" / "durations.json"


def _longest_first(items) -> None:
    import json

    try:
        measured = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        measured = {}

    def expected(item) -> float:  # an unmeasured test: a guess by its marker
        return measured.get(item.nodeid, 10.0 if item.get_closest_marker("backend") else 0.1)

    items.sort(key=expected, reverse=True)


def pytest_collection_modifyitems(config, items):
    """Tests are marked by what they do: "backend" for runs through FedML's loops, MPI, gRPC,
    subprocesses, real datasets or whole grids; "fast" for unit and property checks, which
    `pytest -m fast` runs alone in well under a minute. A test's own marker decides; without one,
    a test is "backend" if it uses a real dataset, lives in tests/backends/ or its file imports
    FedML, gRPC, MPI or wandb at the top. Under ``-m fast`` a test that imports one of those or
    starts a subprocess fails, so the marker cannot drift (:func:`pytest_collection_finish`)."""
    for item in items:
        if item.get_closest_marker("fast") is not None:
            continue
        slow = (
            item.get_closest_marker("backend") is not None
            or "/backends/" in str(item.fspath)
            or bool(SLOW_FIXTURES & set(getattr(item, "fixturenames", ())))
            or _uses_backend_modules(item.module)
        )
        item.add_marker(pytest.mark.backend if slow else pytest.mark.fast)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and sorts, alike
        _longest_first(items)


# What a fast test must not do: run FedML's loops, open gRPC channels or servers, use MPI or wandb,
# or start a subprocess. `pytest -m fast` (make test-fast) makes each of those fail, so the marker
# stays true as tests change (:func:`pytest_collection_finish`).
BACKEND_MODULES = ("fedml", "grpc", "mpi4py", "wandb")


class _RefuseBackendImports:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BACKEND_MODULES:
            raise RuntimeError(f"a test marked fast imports {name!r}; mark it backend")
        return None


def _uses_backend_modules(module) -> bool:
    """A test file that imports FedML, gRPC, MPI or wandb at its top (then its tests use them)."""
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] in BACKEND_MODULES:
            return True
    return False


def _refusing(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"a test marked fast {what}; mark it backend")

    return refuse


def pytest_collection_finish(session):
    """Under ``-m fast``, after collection: FedML's loops, gRPC's channels and servers and
    subprocesses refuse to start, and FedML, gRPC, MPI and wandb to be imported anew. Where a
    test file imported FedML (a plugin module that subclasses FedML's classes), the plugin's
    install is finished first, as a user's `import fedml` would, so that what is checked is what a
    test runs, not what was imported to collect it."""
    if session.config.option.markexpr.strip() != "fast":
        return
    import subprocess
    import sys

    if "fedml" in sys.modules:
        from fedml.core.distributed.fedml_comm_manager import FedMLCommManager
        from fedml.simulation.sp.fedavg.fedavg_api import FedAvgAPI

        from fedml_perfedavg.run.runner import install

        install()
        FedAvgAPI.train = _refusing("runs FedML's single-process loop")
        FedMLCommManager.run = _refusing("runs FedML's message loop (MPI or cross-silo)")
    if "grpc" in sys.modules:
        import grpc

        grpc.server = grpc.secure_channel = grpc.insecure_channel = _refusing("opens a gRPC server or channel")
    sys.meta_path.insert(0, _RefuseBackendImports())
    _prepare_libraries()
    subprocess.Popen.__init__ = _refusing("starts a subprocess")


def _prepare_libraries() -> None:
    """Libraries that start a subprocess once, on first import, do it here, before subprocesses
    are refused: matplotlib builds its font cache with ``fc-list`` (on a fresh machine, with no
    cache yet, the first fast test that plotted failed), and numpy.testing, which scipy imports,
    runs ``lscpu``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.font_manager  # noqa: F401  (builds the cache where there is none)
        import numpy.testing  # noqa: F401
    except ImportError:  # plotting is an extra; tests that need it skip without it
        pass


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
def torch_threads_put_back():
    """A test that changes torch's thread count puts it back: the next tests in the worker would
    otherwise compute on more threads than the worker's share of the cores (resnet56's test took
    49 s of CPU instead of 7 after the Table 1 script, run in-process, left 2 on 2026-11-29)."""
    import torch

    threads = torch.get_num_threads()
    yield
    left = torch.get_num_threads()
    torch.set_num_threads(threads)
    assert left == threads, f"the test left torch on {left} threads (it had {threads})"


@pytest.fixture(autouse=True)
def restore_logging_root():
    """FedML's ``fedml.init()`` (mlops_runtime_log.py) replaces ``logging.root``; a test that
    runs FedML's stock main in this process must not leave that to the next test's caplog."""
    root, level = logging.Logger.manager.root, logging.Logger.manager.root.level
    yield
    logging.root = logging.Logger.root = root
    root.setLevel(level)
    # A handler left on a stream that closed (a test's capture) fails every later line with a
    # "Logging error" block in whatever test runs next: the test that left it fails instead.
    dead = [h for h in root.handlers if getattr(getattr(h, "stream", None), "closed", False)]
    for handler in dead:
        root.removeHandler(handler)
    assert not dead, f"the test left logging handlers on closed streams: {dead}"
