"""A cross-silo process's identity: FedML's gRPC address file (grpc_ipconfig.csv) and the
``--rank/--role`` each process is started with, checked against the config."""
from __future__ import annotations

import csv
import ipaddress
import socket
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.guards import ConfigError
from .config import Config

IPCONFIG_FIELDS = ("eid", "rank", "grpc_server_ip", "grpc_server_port")
def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_ipconfig(path: str, ranks: int, host: str = "127.0.0.1", ports: Optional[Sequence[int]] = None) -> str:
    """Write FedML's gRPC address file: rank r (0 = server) listens on ``host:ports[r]``."""
    ports = list(ports) if ports is not None else free_ports(ranks, host)
    with open(path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(IPCONFIG_FIELDS)
        for rank in range(ranks):
            writer.writerow([rank, rank, host, ports[rank]])
    return path


def read_ipconfig(path: str, ranks: int) -> Dict[int, Tuple[str, int]]:
    """rank -> (ip, port) from the address file; every rank 0..ranks-1 must have a valid row.

    FedML binds a rank that has no row to 0.0.0.0 (every interface); requiring a row per rank
    keeps each process on the address it was given."""
    where = f"comm_args.grpc_ipconfig_path={path!r}"
    try:
        with open(path, newline="") as stream:
            rows = list(csv.DictReader(stream))
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read ({err})") from None
    if not rows or not set(IPCONFIG_FIELDS) <= set(rows[0]):
        raise ConfigError(f"{where}: must be a CSV with the header {','.join(IPCONFIG_FIELDS)}")
    table: Dict[int, Tuple[str, int]] = {}
    for number, row in enumerate(rows, start=2):
        try:
            eid, ip, port = int(row["eid"]), str(ipaddress.ip_address(row["grpc_server_ip"].strip())), \
                int(row["grpc_server_port"])
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: line {number}: {err}") from None
        if not 0 < port < 65536:
            raise ConfigError(f"{where}: line {number}: port {port} is not in 1..65535")
        table[eid] = (ip, port)
    missing = [r for r in range(ranks) if r not in table]
    if missing:
        raise ConfigError(f"{where}: no row for rank(s) {missing}; a row is needed for the server (0) and every "
                          f"silo (1..{ranks - 1}), or FedML would listen on all interfaces")
    return table


def check_silo_role(config: Config, rank: Optional[int], role: Optional[str]) -> None:
    """A cross-silo process's identity (FedML's ``--rank/--role``) must be given and agree
    with the config and the address file."""
    if rank is None or role is None:
        raise ConfigError("common_args.training_type='cross_silo': start each process with --rank R --role "
                          "server|client, or start them all with: fedml-perfedavg launch-silo --cf CONFIG")
    if role not in ("server", "client"):
        raise ConfigError(f"--role {role!r}: must be 'server' or 'client'")
    if (role == "server") != (rank == 0):
        raise ConfigError(f"--rank {rank} --role {role}: the server is rank 0 and silos are ranks "
                          f"1..{config.client_num_per_round}")
    if not 0 <= rank <= config.client_num_per_round:
        raise ConfigError(f"--rank {rank}: silos are ranks 1..{config.client_num_per_round} "
                          f"(train_args.client_num_per_round)")
    if config.grpc_ipconfig_path is None:
        raise ConfigError("comm_args.grpc_ipconfig_path=None: cross-silo needs the gRPC address file (CSV "
                          "eid,rank,grpc_server_ip,grpc_server_port); launch-silo writes one")
    read_ipconfig(config.grpc_ipconfig_path, config.client_num_per_round + 1)
