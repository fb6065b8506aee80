"""FedML's cross-silo deployment (fedml/cross_silo) over gRPC, running a given
trainer/aggregator pair with the plugin's transport, server and client fixes.

FedML's cross_silo/fedml_server.py and fedml_client.py accept only their own optimizer names
(``FedAvg``, ``LSA``, ``SA``) and raise a bare ``Exception`` for any other; this calls the
initializers their ``FedAvg`` branch calls (server_initializer.py, client_initializer.py), with
the plugin's classes in place of the module-level names those initializers use.
"""
from __future__ import annotations

import contextlib
from typing import Any, List

from ..bootstrap import import_fedml, replaced
from ...algorithms.base import RoundDriver
from .transport import READY_MESSAGE, PeerUnreachable, PortUnavailable, SiloPolicy, with_retry

import_fedml()
import fedml.core.distributed.communication.grpc.grpc_comm_manager as grpc_module  # noqa: E402
import fedml.cross_silo.client.client_initializer as client_init  # noqa: E402
import fedml.cross_silo.server.server_initializer as server_init  # noqa: E402

__all__ = ["CrossSiloProcess", "PeerUnreachable", "PortUnavailable", "READY_MESSAGE", "SiloPolicy"]


class CrossSiloProcess:
    """This process's part (``args.role``) of a cross-silo run; ``run()`` returns when it is over."""

    def __init__(self, args: Any, device: Any, dataset: list, model: Any, trainer: Any, aggregator: Any,
                 policy: SiloPolicy, driver: RoundDriver) -> None:
        self.args, self.device, self.dataset, self.model = args, device, dataset, model
        self.trainer, self.aggregator, self.policy, self.driver = trainer, aggregator, policy, driver

    def run(self) -> None:
        from .client import client_classes
        from .server import server_classes

        args, dataset = self.args, self.dataset
        managers: List[Any] = []

        def remembered(cls: type) -> type:
            def __init__(manager, *a, **kw):
                cls.__init__(manager, *a, **kw)
                managers.append(manager)

            return type(cls.__name__, (cls,), {"__init__": __init__})

        with contextlib.ExitStack() as patches:
            patches.enter_context(replaced(grpc_module, "GRPCCommManager", with_retry(self.policy)))
            try:
                if args.role == "server":
                    aggregator_cls, manager_cls = server_classes(self.policy, self.driver)
                    patches.enter_context(replaced(server_init, "FedMLAggregator", aggregator_cls))
                    patches.enter_context(replaced(server_init, "FedMLServerManager", remembered(manager_cls)))
                    server_init.init_server(args, self.device, args.comm, args.rank, args.worker_num, self.model,
                                            dataset[0], dataset[2], dataset[3], dataset[5], dataset[6], dataset[4],
                                            self.aggregator)
                else:
                    adapter_cls, manager_cls = client_classes(self.policy)
                    patches.enter_context(replaced(client_init, "TrainerDistAdapter", adapter_cls))
                    patches.enter_context(replaced(client_init, "ClientMasterManager", remembered(manager_cls)))
                    client_init.init_client(args, self.device, args.comm, args.rank, args.worker_num, self.model,
                                            dataset[0], dataset[4], dataset[5], dataset[6], self.trainer)
            finally:
                for manager in managers:  # no gRPC server threads left behind on an error
                    if manager.com_manager is not None and manager.com_manager.is_running:
                        manager.com_manager.stop_receive_message()
