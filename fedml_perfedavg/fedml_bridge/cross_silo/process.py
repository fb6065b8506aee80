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
from typing import Any, List

from ...algorithms.base import RoundDriver
from ..bootstrap import import_fedml, replaced
from .agreement import SiloSetup
from .client import PluginClientMasterManager, PluginTrainerDistAdapter
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
        driver: RoundDriver,
        setup: SiloSetup,
    ) -> None:
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.trainer, self.aggregator, self.policy, self.driver = trainer, aggregator, policy, driver
        self.setup = setup

    def run(self) -> None:
        args, dataset = self.args, self.dataset
        managers: List[Any] = []

        def remembered(cls: type, **bound: Any):
            def build(*a: Any, **kw: Any) -> Any:
                manager = cls(*a, **kw, **bound)
                managers.append(manager)
                return manager

            return build

        with contextlib.ExitStack() as patches:
            try:
                if args.role == "server":
                    patches.enter_context(replaced(server_init, "FedMLAggregator", PluginFedMLAggregator))
                    patches.enter_context(
                        replaced(
                            server_init,
                            "FedMLServerManager",
                            remembered(PluginServerManager, policy=self.policy, driver=self.driver, setup=self.setup),
                        )
                    )
                    server_init.init_server(
                        args,
                        self.device,
                        args.comm,
                        args.rank,
                        args.worker_num,
                        self.model,
                        dataset[0],
                        dataset[2],
                        dataset[3],
                        dataset[5],
                        dataset[6],
                        dataset[4],
                        self.aggregator,
                    )
                else:
                    patches.enter_context(replaced(client_init, "TrainerDistAdapter", PluginTrainerDistAdapter))
                    patches.enter_context(
                        replaced(
                            client_init,
                            "ClientMasterManager",
                            remembered(PluginClientMasterManager, policy=self.policy, setup=self.setup),
                        )
                    )
                    client_init.init_client(
                        args,
                        self.device,
                        args.comm,
                        args.rank,
                        args.worker_num,
                        self.model,
                        dataset[0],
                        dataset[4],
                        dataset[5],
                        dataset[6],
                        self.trainer,
                    )
            finally:
                for manager in managers:  # no gRPC server threads left behind on an error
                    if manager.com_manager is not None and manager.com_manager.is_running:
                        manager.com_manager.stop_receive_message()
