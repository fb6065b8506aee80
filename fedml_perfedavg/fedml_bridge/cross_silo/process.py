"""One process's part of a cross-silo run, through FedML's own initializers.

FedML's cross_silo/fedml_server.py and fedml_client.py accept only their own optimizer names
(``FedAvg``, ``LSA``, ``SA``) and raise a bare ``Exception`` for any other; this calls the
initializers their ``FedAvg`` branch calls (server_initializer.py, client_initializer.py), with
the plugin's classes, given this run's policy and driver, in place of the module-level names
those initializers use. The transport beneath is the plugin's (:mod:`.transport`, installed for
every cross-silo run by :func:`fedml_perfedavg.fedml_bridge.install.install`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ...algorithms.base import SiloServerDriver
from ...core.errors import ConfigError
from ..bootstrap import import_fedml, replaced
from .agreement import ServerSetup, SiloSetup
from .client import PluginClientMasterManager, PluginTrainerDistAdapter, tell_leaving
from ...silo.outcome import SiloOutcome
from .policy import SiloPolicy
from .server import PluginFedMLAggregator, PluginServerManager

import_fedml()
import fedml.cross_silo.client.client_initializer as client_init  # noqa: E402
import fedml.cross_silo.server.server_initializer as server_init  # noqa: E402


class CrossSiloProcess:
    """This process's part (``args.role``) of a cross-silo run; ``run()`` returns when it is over."""

    def __init__(
        self,
        args: Any,
        device: Any,
        dataset: list,
        model: Any,
        trainer: Any,
        aggregator: Any,
        policy: SiloPolicy,
        driver: SiloServerDriver,
        setup: Union[ServerSetup, SiloSetup],
    ) -> None:
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.trainer, self.aggregator, self.policy, self.driver = trainer, aggregator, policy, driver
        self.setup = setup
        self.start_round = 0
        self.resumes = ""  # the server: the session of the server process this one resumes
        self._server: Any = None
        self._client: Any = None

    def resume(self, start_round: int, saved: Optional[Dict[str, Any]]) -> None:
        """The server goes on from ``start_round`` of the run its checkpoint (``saved``: what
        :meth:`checkpoint_state` returned then) recorded; the silos take it as that server's
        resumption. :class:`ConfigError` if it is another run's (``--run_id``)."""
        if saved is None:
            return  # no checkpoint yet: a fresh start
        run_id = str(getattr(self.args, "run_id", "0"))
        if saved["run_id"] != run_id:
            raise ConfigError(
                f"--resume: the checkpoint is of run id {saved['run_id']!r}, this server was started with "
                f"--run_id {run_id!r}; the silos take only their run's messages: give --run_id {saved['run_id']}"
            )
        self.start_round, self.resumes = start_round, str(saved["session"])

    def checkpoint_state(self) -> Dict[str, Any]:
        """What a resumed server needs of this one: its session (the silos know it) and the run id."""
        session = self._server.com_manager.session if self._server is not None else self.resumes
        return {"session": session, "run_id": str(getattr(self.args, "run_id", "0"))}

    @property
    def outcome(self) -> Optional[SiloOutcome]:
        """A silo's: what it keeps of the run (None before its manager was built, and on the server)."""
        return self._client.outcome if self._client is not None else None

    def run(self) -> None:
        """FedML's own initializer for this process's role, with the plugin's pieces in its names."""
        managers: List[Any] = []

        def remembered(cls: type, **bound: Any):
            def build(*a: Any, **kw: Any) -> Any:
                manager = cls(*a, **kw, **bound)
                managers.append(manager)
                if cls is PluginServerManager:
                    self._server = manager
                else:
                    self._client = manager
                return manager

            return build

        with contextlib.ExitStack() as patches:
            try:
                if self.args.role == "server":
                    self._init_server(patches, remembered)
                else:
                    self._init_client(patches, remembered)
            except KeyboardInterrupt:  # SIGINT or SIGTERM (stopping.py): a silo says it leaves
                if self._client is not None:
                    tell_leaving(self._client)
                raise
            finally:
                for manager in managers:  # no gRPC server threads left behind on an error
                    if manager.com_manager is not None and manager.com_manager.is_running:
                        manager.com_manager.stop_receive_message()

    def _initializer_args(self) -> Tuple[Any, ...]:
        """The arguments FedML's ``init_server`` and ``init_client`` both start with."""
        args = self.args
        return (args, self.device, args.comm, args.rank, args.worker_num, self.model)

    def _init_server(self, patches: contextlib.ExitStack, remembered: Callable[..., Any]) -> None:
        """FedML's ``init_server`` with the plugin's aggregator and server manager in its names."""
        dataset = self.dataset
        patches.enter_context(replaced(server_init, "FedMLAggregator", PluginFedMLAggregator))
        patches.enter_context(
            replaced(
                server_init,
                "FedMLServerManager",
                remembered(
                    PluginServerManager,
                    policy=self.policy,
                    driver=self.driver,
                    setup=self.setup,
                    start_round=self.start_round,
                    resumes=self.resumes,
                ),
            )
        )
        server_init.init_server(
            *self._initializer_args(),
            dataset[0],
            dataset[2],
            dataset[3],
            dataset[5],
            dataset[6],
            dataset[4],
            self.aggregator,
        )

    def _init_client(self, patches: contextlib.ExitStack, remembered: Callable[..., Any]) -> None:
        """FedML's ``init_client`` with the plugin's trainer adapter and client manager in its names."""
        dataset = self.dataset
        patches.enter_context(replaced(client_init, "TrainerDistAdapter", PluginTrainerDistAdapter))
        patches.enter_context(
            replaced(
                client_init,
                "ClientMasterManager",
                remembered(PluginClientMasterManager, policy=self.policy, setup=self.setup),
            )
        )
        client_init.init_client(
            *self._initializer_args(),
            dataset[0],
            dataset[4],
            dataset[5],
            dataset[6],
            self.trainer,
        )
