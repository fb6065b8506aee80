"""A cross-silo process's identity: the ``--rank/--role`` each process is started with, checked
against the config and FedML's gRPC address file (read by
:mod:`fedml_perfedavg.net.addresses`, the one module that knows that file)."""

from __future__ import annotations

from typing import Optional

from ..core.errors import ConfigError
from ..net.addresses import read_ipconfig
from .config import Config


def check_silo_role(config: Config, rank: Optional[int], role: Optional[str]) -> None:
    """A cross-silo process's identity (FedML's ``--rank/--role``) must be given and agree
    with the config and the address file."""
    if rank is None or role is None:
        raise ConfigError(
            "common_args.training_type='cross_silo': start each process with --rank R --role "
            "server|client, or start them all with: fedml-perfedavg launch-silo --cf CONFIG"
        )
    if role not in ("server", "client"):
        raise ConfigError(f"--role {role!r}: must be 'server' or 'client'")
    silos = config.silo_count
    why = (
        "train_args.client_num_in_total: one silo per user with comm_args.silo_data own"
        if config.own_data
        else "train_args.client_num_per_round"
    )
    if (role == "server") != (rank == 0):
        raise ConfigError(f"--rank {rank} --role {role}: the server is rank 0 and silos are ranks 1..{silos}")
    if not 0 <= rank <= silos:
        raise ConfigError(f"--rank {rank}: silos are ranks 1..{silos} ({why})")
    if config.comm.grpc_ipconfig_path is None:
        raise ConfigError(
            "comm_args.grpc_ipconfig_path=None: cross-silo needs the gRPC address file (CSV "
            "eid,rank,grpc_server_ip,grpc_server_port); launch-silo writes one"
        )
    read_ipconfig(config.comm.grpc_ipconfig_path, silos + 1)
