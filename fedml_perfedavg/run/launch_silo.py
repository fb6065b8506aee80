"""Cross-silo deployment on one machine: the gRPC address file and the ``launch-silo`` launcher.

    fedml-perfedavg launch-silo --cf CONFIG.yaml [--clients N] [--set KEY=VALUE ...]

starts one server and N silo processes (``fedml-perfedavg --rank R --role server|client``) on
127.0.0.1, waits until the server says it listens (in its state file, RUN_DIR/server_state.json:
see silo/server/readiness.py) before starting the silos, prefixes each
line of their output with its rank, and exits non-zero if any process failed. A silo that
fails is reported at once; SIGINT and SIGTERM are forwarded to every process, which write what
they measured before they end.

In data-owner mode (``comm_args.silo_data: own``) there is a silo per user and each is handed
its own folder: ``data_cache_dir`` itself when it is an export (``fedml-perfedavg export-split``),
else the split exported into the run directory first; the server gets an empty folder.
Without ``comm_args.tls_dir`` the launcher makes the run's certificates in ``RUN_DIR/tls`` (the
CA's key is never written, so nobody can issue another) and removes them when the run is over.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence

from ..core.errors import ConfigError, OutputError
from ..net.credentials import make_certificates
from .. import logs
from ..stopping import EXIT_STOPPED, StopRequested, StopSignals
from .options import add_config_options
from .config import load, load_yaml, parse_overrides
from .files import write_json
from .runner import remove_if_never_started, resolve_run_dir
from ..net.addresses import read_ipconfig, write_ipconfig
from ..silo.server import readiness

logger = logging.getLogger(__name__)

# Forced on every process the launcher starts (the YAML may be a simulation config); progress
# comes from the server's log lines.
SILO_SETTINGS = ("training_type=cross_silo", "backend=GRPC", "show_progress=false")
# After SIGTERM a process that still uses the CPU is still writing what it measured (the model,
# its record, the word to the silos; under load that took over 10 s): it is waited for, up to
# STOP_BUSY_SECONDS. One that has used no CPU for STOP_IDLE_SECONDS is stuck: killed and named.
STOP_IDLE_SECONDS = 10.0
STOP_BUSY_SECONDS = 300.0


def _name(rank: int) -> str:
    return "the server" if rank == 0 else f"silo rank {rank}"


class ServerState:
    """What the server's state file says (:mod:`~fedml_perfedavg.silo.server.readiness`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.exists(path):
            os.remove(path)  # an earlier launch's, in a reused run directory

    def listening(self) -> bool:
        return readiness.read(self.path) is not None

    def training_started(self) -> bool:
        state = readiness.read(self.path)
        return state in readiness.TRAINING_STATES or state == "done"


def _cpu_seconds(pid: int) -> Optional[float]:
    """CPU time ``pid`` has used so far (Linux's /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            fields = stream.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _wait_ready(state: ServerState, process: subprocess.Popen, what: str, timeout: float, stop: StopSignals) -> None:
    """Until the server says it listens (its state file, not any listener on the port). Its start
    (imports, loading the model) is not a network wait: on a loaded machine it can take longer than
    ``timeout`` (comm_args.connect_timeout), so the wait goes on while the server runs and uses the
    CPU, saying so every ``timeout`` seconds; it fails when the server exits, or has used no CPU for
    ``timeout`` seconds (it is stuck)."""
    started = last_progress = next_note = time.monotonic()
    next_note += timeout
    last_cpu = _cpu_seconds(process.pid)
    while not state.listening():
        stop.sleep(0.1)
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it listened on {what}")
        now, cpu = time.monotonic(), _cpu_seconds(process.pid)
        if cpu is not None and last_cpu is not None and cpu > last_cpu:
            last_cpu, last_progress = cpu, now
        if now - last_progress > timeout:
            raise RuntimeError(
                f"the server did not listen on {what}: it has used no CPU for {now - last_progress:.0f} s "
                f"(comm_args.connect_timeout={timeout:g}); it is stuck"
            )
        if now >= next_note:
            next_note += timeout
            logger.info(
                "the server is still starting (%.0f s; it is busy, %.1f s of CPU): waiting for it to listen on %s",
                now - started,
                last_cpu or 0.0,
                what,
            )


def stop_processes(processes: Dict[int, subprocess.Popen]) -> None:
    """SIGTERM to every process (rank -> process) still running, then wait for each while it
    uses the CPU; one that has used none for STOP_IDLE_SECONDS, or is still running
    STOP_BUSY_SECONDS after the signal, is killed and named (its record may be incomplete)."""
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    progress = {rank: (_cpu_seconds(p.pid), started) for rank, p in processes.items()}
    while True:
        running = {rank: p for rank, p in processes.items() if p.poll() is None}
        if not running:
            return
        time.sleep(0.1)
        now = time.monotonic()
        for rank, process in running.items():
            cpu, (last_cpu, last_progress) = _cpu_seconds(process.pid), progress[rank]
            if cpu is not None and (last_cpu is None or cpu > last_cpu):
                progress[rank], last_progress = (cpu, now), now
            stuck, too_long = now - last_progress > STOP_IDLE_SECONDS, now - started > STOP_BUSY_SECONDS
            if (stuck or too_long) and process.poll() is None:
                why = (
                    f"no CPU used for {STOP_IDLE_SECONDS:g} s" if stuck else f"still busy after {STOP_BUSY_SECONDS:g} s"
                )
                logger.error("%s did not stop after SIGTERM (%s): killed", _name(rank), why)
                process.kill()
                process.wait()


def _end_with_parent() -> None:
    """In a child: SIGTERM when the launcher dies, even by SIGKILL, so no process is left behind
    (Linux's PR_SET_PDEATHSIG; elsewhere only SIGINT and SIGTERM are forwarded)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _stream(process: subprocess.Popen, prefix: str, lock: threading.Lock) -> threading.Thread:
    """Copy the process's lines to stdout with ``prefix``."""

    def pump() -> None:
        assert process.stdout is not None  # started with stdout=PIPE
        for line in process.stdout:
            with lock:
                sys.stdout.write(f"{prefix} {line}")
                sys.stdout.flush()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def launch(
    config_path: str,
    overrides: Sequence[str] = (),
    clients: Optional[int] = None,
    run_dir: Optional[str] = None,
    server_delay: Optional[float] = None,
    grace_seconds: float = 30.0,
) -> int:
    """Start a server and ``clients`` silos on this machine, stream their output, and return 0
    if every process succeeded (1 otherwise)."""
    overrides = [*overrides, *SILO_SETTINGS]
    given = {k: v for section in load_yaml(config_path).values() for k, v in section.items()}
    given.update(parse_overrides(overrides))
    make_certs = not given.get("tls_dir") and not given.get("insecure")
    config = load(config_path, [*overrides, "tls_dir=made-below"] if make_certs else overrides)
    from .assembly import check_extras

    check_extras(config)  # here, before the certificates (cryptography) and the processes
    clients = config.silo_count if clients is None else clients
    if clients != config.silo_count:
        if config.own_data:
            raise ConfigError(
                f"train_args.client_num_in_total={config.train.client_num_in_total!r}: must equal --clients "
                f"({clients}): in data-owner mode (comm_args.silo_data own) each silo owns one user"
            )
        raise ConfigError(
            f"train_args.client_num_per_round={config.train.client_num_per_round!r}: must equal --clients "
            f"({clients}): each silo trains one sampled user per round"
        )
    run_dir = resolve_run_dir(config, run_dir, create=False)
    existed = os.path.isdir(run_dir)
    run_dir = resolve_run_dir(config, run_dir, owner=False)  # the server it starts owns (and holds) the record
    tls_dir = None
    if make_certs:  # one command still: this run's own CA and certificates, in its run directory
        tls_dir = os.path.join(run_dir, "tls")
        make_certificates(tls_dir, clients, overwrite=True, keep_ca_key=False)
        overrides = [*overrides, f"tls_dir={tls_dir}"]
        logger.info(
            "certificates for ranks 0..%d made in %s (comm_args.tls_dir; the CA's key was not kept, and the "
            "folder goes when the run is over)",
            clients,
            tls_dir,
        )
    try:
        return _launch(config, config_path, overrides, clients, run_dir, server_delay, grace_seconds)
    finally:
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)
        if not existed and not os.path.exists(os.path.join(run_dir, "summary.json")):
            # Stopped (or failed) before the server recorded anything: only start-up files are there
            # (the address file, the processes' ids, an exported split).
            remove_if_never_started(run_dir)
            logger.info("nothing was measured: the run directory %s was removed", run_dir)


def own_folders(config, run_dir: str, clients: int) -> Dict[int, str]:
    """Data-owner mode: each rank's data folder (the server's is empty)."""
    from ..data.silo_folder import folder_of, is_export
    from .runner import load_split
    from .silo_data import export_split

    root = config.data.data_cache_dir
    if not is_export(root):
        root = os.path.join(run_dir, "silo-data")
        shutil.rmtree(root, ignore_errors=True)
        export_split(config, root, load_split)
        logger.info("the split exported to %s: each silo gets its own folder", root)
    folders = {rank: folder_of(root, rank) for rank in range(1, clients + 1)}
    folders[0] = os.path.join(run_dir, "server-data-none")
    os.makedirs(folders[0], exist_ok=True)
    return folders


def _command(config_path: str, run_dir: str, overrides: List[str], ipconfig: str) -> List[str]:
    """Every process's command line, less its rank and role; a run id of its own, so that a
    message of another run (another launch) is refused."""
    sets = [*overrides, f"grpc_ipconfig_path={os.path.abspath(ipconfig)}"]
    return [
        sys.executable,
        "-m",
        "fedml_perfedavg",
        "--cf",
        config_path,
        "--run-dir",
        run_dir,
        *[a for s in sets for a in ("--set", s)],
        "--run_id",
        uuid.uuid4().hex[:16],
    ]


def threads_per_process(processes: int) -> int:
    """Each of ``processes`` processes' share of this machine's cores, as torch threads (at least 1).

    torch would otherwise start one thread per core in every process, and they would fight. The
    share also decides the float order of some CPU kernels (MKL splits a small matrix product's
    sum over its threads), so a single-process run gives a launch's model bit for bit only when it
    runs with this many threads (docs/backends.md, "Same model on every backend")."""
    return max(1, (os.cpu_count() or 1) // processes)


class SiloProcesses:
    """One launch's processes: each started with ``command``, its rank and role (a data owner
    with its own folder), its share of the machine's cores, and its output streamed with a prefix."""

    def __init__(self, command: List[str], folders: Dict[int, str], clients: int, run_dir: str) -> None:
        self.command, self.folders, self.run_dir = command, folders, run_dir
        share = str(threads_per_process(clients + 1))
        self.threads = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", share),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", share),
        }
        self.lock = threading.Lock()
        self.processes: Dict[int, subprocess.Popen] = {}
        self.pumps: List[threading.Thread] = []
        self.server_state = ServerState(os.path.join(run_dir, "server_state.json"))

    def start(self, rank: int) -> None:
        role = "server" if rank == 0 else "client"
        own = ["--set", f"data_cache_dir={self.folders[rank]}"] if rank in self.folders else []
        self.processes[rank] = subprocess.Popen(
            self.command + own + ["--rank", str(rank), "--role", role],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                **self.threads,
                **({readiness.STATE_FILE_VARIABLE: self.server_state.path} if rank == 0 else {}),
            },
            # Its own session: a terminal's Ctrl-C reaches the launcher alone, which stops each
            # process once (two signals at once interrupted a process while it handled the first).
            start_new_session=True,
            preexec_fn=_end_with_parent,
        )
        self.pumps.append(_stream(self.processes[rank], "[server]" if rank == 0 else f"[silo {rank}]", self.lock))
        pids = {str(r): p.pid for r, p in self.processes.items()}
        write_json(os.path.join(self.run_dir, "silo_processes.json"), pids)

    def stop(self) -> None:
        """Stop every process (:func:`stop_processes`) and keep the output they wrote before they ended."""
        stop_processes(self.processes)
        deadline = time.monotonic() + 5.0
        for pump in self.pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))


def _launch(
    config,
    config_path: str,
    overrides: List[str],
    clients: int,
    run_dir: str,
    server_delay: Optional[float],
    grace_seconds: float,
) -> int:
    folders = own_folders(config, run_dir, clients) if config.own_data else {}
    ipconfig = config.comm.grpc_ipconfig_path or write_ipconfig(os.path.join(run_dir, "grpc_ipconfig.csv"), clients + 1)
    addresses = read_ipconfig(ipconfig, clients + 1)
    launched = SiloProcesses(_command(config_path, run_dir, overrides, ipconfig), folders, clients, run_dir)
    processes = launched.processes
    logger.info(
        "run %s: server + %d silos on %s",
        run_dir,
        clients,
        ", ".join(f"{ip}:{port}" for ip, port in addresses.values()),
    )
    with StopSignals() as stop:
        try:
            if server_delay is None:
                launched.start(0)
                _wait_ready(
                    launched.server_state, processes[0], "%s:%d" % addresses[0], config.comm.connect_timeout, stop
                )
                for rank in range(1, clients + 1):
                    launched.start(rank)
            else:  # silos first: they retry until the server listens
                for rank in range(1, clients + 1):
                    launched.start(rank)
                stop.sleep(server_delay)
                launched.start(0)
            _watch(processes, config.comm.min_clients_per_round or clients, launched.server_state, stop)
            # Silos end on their own after a finished run; after a failed one they may wait in vain.
            deadline = time.monotonic() + (grace_seconds if processes[0].returncode == 0 else 5.0)
            while time.monotonic() < deadline and any(p.poll() is None for p in processes.values()):
                stop.sleep(0.2)
        except StopRequested:
            logger.warning("interrupted (%s): stopping every process", stop.name)
            return_code = stop.exit_status
        except RuntimeError as err:
            logger.error("%s", err)
            return_code = 1
        else:
            return_code = 0
        finally:
            launched.stop()
    return _exit_code(processes, return_code, run_dir)


def _exit_code(processes: Dict[int, subprocess.Popen], return_code: int, run_dir: str) -> int:
    """The launcher's exit status, naming every process that failed (one stopped as asked did not)."""
    failed = {rank: p.returncode for rank, p in sorted(processes.items()) if p.returncode != 0}
    # how a process ends when told to stop: by the signal, or a silo told by its stopping server first
    stopped = (130, 143, -signal.SIGTERM, -signal.SIGINT, EXIT_STOPPED)
    if return_code in (130, 143) and all(code in stopped for code in failed.values()):
        logger.info("every process stopped as asked; what was measured is in %s", run_dir)
        return return_code
    if return_code == 0 and failed and set(failed.values()) == {EXIT_STOPPED}:
        logger.warning(
            "the server stopped the run early (exit code %d); what was measured is in %s", EXIT_STOPPED, run_dir
        )
        return EXIT_STOPPED
    for rank, code in failed.items():
        logger.error("%s exited with code %s", _name(rank), code)
    if failed:  # the whole picture, for whoever reads why the run failed
        logger.info("exit codes: %s", ", ".join(f"{_name(r)} {p.returncode}" for r, p in sorted(processes.items())))
    if return_code == 0 and not failed:
        logger.info("all %d processes finished; results in %s", len(processes), run_dir)
    return return_code or (1 if failed else 0)


def _watch(processes: Dict[int, subprocess.Popen], min_clients: int, state: ServerState, stop: StopSignals) -> None:
    """Until the server exits. A silo that fails is reported at once. Before training starts
    (the server would wait comm_args.connect_timeout for it), a failure that leaves fewer silos
    than the run needs stops the run at once; later the server's round deadline handles it and
    records the silo as lost."""
    failed: Dict[int, int] = {}
    silos = len(processes) - 1
    while processes[0].poll() is None:
        for rank, process in processes.items():
            code = process.poll()
            if rank and code not in (None, 0) and rank not in failed:
                failed[rank] = code
                logger.error("silo rank %d exited with code %s while the server runs", rank, code)
                if not state.training_started() and silos - len(failed) < min_clients:
                    raise RuntimeError(
                        f"silo rank(s) {sorted(failed)} failed at start; {silos - len(failed)} left, "
                        f"fewer than comm_args.min_clients_per_round={min_clients}: stopping the run"
                    )
        stop.sleep(0.2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedml-perfedavg launch-silo",
        description="Run a cross-silo (gRPC) experiment: a server and N silos on 127.0.0.1.",
    )
    add_config_options(parser)
    parser.add_argument(
        "--clients",
        type=int,
        help="number of silos (default: client_num_per_round, or client_num_in_total with comm_args.silo_data own)",
    )
    parser.add_argument("--run-dir", help="output directory shared by all processes")
    parser.add_argument(
        "--server-delay",
        type=float,
        metavar="SECONDS",
        help="start the silos first and the server this much later (they retry until it listens)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    with logs.as_found_afterwards():
        logs.use_console("INFO")
        return _launch_reporting_errors(args)


def _launch_reporting_errors(args: argparse.Namespace) -> int:
    try:
        return launch(args.config, args.overrides, args.clients, args.run_dir, args.server_delay)
    except (ConfigError, FileNotFoundError) as err:
        print(f"fedml-perfedavg launch-silo: error: {err}", file=sys.stderr)
        return 2
    except OutputError as err:
        print(f"fedml-perfedavg launch-silo: error: {err}", file=sys.stderr)
        return 1
