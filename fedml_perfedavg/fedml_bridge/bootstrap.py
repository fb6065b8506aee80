"""Making FedML 0.9.6 importable, offline and tidy: torchvision's op schemas, no cloud calls
from ``fedml.init()`` when ``using_mlops`` is off, FedML's ``~/.fedml`` files where the user
says. Each replacement names the FedML file it works around and why.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import platform
import warnings
from typing import Any, Callable, Iterator, Optional

from ..data.torchvision_ops import make_torchvision_importable

logger = logging.getLogger(__name__)


def import_fedml():
    """``import fedml`` after making torchvision importable (PyPI's torchvision wheels are CUDA
    builds; FedML imports torchvision through core/alg_frame/client_trainer.py ->
    core/security/..., so a CPU torch breaks ``import fedml`` without this)."""
    make_torchvision_importable()
    # gRPC's core prints connection chatter (GOAWAY at a run's end) at INFO on stderr; its
    # errors (a refused TLS handshake) still print. A user's own setting wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    with warnings.catch_warnings():
        # computing/scheduler/comm_utils/sys_utils.py imports the deprecated pkg_resources.
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
        import fedml

    return fedml


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the duration of a ``with`` block."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def offline_fetch_config(fedml_dir: str) -> Callable[..., bool]:
    """A stand-in for core/mlops/mlops_configs.py ``fetch_config``: the same attributes on
    ``args``, without its 5 POSTs to FedML's cloud config service."""

    def fetch_config(args: Any, version: str = "release") -> bool:
        os.makedirs(fedml_dir, exist_ok=True)
        args.current_running_dir = fedml_dir
        args.os_name = "MacOS" if platform.system() == "Darwin" else platform.system()
        args.version = version
        args.log_file_dir = getattr(args, "log_file_dir", None) or os.path.join(fedml_dir, "logs")
        args.device_id = f"local-{getattr(args, 'rank', 0)}"
        args.config_version = version
        args.cloud_region = ""
        return False

    return fetch_config


# Modules that write under ``expanduser("~")/.fedml`` during a run: fedml/runner.py
# (``log_runner_result``: fedml_trace/<pid>), computing/scheduler/slave/client_constants.py and
# master/server_constants.py (global_services/.env, written by ``fedml.init``'s
# ``set_env_version``), computing/scheduler/comm_utils/sys_utils.py.
_HOME_WRITERS = (
    "fedml.runner",
    "fedml.computing.scheduler.slave.client_constants",
    "fedml.computing.scheduler.master.server_constants",
    "fedml.computing.scheduler.comm_utils.sys_utils",
)


def redirect_fedml_home(home: Optional[str]) -> None:
    """Make FedML write its ``~/.fedml`` files under ``home`` (None: the user's home again).

    Those modules call ``os.path.expanduser`` through a module-level name, so only their view
    of ``~`` changes; wandb and everything else still see the real home."""
    import_fedml()
    if home is None:
        for name in _HOME_WRITERS:
            importlib.import_module(name).expanduser = os.path.expanduser
        return
    home = os.path.abspath(home)

    def expanduser(path: str) -> str:
        return home + path[1:] if path == "~" or path.startswith("~/") else os.path.expanduser(path)

    for name in _HOME_WRITERS:
        importlib.import_module(name).expanduser = expanduser
