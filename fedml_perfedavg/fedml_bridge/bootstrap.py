"""Making FedML 0.9.6 importable, offline and tidy: torchvision's op schemas, no cloud calls
from ``fedml.init()`` when ``using_mlops`` is off, FedML's ``~/.fedml`` files where the user
says. Each replacement names the FedML file it works around and why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import logging
import os
import platform
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

from ..data.torchvision_ops import make_torchvision_importable
from ..import_cost import collector_paused, imports_deferred, owns_process

logger = logging.getLogger(__name__)


# What FedML's modules import at ``import fedml`` but use only inside functions (MLOps,
# schedulers, attacks, defences, data loaders of other datasets), deferred to its first use
# (import_cost.ImportDeferral): about 1.2 s of the 2.3 s of CPU that ``import fedml`` takes
# beyond torch's here; torchvision alone is 0.9 s, as it imports torch._dynamo. A Per-FedAvg
# run mostly never uses them (issue 54). FedML's own modules in the list build something from
# them at import: a base class (``DatasetFolder``) or a database model (``declarative_base()``).
_FEDML_DEFERS = (
    "boto3",
    "docker",
    "fastapi",
    "gevent",
    "git",
    "h5py",
    "httpx",
    "matplotlib",
    "pandas",
    "redis",
    "scipy",
    "sentry_sdk",
    "sqlalchemy",
    "torchvision",
    "wandb",
    "fedml.computing.scheduler.scheduler_core.compute_gpu_db",
    "fedml.computing.scheduler.scheduler_core.compute_status_db",
    "fedml.computing.scheduler.model_scheduler.device_model_db",
    "fedml.data.cinic10.datasets",
    "fedml.data.edge_case_examples.datasets",
)


@contextlib.contextmanager
def _fedml_import_context() -> Iterator[None]:
    """What ``import fedml`` needs here: torchvision importable beside a CPU torch (PyPI's
    torchvision wheels are CUDA builds; FedML imports torchvision through
    core/alg_frame/client_trainer.py -> core/security/...), gRPC's connection chatter off (GOAWAY
    at a run's end, printed at INFO on stderr; a user's own setting wins) and the deprecation
    warning of computing/scheduler/comm_utils/sys_utils.py's ``import pkg_resources`` silenced.
    Where the plugin's command line owns the process, also FedML's heavy imports deferred and the
    imported heap frozen (import_cost.py); in a FedML user's program, FedML's import is FedML's."""
    make_torchvision_importable()
    if not owns_process():  # a FedML user's program: FedML imported as it is, nothing deferred (issue 77)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
            yield
        return
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    deferral = imports_deferred(_FEDML_DEFERS, "fedml")
    with warnings.catch_warnings(), collector_paused(freeze=True), deferral.deferring():
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
        yield


def import_fedml():
    """``import fedml``, in :func:`_fedml_import_context`."""
    with _fedml_import_context():
        import fedml

    return fedml


class _AfterFedML(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs a callback right after ``fedml`` is first imported, whoever imports it: FedML's module
    is found by the other finders and executed by its own loader, then the callback runs (see
    :func:`when_fedml_is_imported`; an error in it fails that import, loudly). Steps aside once
    used."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.loader: Optional[importlib.abc.Loader] = None

    def find_spec(self, name, path=None, target=None):
        if name != "fedml" or self.loader is not None:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("fedml")
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        assert self.loader is not None  # set by find_spec, which hands out this loader
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        assert self.loader is not None
        with _fedml_import_context():
            self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # FedML's own loader, for resource readers
        _now_or_at_first_use(self.callback)


def when_fedml_is_imported(callback: Callable[[], None]) -> None:
    """``callback()`` (installing the plugin) now if FedML is imported already, else right after
    its first import; nothing is imported here. Where FedML is first imported by one of the
    plugin's own modules (``import fedml_perfedavg.fedml_bridge.cross_silo.transport`` before
    ``import fedml``), that module is still half-made and the install cannot import it yet: then
    the callback runs at the first ``fedml.init()`` or ``FedMLRunner(...)``, before either does
    anything."""
    if "fedml" in sys.modules:
        _now_or_at_first_use(callback)
    elif not any(isinstance(finder, _AfterFedML) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterFedML(callback))


_PACKAGE = __name__.split(".")[0]
_cancel_first_use: Optional[Callable[[], None]] = None
_deferred_install: Optional[Callable[[], None]] = None  # the install that first use will run
_entry: Any = None  # the run layer's entry, once installed


def _plugin_module_being_imported() -> Optional[str]:
    """A module of the plugin whose import is under way (its package's own ``__init__`` aside,
    which imports nothing the install needs before it asks for it)."""
    # ``__spec__._initializing`` is what importlib itself reads to report a "partially initialized
    # module"; absent elsewhere, it reads as False and the install runs at once, as before.
    for name, module in list(sys.modules.items()):
        if name.startswith(_PACKAGE + ".") and getattr(getattr(module, "__spec__", None), "_initializing", False):
            return name
    return None


def _now_or_at_first_use(callback: Callable[[], None]) -> None:
    global _cancel_first_use, _deferred_install
    if _plugin_module_being_imported() is None:
        callback()
        return
    import fedml
    from fedml import FedMLRunner

    original_init, original_runner_init = fedml.init, FedMLRunner.__init__

    def cancel() -> None:
        global _cancel_first_use
        fedml.init, FedMLRunner.__init__ = original_init, original_runner_init
        _cancel_first_use = None

    @functools.wraps(original_init)
    def init(*args: Any, **kwargs: Any) -> Any:
        cancel()
        callback()
        return fedml.init(*args, **kwargs)

    @functools.wraps(original_runner_init)
    def runner_init(self: Any, *args: Any, **kwargs: Any) -> None:
        cancel()
        callback()
        FedMLRunner.__init__(self, *args, **kwargs)

    fedml.init, FedMLRunner.__init__ = init, runner_init
    _cancel_first_use = cancel
    _deferred_install = callback


def cancel_install_at_first_use() -> None:
    """Undo :func:`_now_or_at_first_use`'s stand-ins (the install is being done now)."""
    global _deferred_install
    _deferred_install = None
    if _cancel_first_use is not None:
        _cancel_first_use()


#: On FedML's args: the cross-silo transport's comm_args values (``run/fedml_args.py: TRANSPORT_KEYS``),
#: typed and checked by the run's rules, set by the plugin's ``fedml.init`` (install.py) for a
#: cross-silo run that asks for the plugin. The transport FedML builds reads them there: the bridge
#: never reaches for the run layer.
TRANSPORT_VALUES = "perfedavg_transport_values"


def register_entry(entry: Any) -> None:
    """Called by the install with the run layer's entry (``install.PluginEntry``)."""
    global _entry
    _entry = entry


def installed_entry() -> Any:
    """The run layer's entry, or None before the install."""
    return _entry


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
            importlib.import_module(name).expanduser = os.path.expanduser  # type: ignore[attr-defined]
        return
    home = os.path.abspath(home)

    def expanduser(path: str) -> str:
        return home + path[1:] if path == "~" or path.startswith("~/") else os.path.expanduser(path)

    for name in _HOME_WRITERS:
        importlib.import_module(name).expanduser = expanduser  # type: ignore[attr-defined]
