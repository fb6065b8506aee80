"""Cross-silo deployment on one machine: the gRPC address file and the ``launch-silo`` launcher.

    fedml-perfedavg launch-silo --cf CONFIG.yaml [--clients N] [--set KEY=VALUE ...]

starts one server and N silo processes (``fedml-perfedavg --rank R --role server|client``) on
127.0.0.1, waits until the server listens before starting the silos, prefixes each line of
their output with its rank, and exits non-zero if any process failed.
"""
from __future__ import annotations

import argparse
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
from .config import load
from .runner import resolve_run_dir
from .silo_addresses import write_ipconfig

logger = logging.getLogger(__name__)

# Forced on every process the launcher starts (the YAML may be a simulation config); progress
# comes from the server's log lines.
SILO_SETTINGS = ("training_type=cross_silo", "backend=GRPC", "show_progress=false")


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
