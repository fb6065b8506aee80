"""FedML's gRPC address file (grpc_ipconfig.csv: ``eid,rank,grpc_server_ip,grpc_server_port``,
a row per rank), read strictly: FedML's reader (grpc_comm_manager.py ``_init_grpc_mappings``)
lets a later row silently replace an earlier one and binds a rank without a row to 0.0.0.0."""

from __future__ import annotations

import csv
import ipaddress
import os
import random
import socket
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.errors import ConfigError

IPCONFIG_FIELDS = ("eid", "rank", "grpc_server_ip", "grpc_server_port")


#: Where the kernel says which ports it hands out as the local end of outgoing connections.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: Ports below this are left to the machine's services.
LOWEST_CHOSEN_PORT = 10000


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> Optional[Tuple[int, int]]:
    """(low, high) of the kernel's ephemeral ports, or None where it cannot be read (not Linux)."""
    try:
        with open(path) as stream:
            low, high = (int(value) for value in stream.read().split())
    except (OSError, ValueError):
        return None
    return low, high


#: ``LOW-HIGH``: the ports that launch-silo may choose (a firewall's open range; each pytest-xdist
#: worker's own, so that two tests' launches never pick the same port).
PORTS_VARIABLE = "FEDML_PERFEDAVG_PORTS"


def allowed_ports(value: Optional[str]) -> Optional[Tuple[int, int]]:
    """(low, high) of :data:`PORTS_VARIABLE`'s ``LOW-HIGH``, or None where it is unset or empty."""
    if not value:
        return None
    low, _, high = value.partition("-")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = (0, -1)
    if not 1024 <= bounds[0] <= bounds[1] <= 65535:
        raise ConfigError(f"{PORTS_VARIABLE}={value!r}: must be LOW-HIGH, two ports with 1024 <= LOW <= HIGH <= 65535")
    return bounds


def free_ports(count: int, host: str = "127.0.0.1", ephemeral: Optional[Tuple[int, int]] = None) -> List[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now, chosen outside the
    kernel's ephemeral range where it can be read. A port from that range, once released, can
    become the local end of any outgoing connection on the machine before its rank binds it (the
    run's own connections, or an outsider's hundreds: a launch then failed with "in use"). With
    :data:`PORTS_VARIABLE` set, only from its range: :class:`ConfigError` where too few are free."""
    allowed = allowed_ports(os.environ.get(PORTS_VARIABLE))
    if allowed is not None:
        chosen = _bindable(
            random.SystemRandom().sample(range(allowed[0], allowed[1] + 1), allowed[1] - allowed[0] + 1), count, host
        )
        if chosen is None:
            raise ConfigError(f"{PORTS_VARIABLE}={os.environ[PORTS_VARIABLE]!r}: fewer than {count} free ports in it")
        return chosen
    ephemeral = ephemeral if ephemeral is not None else ephemeral_range()
    if ephemeral is not None:
        low, high = ephemeral
        outside = [*range(LOWEST_CHOSEN_PORT, low), *range(max(LOWEST_CHOSEN_PORT, high + 1), 65536)]
        if len(outside) >= 10 * count:
            chosen = _bindable(random.SystemRandom().sample(outside, min(len(outside), 50 * count)), count, host)
            if chosen is not None:
                return chosen
    sockets = []  # the kernel's choice: any free port
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _bindable(candidates: Sequence[int], count: int, host: str) -> Optional[List[int]]:
    """The first ``count`` of ``candidates`` that ``host`` can bind now, or None."""
    chosen: List[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    return None


def write_ipconfig(
    path: str,
    ranks: int,
    host: str = "127.0.0.1",
    ports: Optional[Sequence[int]] = None,
    hosts: Optional[Sequence[str]] = None,
) -> str:
    """Write FedML's gRPC address file: rank r (0 = server) listens on ``hosts[r]:ports[r]``
    (``host`` for every rank when ``hosts`` is not given). Written whole and then renamed into
    place: a process that reads it meanwhile (a silo, another organization) sees every row or no
    file, never the first rows alone."""
    hosts = list(hosts) if hosts is not None else [host] * ranks
    ports = list(ports) if ports is not None else free_ports(ranks, host)
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        with open(partial, "w", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(IPCONFIG_FIELDS)
            for rank in range(ranks):
                writer.writerow([rank, rank, hosts[rank], ports[rank]])
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def read_ipconfig(path: str, ranks: Optional[int] = None) -> Dict[int, Tuple[str, int]]:
    """rank -> (ip, port) from the address file. FedML keys each process by the ``eid`` column,
    so a row's ``eid`` and ``rank`` must agree. Every rank 0..ranks-1 must have a row (when
    ``ranks`` is given); an eid given twice, or two ranks on one address, are refused, naming the
    lines."""
    where = f"comm_args.grpc_ipconfig_path={path!r}"
    try:
        with open(path, newline="") as stream:
            rows = list(csv.DictReader(stream))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"{where}: cannot be read ({err})") from None
    if not rows or not set(IPCONFIG_FIELDS) <= set(rows[0]):
        raise ConfigError(f"{where}: must be a CSV with the header {','.join(IPCONFIG_FIELDS)}")
    table: Dict[int, Tuple[str, int]] = {}
    line_of: Dict[int, int] = {}
    rank_at: Dict[Tuple[str, int], int] = {}
    for number, row in enumerate(rows, start=2):
        try:
            eid, rank = int(row["eid"]), int(row["rank"])
            ip, port = str(ipaddress.ip_address((row["grpc_server_ip"] or "").strip())), int(row["grpc_server_port"])
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: line {number}: {err}") from None
        if not 0 < port < 65536:
            raise ConfigError(f"{where}: line {number}: port {port} is not in 1..65535")
        if eid != rank:
            raise ConfigError(
                f"{where}: line {number}: eid {eid} but rank {rank}; FedML keys each process by the "
                f"eid column, so give eid = rank"
            )
        if eid in table:
            raise ConfigError(
                f"{where}: lines {line_of[eid]} and {number} both give eid {eid} (the column FedML "
                f"keys each process by); give each rank one row"
            )
        if (ip, port) in rank_at:
            raise ConfigError(
                f"{where}: line {number}: rank {eid} and rank {rank_at[ip, port]} (line "
                f"{line_of[rank_at[ip, port]]}) share {ip}:{port}; give each rank its own port"
            )
        table[eid], line_of[eid], rank_at[ip, port] = (ip, port), number, eid
    missing = [r for r in range(ranks or 0) if r not in table]
    if missing:
        raise ConfigError(
            f"{where}: no row for rank(s) {missing}; a row is needed for the server (0) and every "
            f"silo (1..{(ranks or 0) - 1}), or FedML would listen on all interfaces"
        )
    return table
