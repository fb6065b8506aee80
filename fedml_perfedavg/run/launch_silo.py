"""Cross-silo deployment on one machine: the gRPC address file and the ``launch-silo`` launcher.

    fedml-perfedavg launch-silo --cf CONFIG.yaml [--clients N] [--set KEY=VALUE ...]

starts one server and N silo processes (``fedml-perfedavg --rank R --role server|client``) on
127.0.0.1, waits until the server listens before starting the silos, prefixes each line of
their output with its rank, and exits non-zero if any process failed.
"""
from __future__ import annotations

import argparse
import csv
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.guards import ConfigError
from .config import Config, load

logger = logging.getLogger(__name__)

IPCONFIG_FIELDS = ("eid", "rank", "grpc_server_ip", "grpc_server_port")
# Forced on every process the launcher starts (the YAML may be a simulation config); progress
# comes from the server's log lines.
SILO_SETTINGS = ("training_type=cross_silo", "backend=GRPC", "show_progress=false")


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


def _wait_listening(address: Tuple[str, int], process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it listened")
        try:
            with socket.create_connection(address, timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not listen on {address[0]}:{address[1]} within {timeout:g} s")


def _stream(process: subprocess.Popen, prefix: str, lock: threading.Lock) -> threading.Thread:
    def pump() -> None:
        for line in process.stdout:
            with lock:
                sys.stdout.write(f"{prefix} {line}")
                sys.stdout.flush()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def launch(config_path: str, overrides: Sequence[str] = (), clients: Optional[int] = None,
           run_dir: Optional[str] = None, server_delay: Optional[float] = None,
           grace_seconds: float = 30.0) -> int:
    """Start a server and ``clients`` silos on this machine, stream their output, and return 0
    if every process succeeded (1 otherwise)."""
    from .runner import resolve_run_dir

    overrides = [*overrides, *SILO_SETTINGS]
    config = load(config_path, overrides)
    clients = config.client_num_per_round if clients is None else clients
    if clients != config.client_num_per_round:
        raise ConfigError(f"train_args.client_num_per_round={config.client_num_per_round!r}: must equal --clients "
                          f"({clients}): each silo trains one sampled user per round")
    run_dir = resolve_run_dir(config, run_dir)
    ipconfig = config.grpc_ipconfig_path or write_ipconfig(os.path.join(run_dir, "grpc_ipconfig.csv"), clients + 1)
    addresses = read_ipconfig(ipconfig, clients + 1)
    command = [sys.executable, "-m", "fedml_perfedavg", "--cf", config_path, "--run-dir", run_dir,
               *[a for s in [*overrides, f"grpc_ipconfig_path={os.path.abspath(ipconfig)}"] for a in ("--set", s)]]
    # The processes share this machine's cores: each gets its share of threads (torch would
    # otherwise start one per core in every process and they would fight over them).
    share = str(max(1, (os.cpu_count() or 1) // (clients + 1)))
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", share),
               "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", share)}
    lock = threading.Lock()
    processes: Dict[int, subprocess.Popen] = {}
    pumps: List[threading.Thread] = []

    def start(rank: int) -> None:
        role = "server" if rank == 0 else "client"
        processes[rank] = subprocess.Popen(command + ["--rank", str(rank), "--role", role],
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1", **threads})
        pumps.append(_stream(processes[rank], "[server]" if rank == 0 else f"[silo {rank}]", lock))
        with open(os.path.join(run_dir, "silo_processes.json"), "w") as stream:
            json.dump({str(r): p.pid for r, p in processes.items()}, stream)

    def stop_all() -> None:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()

    def on_sigterm(signum, frame):  # forwarded to every child by stop_all, as SIGINT is
        raise KeyboardInterrupt

    previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    logger.info("run %s: server + %d silos on %s", run_dir, clients,
                ", ".join(f"{ip}:{port}" for ip, port in addresses.values()))
    try:
        if server_delay is None:
            start(0)
            _wait_listening(addresses[0], processes[0], config.connect_timeout)
            for rank in range(1, clients + 1):
                start(rank)
        else:  # silos first: they retry until the server listens
            for rank in range(1, clients + 1):
                start(rank)
            time.sleep(server_delay)
            start(0)
        processes[0].wait()
        # Silos end on their own after a finished run; after a failed one they may wait in vain.
        deadline = time.monotonic() + (grace_seconds if processes[0].returncode == 0 else 5.0)
        while time.monotonic() < deadline and any(p.poll() is None for p in processes.values()):
            time.sleep(0.2)
    except KeyboardInterrupt:
        logger.warning("interrupted (SIGINT or SIGTERM): stopping every process")
        return_code = 130
    except RuntimeError as err:
        logger.error("%s", err)
        return_code = 1
    else:
        return_code = 0
    finally:
        stop_all()
        for pump in pumps:
            pump.join(timeout=5)
        signal.signal(signal.SIGTERM, previous_sigterm)
    failed = {rank: p.returncode for rank, p in sorted(processes.items()) if p.returncode != 0}
    for rank, code in failed.items():
        logger.error("%s exited with code %s", "the server" if rank == 0 else f"silo rank {rank}", code)
    if return_code == 0 and not failed:
        logger.info("all %d processes finished; results in %s", len(processes), run_dir)
    return return_code or (1 if failed else 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedml-perfedavg launch-silo",
                                     description="Run a cross-silo (gRPC) experiment: a server and N silos on "
                                                 "127.0.0.1.")
    parser.add_argument("--cf", "--yaml_config_file", dest="config", required=True, help="FedML-style YAML config")
    parser.add_argument("--clients", type=int, help="number of silos (default: train_args.client_num_per_round)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    parser.add_argument("--run-dir", help="output directory shared by all processes")
    parser.add_argument("--server-delay", type=float, metavar="SECONDS",
                        help="start the silos first and the server this much later (they retry until it listens)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launch-silo: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return launch(args.config, args.overrides, args.clients, args.run_dir, args.server_delay)
    except (ConfigError, FileNotFoundError) as err:
        print(f"fedml-perfedavg launch-silo: error: {err}", file=sys.stderr)
        return 2
