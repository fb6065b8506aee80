"""One process's part of a cross-silo run, built as FedML's own initializers build it.

FedML's cross_silo/fedml_server.py and fedml_client.py accept only their own optimizer names
(``FedAvg``, ``LSA``, ``SA``) and raise a bare ``Exception`` for any other; this builds what the
initializers their ``FedAvg`` branch calls build (server_initializer.py ``init_server``,
client_initializer.py ``init_client``: a few constructors each), with the plugin's classes given
this run's policy and driver, constructed here rather than by swapping the names those
initializers look up. The transport beneath is the plugin's (:mod:`.transport`: its managers
build it themselves).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from ...silo.server.records import SiloServerDriver
from ...core.errors import ConfigError
from ..bootstrap import import_fedml
from ...silo.server.agreement import ServerSetup, SiloSetup
from .client import PluginClientMasterManager, PluginTrainerDistAdapter, tell_leaving
from ...silo.outcome import SiloOutcome
from ...silo.server.policy import SiloPolicy
from .server import PluginFedMLAggregator, PluginServerManager

import_fedml()
from fedml.ml.aggregator.aggregator_creator import create_server_aggregator  # noqa: E402


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
        """This process's role, built as FedML's ``FedAvg`` branch builds it, with the plugin's
        classes constructed here (no FedML name is swapped to reach them); returns when it is over."""
        try:
            if self.args.role == "server":
                self._run_server()
            else:
                self._run_client()
        except KeyboardInterrupt:  # SIGINT or SIGTERM (stopping.py): a silo says it leaves
            if self._client is not None:
                tell_leaving(self._client)
            raise
        finally:
            for manager in (self._server, self._client):  # no gRPC server threads left behind on an error
                if manager is not None and manager.com_manager is not None and manager.com_manager.is_running:
                    manager.com_manager.stop_receive_message()

    def _run_server(self) -> None:
        """server_initializer.py ``init_server``: the algorithm's server aggregator (FedML's default
        where none was handed), FedML's aggregator around it, the server manager; the plugin's each."""
        args, dataset, setup = self.args, self.dataset, self.setup
        assert isinstance(setup, ServerSetup)  # (the run layer builds a server's setup for the server)
        aggregator = self.aggregator if self.aggregator is not None else create_server_aggregator(self.model, args)
        aggregator.set_id(0)
        around = PluginFedMLAggregator(
            dataset[2],
            dataset[3],
            dataset[0],
            dataset[5],
            dataset[6],
            dataset[4],
            args.worker_num,
            self.device,
            args,
            aggregator,
        )
        self._server = PluginServerManager(
            args,
            around,
            args.comm,
            args.rank,
            args.worker_num,
            args.backend,
            policy=self.policy,
            driver=self.driver,
            setup=setup,
            start_round=self.start_round,
            resumes=self.resumes,
        )
        self._server.run()

    def _run_client(self) -> None:
        """client_initializer.py ``init_client``, FedML's horizontal scenario (the only one the
        plugin runs, run/rules.py): the trainer's adapter and the silo's manager, the plugin's each."""
        args, dataset, setup = self.args, self.dataset, self.setup
        assert isinstance(setup, SiloSetup)  # (and a silo's for a silo)
        adapter = PluginTrainerDistAdapter(
            args, self.device, args.rank, self.model, dataset[0], dataset[4], dataset[5], dataset[6], self.trainer
        )
        self._client = PluginClientMasterManager(
            args, adapter, args.comm, args.rank, args.worker_num, args.backend, policy=self.policy, setup=setup
        )
        self._client.run()
