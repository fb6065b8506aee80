"""The one place the plugin is installed into FedML: :func:`install`.

``import fedml_perfedavg`` calls it. Afterwards FedML's own entry points run the plugin's
algorithms when the YAML names one (``federated_optimizer: PerFedAvg``):
``FedMLRunner(args, device, dataset, model).run()``, ``fedml.run_simulation(backend=...)``,
``fedml.run_cross_silo_server()`` / ``run_cross_silo_client()``. What it replaces, each in its
own module that names the FedML file and why:

- ``fedml.init``: no cloud calls and FedML's files where the user says (:mod:`.bootstrap`);
- ``FedMLRunner.__init__``: plugin algorithms, and trainer/aggregator pairs really used
  (:mod:`.dispatch`, then :mod:`.sp`, :mod:`.mpi`, :mod:`.cross_silo`);
- ``fedml.data.load`` / ``fedml.model.create``: the paper's split and MLP (:mod:`.data_and_models`).

Each acts only for a run that selects a plugin algorithm or asks for the plugin's fixes
(:func:`asks_for_plugin`); any other run is handed to FedML's own function as it was called.

A plugin run's cross-silo managers build the plugin's transport themselves (:mod:`.cross_silo.transport`:
FedML's unpickles what any peer sends) and its MPI managers carry their own fixes (:mod:`.mpi`);
FedML's own algorithms keep FedML's transport and MPI loop unless the FedML user asks for the
plugin's (``common_args.plugin_fixes: true``, :func:`apply_to_fedml_algorithms`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import types
from typing import Any, Callable, Dict, Optional, Protocol

from .. import logs
from .cross_silo.backends import check_cross_silo_backend
from .bootstrap import (
    TRANSPORT_VALUES,
    cancel_install_at_first_use,
    import_fedml,
    installed_entry,
    register_entry,
    offline_fetch_config,
    redirect_fedml_home,
    replaced,
)

logger = logging.getLogger(__name__)


class PluginEntry(Protocol):
    """What the run layer gives the bridge (the bridge never imports the run layer)."""

    def is_plugin_algorithm(self, name: Optional[str]) -> bool:
        """True for names in the plugin's registry."""

    def before_fedml_arguments(self, yaml_path: Optional[str]) -> Optional[Dict[str, Dict[str, Any]]]:
        """Called with FedML's ``--cf`` file before FedML reads it (FedML's reader fails on its own
        for some settings the plugin refuses with a clearer message); returns its sections as read,
        which FedML is then handed instead of reading the file again (None: FedML reads it)."""

    def check_algorithm_name(self, args: Any) -> None:
        """A ``ConfigError`` for a ``federated_optimizer`` that neither the plugin nor FedML runs
        (FedML would raise only after loading the data); a plugin name in another case made the
        registry's."""

    def before_fedml_init(self, args: Any) -> Optional[str]:
        """Called before FedML's ``init``; returns where FedML's ``~/.fedml`` files go (None:
        the user's home)."""

    def load_split(self, args: Any):
        """The paper's split for ``fedml.data.load`` (a FederatedData), or None if not asked for."""

    def build_runner(self, args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any):
        """The object ``FedMLRunner.run()`` runs for a plugin algorithm."""

    def transport_values(self, args: Any) -> Dict[str, Any]:
        """The cross-silo transport's comm_args values for this run, typed and checked (set on
        FedML's args as :data:`~.bootstrap.TRANSPORT_VALUES` by ``fedml.init``)."""


def offline_init(original_init, entry: PluginEntry):
    """A replacement for ``fedml.init`` (fedml/__init__.py): with ``using_mlops`` off (FedML's
    default), core/mlops/mlops_configs.py ``fetch_config`` (5 POSTs to FedML's cloud, whatever
    the YAML says) is replaced by a local stand-in, cross-silo's probe of FedML's hosts
    (collect_env.py) is skipped, and FedML's ``~/.fedml`` files (its ``logs`` folder included,
    which it would create in the working directory) go where ``entry`` says."""

    @functools.wraps(original_init)
    def init(args=None, check_env=True, should_init_logs=True):
        import fedml
        from fedml.arguments import load_arguments
        from fedml.core import mlops as mlops_module

        if args is None:
            from fedml.arguments import Arguments, add_args

            yaml_path = getattr(add_args(), "yaml_config_file", None)
            sections = entry.before_fedml_arguments(yaml_path)
            if sections is not None and not asks_for_plugin(entry, _flat(sections).get):
                entry.check_algorithm_name(types.SimpleNamespace(**_flat(sections)))
                return original_init(None, check_env=check_env, should_init_logs=should_init_logs)
            with replaced(Arguments, "load_yaml_config", reading_once(Arguments.load_yaml_config, yaml_path, sections)):
                args = load_arguments(fedml._global_training_type, fedml._global_comm_backend)
            if sections is not None:
                setattr(args, YAML_SECTIONS, sections)
        if not asks_for_plugin(entry, functools.partial(getattr, args)):
            # FedML's own algorithm, not opted in: FedML's init as FedML has it (its cloud calls included)
            entry.check_algorithm_name(args)
            return original_init(args, check_env=check_env, should_init_logs=should_init_logs)
        if asks_for_fixes(args):
            apply_to_fedml_algorithms()
        check_cross_silo_backend(args)
        if getattr(args, "using_mlops", False):
            args = original_init(args, check_env=check_env, should_init_logs=should_init_logs)
            logs.keep_plugin_lines_visible()
            return with_transport_values(entry, args)
        files_dir = entry.before_fedml_init(args)
        redirect_fedml_home(files_dir)
        fedml_dir = os.path.join(files_dir or os.path.expanduser("~"), ".fedml")
        args.sys_perf_profiling = False
        # core/mlops/mlops_runtime_log.py creates args.log_file_dir, "./logs" when unset, before
        # fetch_config would set it: an empty folder in the user's working directory.
        if not getattr(args, "log_file_dir", None):
            args.log_file_dir = os.path.join(fedml_dir, "logs")
        with replaced(mlops_module, "fetch_config", offline_fetch_config(fedml_dir)):
            args = original_init(args, check_env=False, should_init_logs=should_init_logs)
        logs.keep_plugin_lines_visible()
        return with_transport_values(entry, args)

    init.__wrapped__ = original_init
    return init


def with_transport_values(entry: PluginEntry, args: Any) -> Any:
    """``args`` of a cross-silo run with the transport's values on it (:data:`TRANSPORT_VALUES`):
    checked here, at ``fedml.init``, so a bad one (no TLS, say) stops the process before it builds
    anything."""
    if getattr(args, "training_type", None) == "cross_silo":
        setattr(args, TRANSPORT_VALUES, entry.transport_values(args))
    return args


YAML_SECTIONS = "perfedavg_yaml_sections"  # on FedML's args: the --cf file's sections, as read once


def reading_once(load_yaml_config, yaml_path: Optional[str], sections: Optional[Dict[str, Dict[str, Any]]]):
    """``Arguments.load_yaml_config`` (fedml/arguments.py) handing FedML the sections the plugin
    has read from ``yaml_path`` (a copy), instead of reading the file a second time; other files
    (FedML's GPU mappings) it reads itself."""

    @functools.wraps(load_yaml_config)
    def load(self, path):
        if sections is not None and path == yaml_path:
            return copy.deepcopy(sections)
        return load_yaml_config(self, path)

    return load


def _refusing_insecure_backends(original_init_manager):
    """``FedMLCommManager._init_manager`` (core/distributed/fedml_comm_manager.py) refusing, for a
    cross-silo process, the backends of ``cross_silo/backends.py`` (args changed after
    ``fedml.init`` included)."""

    @functools.wraps(original_init_manager)
    def init_manager(self):
        check_cross_silo_backend(
            types.SimpleNamespace(training_type=getattr(self.args, "training_type", None), backend=self.backend)
        )
        return original_init_manager(self)

    init_manager.__wrapped__ = original_init_manager
    return init_manager


#: The FedML release every change this plugin makes to FedML was written and tested against
#: (setup.py pins it); another one is refused at install rather than patched blind.
SUPPORTED_FEDML = "0.9.6"


class UnsupportedFedML(ImportError):
    """The process imports a FedML release the plugin was not written for."""


def check_fedml_version(version: Any) -> None:
    """:class:`UnsupportedFedML`, in one line naming both releases, unless ``version`` is
    :data:`SUPPORTED_FEDML`."""
    if str(version) != SUPPORTED_FEDML:
        raise UnsupportedFedML(
            f"fedml-perfedavg supports FedML {SUPPORTED_FEDML} only; this process imports FedML {version} "
            f"(pip install fedml=={SUPPORTED_FEDML}); nothing in FedML was changed"
        )


def installed_fedml_version() -> str:
    """The installed FedML distribution's version (its metadata: nothing of FedML is imported)."""
    from importlib import metadata

    try:
        return metadata.version("fedml")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def install(entry: PluginEntry) -> None:
    """Install the plugin into FedML (idempotent; see the module doc); :class:`UnsupportedFedML`
    for another FedML release, before any change to it."""
    if is_installed():
        return
    check_fedml_version(installed_fedml_version())  # before FedML is imported through the plugin's bootstrap
    cancel_install_at_first_use()
    import_fedml()
    import fedml

    check_fedml_version(getattr(fedml, "__version__", "(unknown)"))  # the module this process has
    import fedml.data
    import fedml.model
    from fedml.runner import FedMLRunner

    from .dispatch import dispatching_init
    from .data_and_models import creating_paper_models, loading_with_paper_split

    fedml.init = offline_init(fedml.init, entry)
    FedMLRunner.__init__ = dispatching_init(
        FedMLRunner.__init__, entry.is_plugin_algorithm, entry.build_runner, asks_for_fixes
    )

    def asked(args: Any) -> bool:
        return asks_for_plugin(entry, functools.partial(getattr, args))

    fedml.data.load = loading_with_paper_split(fedml.data.load, entry.load_split, asked)
    fedml.model.create = creating_paper_models(fedml.model.create, asked)
    try:  # its FedML modules with the rest of FedML's (it changes nothing in them unless asked)
        from . import mpi  # noqa: F401
    except ImportError:  # no mpi4py: FedML's MPI simulation cannot run either
        pass
    register_entry(entry)
    logger.debug("fedml-perfedavg installed into FedML %s", getattr(fedml, "__version__", "?"))


#: FedML's args (``common_args.plugin_fixes`` in its YAML): FedML's own algorithms in this process get
#: the plugin's fixes too (:func:`apply_to_fedml_algorithms`)
FIXES_KEY = "plugin_fixes"


def _flat(sections: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return {key: value for values in sections.values() if isinstance(values, dict) for key, value in values.items()}


def asks_for_plugin(entry: "PluginEntry", setting: Callable[..., Any]) -> bool:
    """Whether a run (``setting(key, default)``: FedML's args or its YAML's keys) selects a plugin
    algorithm or asks for the plugin's fixes (``common_args.plugin_fixes: true``): every change the
    plugin makes to FedML's behaviour applies to those runs alone."""
    return entry.is_plugin_algorithm(setting("federated_optimizer", None)) or _fixes_asked(setting(FIXES_KEY, False))


def asks_for_fixes(args: Any) -> bool:
    """Whether FedML's ``args`` ask for :func:`apply_to_fedml_algorithms`; a value other than a
    boolean is a :class:`ConfigError` naming the key."""
    return _fixes_asked(getattr(args, FIXES_KEY, False))


def _fixes_asked(value: Any) -> bool:
    if not isinstance(value, bool):
        from ..core.errors import ConfigError

        raise ConfigError(f"common_args.{FIXES_KEY}={value!r}: must be true or false")
    return value


def apply_to_fedml_algorithms() -> None:
    """``common_args.plugin_fixes: true``: FedML's own algorithms in this process use the plugin's
    secure gRPC transport (and FedML's pickling transports are refused for cross-silo), and FedML's
    MPI FedAvg ends after a one-round run and waits for its messages without polling. Without it
    they run as FedML has them; a plugin run has these always, in its own managers."""
    from fedml.core.distributed.fedml_comm_manager import FedMLCommManager

    _install_transport()
    _install_mpi_fix()
    if not hasattr(FedMLCommManager._init_manager, "__wrapped__"):
        FedMLCommManager._init_manager = _refusing_insecure_backends(FedMLCommManager._init_manager)
    logger.info("common_args.%s: FedML's own algorithms use the plugin's transport and MPI fixes", FIXES_KEY)


def _install_transport() -> None:
    """fedml_comm_manager.py imports ``GRPCCommManager`` from its module when a manager is built,
    so replacing the module's name reaches every cross-silo gRPC run. Fails closed: without the
    transport's own packages, a cross-silo process refuses to start instead of unpickling."""
    try:
        import fedml.core.distributed.communication.grpc.grpc_comm_manager as fedml_grpc
    except ImportError:
        return  # no grpcio: FedML's gRPC backend cannot start either, and says so itself
    manager: Any
    try:
        from .cross_silo.transport import SecureGRPCCommManager

        manager = SecureGRPCCommManager
    except ImportError as err:
        missing = str(err)

        def refuse(*args: Any, **kwargs: Any) -> None:  # stands in for the class
            from ..core.errors import ConfigError

            raise ConfigError(
                f"comm_args.backend='GRPC' needs the plugin's secure transport, which cannot be "
                f"imported ({missing}); pip install 'fedml-perfedavg[silo]'"
            )

        manager = refuse
    fedml_grpc.GRPCCommManager = manager


def _install_mpi_fix() -> None:
    """FedML's MPI FedAvg worker hangs after a one-round run, and its ranks poll their queue
    (:mod:`.mpi`). Without mpi4py FedML's MPI simulation cannot run anyway."""
    try:
        from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager

        from . import mpi
    except ImportError:
        return
    worker = mpi.mpi_api.FedAVGClientManager  # every worker of the process ends after a one-round run
    if not hasattr(worker.handle_message_init, "__wrapped__"):
        mpi.mpi_api.FedAVGClientManager.handle_message_init = mpi.finishing_after_one_round(worker.handle_message_init)
    if MpiCommunicationManager.handle_receive_message is not mpi.waiting_receive_loop:  # and waits, not polls
        MpiCommunicationManager.handle_receive_message = mpi.waiting_receive_loop


def is_installed() -> bool:
    return installed_entry() is not None
