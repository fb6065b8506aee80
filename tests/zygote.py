"""Fork servers for the processes the tests start as ``python -m fedml_perfedavg ...`` or ``python SCRIPT``.

Why: a test's cross-silo run is several processes, and each fresh interpreter spends about 2 s of
CPU importing torch, FedML and gRPC before it does anything (2026-11-28: 213 such processes in a
suite, about a third of its CPU). Under pytest-xdist each worker starts a server process
(``python -m tests.zygote PATH plugin``) that imports them once and then forks a child for each
such command a test starts: the child takes the command's stdin/stdout/stderr, working directory,
environment and session, runs ``fedml_perfedavg``'s ``__main__`` (or the lying-silo script) as ``python -m``
would, and ends as the interpreter would (non-daemon threads joined, atexit run, streams flushed).
It is a real process with its own pid, signals, process group, exit status and command line
(/proc/PID/cmdline, written over the server's), which the test reads through an ordinary
``subprocess.Popen`` (:class:`ForkedPopen`, installed by conftest.py).

A command under ``ip netns exec NAME`` is forked too: the child enters the network namespace
itself (``setns`` on ``/run/netns/NAME``, as ``ip`` does before it execs), so its sockets live
there as they would under ``ip``. What ``ip netns exec`` adds besides (a mount namespace with the
namespace's own ``/sys`` and ``/etc/netns/NAME`` files) no test's process reads.

The ranks of ``mpirun -n N python -m fedml_perfedavg ...`` (or ``python -c CODE ...``, the tests'
network guard around the command line) are forked too: mpirun (a fresh process, with whatever
wraps it, ``unshare -n`` included) starts a small stand-in for each rank instead
(tests/zygote_rank.py, standard library only), which hands the fork server the rank's streams,
its PMI socket (MPICH's ``PMI_FD``, at the same number) and its network namespace, forwards the
signals mpirun sends, ends with the rank's status, and takes the rank with it if it is killed.

Scripts (FedML's example scripts, the user's one-file scripts, ``python -c GUARD --script
SCRIPT``, under mpirun too) are what their tests check: that the one import works in whichever
order a user writes it. They are forked from a second server per worker, the *libraries* one,
which imported torch and the third-party packages FedML's modules import (torchvision, wandb,
scipy, pandas, ...: 6 s of CPU that every user's program spends at ``import fedml``, the plugin
deferring them in its own command line alone): neither the plugin nor FedML is loaded when the
script starts, so the script imports them in its own order as a fresh interpreter would
(tests/test_zygote.py checks it). matplotlib, which writes its caches under HOME, is not preloaded
there.

What keeps a fresh interpreter (:func:`forkable` says no): any other program, ``python -c CODE``
without a script (the import-cost and layout tests, which read what a fresh interpreter loads),
commands under ``unshare`` or ``prlimit``, python flags, ``preexec_fn``, ``pass_fds``, and an
environment that differs in what is read while importing (thread counts, ``TORCH_*`` and
``PYTHON*`` variables, coverage). ``TESTS_FRESH_PROCESSES=1`` turns the servers off; without
pytest-xdist they are off too. A forked child asks the same servers for the processes it starts:
``launch-silo``'s silos, whose ``preexec_fn`` (PR_SET_PDEATHSIG) the server keeps as a SIGTERM when
the launcher's connection closes (:func:`_ends_with_parent`); a launcher that started fresh (under
``unshare`` or ``prlimit``) starts fresh ones.
"""

from __future__ import annotations

import atexit
import builtins
import fcntl
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
LIAR = REPO / "tests" / "backends" / "lying_silo.py"
PROBE = REPO / "tests" / "zygote_probe.py"  # what tests/test_zygote.py compares with a fresh interpreter
RANK = REPO / "tests" / "zygote_rank.py"  # what mpirun starts for a forked rank
SWITCH = "TESTS_FRESH_PROCESSES"
FreshPopen = subprocess.Popen  # before conftest.py puts ForkedPopen in its place

# What a silo, a server or a single-process run imports before its first round: imported once,
# in the plugin's server, in this order (a user's `import fedml_perfedavg` first, then FedML, as
# the command line does).
PLUGIN = "plugin"
LIBRARIES = "libraries"  # scripts: what they import before the plugin or FedML, and nothing of those
PRELOAD = {
    PLUGIN: (
        "torch",
        "fedml_perfedavg",
        "fedml_perfedavg.command",  # the command line: takes the process (import_cost.take_process)
        "fedml_perfedavg.run.runner",
        "fedml",
        "grpc",
        "fedml_perfedavg.fedml_bridge.cross_silo.transport",
        "matplotlib.figure",  # accuracy.png at every run's end (run/plot.py)
        "matplotlib.backends.backend_agg",
        # a DP-SGD run's accountants (core/accounting.py imports them before its first round):
        # Opacus and SciPy, 1.1 s of CPU in each such process
        "opacus.accountants",
        "opacus.accountants.analysis.rdp",
        "threadpoolctl",
    ),
    # torch, and the packages FedML's modules import (fedml_bridge/bootstrap.py's list, which a
    # user's program imports in full: the plugin defers them in its own command line alone), but
    # for matplotlib (its caches go under HOME); nothing of FedML, the plugin or gRPC
    LIBRARIES: (
        "torch",
        "torchvision",
        "wandb",
        "scipy",
        "pandas",
        "sqlalchemy",
        "docker",
        "boto3",
        "fastapi",
        "gevent",
        "git",
        "h5py",
        "httpx",
        "redis",
        "sentry_sdk",
    ),
}

# Read while the preloaded modules are imported (OpenMP's thread count when torch loads it, the
# interpreter's own PYTHON* settings, coverage's start-up hook): a command whose value differs
# from the server's gets a fresh interpreter.
_IMPORT_TIME = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "COVERAGE_PROCESS_START", "LD_PRELOAD", "LD_LIBRARY_PATH")
_PYTHON_RUNTIME = ("PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONPATH")
# the server's own PYTHONPATH entries, replaced in each child by the command's
_PYTHONPATH_AT_START = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _import_time_environment(env) -> dict:
    found = {
        key: value
        for key, value in env.items()
        if key in _IMPORT_TIME or key.startswith("TORCH_") or (key.startswith("PYTHON") and key not in _PYTHON_RUNTIME)
    }
    if found.get("MKL_NUM_THREADS") == found.get("OMP_NUM_THREADS"):
        found.pop("MKL_NUM_THREADS", None)  # unset, MKL follows OMP_NUM_THREADS (the launcher sets both)
    return found


# ----------------------------------------------------------------------------------- the server


def serve(path: str, kind: str) -> None:
    """Import ``PRELOAD[kind]``, listen on ``path`` and fork a child for each request until stdin
    closes (the pytest worker that started this process has ended)."""
    for name in PRELOAD[kind]:
        importlib.import_module(name)
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a fork would leave those threads behind, holding whatever they held
        print(f"not forking: the preloaded modules started {len(threads) - 1} threads", flush=True)
        return
    gc.collect()
    gc.freeze()  # the children share these pages instead of touching them
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    # a Ctrl-C meant for a test's process group must not end the server (and lose its children's
    # exit statuses); each child gets what a fresh interpreter would have (_become)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    waiting = {}  # pid -> the connection its exit status goes back on
    # a connection whose end ends its child -> (the child's pid, the signal): a rank's stand-in's
    # (SIGKILL: the rank ends with it) and a launcher's for its silos (SIGTERM: PR_SET_PDEATHSIG's)
    tied = {}
    print("ready", flush=True)
    while True:
        readable = select.select([listener, wake_read, sys.stdin, *tied], [], [])[0]
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return
        for connection in [c for c in readable if c in tied]:
            pid, ending = tied.pop(connection)  # the other side sends nothing more: it has ended
            if waiting.get(pid) is connection:
                os.kill(pid, ending)
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            _reap(waiting, tied)
        if listener in readable:
            connection, _ = listener.accept()
            try:
                _fork_one(connection, waiting, tied, closing=[listener, wake_read, wake_write])
            except OSError:  # the test that asked has gone; nothing was started for it
                connection.close()


def _reap(waiting: dict, tied: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            tied.pop(connection, None)
            try:
                connection.send(str(status).encode())
            except OSError:
                pass
            connection.close()


def _fork_one(connection: socket.socket, waiting: dict, tied: dict, closing: list) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 8)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            for item in [*closing, *waiting.values(), *tied]:
                if isinstance(item, int):
                    os.close(item)
                else:
                    item.close()
            _become(request, fds, connection)
        except BaseException:  # noqa: BLE001  (a child must never return into the server's loop)
            try:
                traceback.print_exc()
            finally:
                os._exit(70)
    for fd in fds:
        os.close(fd)
    waiting[pid] = connection
    if request.get("tied"):
        tied[connection] = (pid, int(request["tied"]))
    connection.send(json.dumps({"pid": pid}).encode())


def _enter_network_namespace(name: str) -> None:
    """What ``ip netns exec NAME`` does before it execs the command: join the named namespace."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _join_network_namespace(fd, name)
    finally:
        os.close(fd)


def _join_network_namespace(fd: int, name: str) -> None:
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, clone_newnet) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")


# The server's command line ends in this many spaces: room where each child writes its own
# (/proc/PID/cmdline, which tests read to find a process or its --run_id), as setproctitle does.
COMMAND_ROOM = 8192


def _show_command(argv: List[str]) -> None:
    """This process's /proc/PID/cmdline becomes ``python ARGV``, as a fresh interpreter's is (NULs
    after it, to the end of the server's command line)."""
    import ctypes

    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end (proc(5), fields 48-49)
    shown = b"\0".join(os.fsencode(a) for a in [sys.executable, *argv])[: end - start - 1]
    ctypes.memmove(start, shown.ljust(end - start, b"\0"), end - start)


def _become(request: dict, fds: List[int], connection: socket.socket) -> None:
    """In the child: take the command's streams, place, environment and session, run it, end."""
    _show_command(request["argv"])
    if request.get("netns"):
        _enter_network_namespace(request["netns"])
    elif request.get("netns_fd") is not None:  # the asker's: a rank's stand-in under unshare -n, a launcher's
        _join_network_namespace(fds[request["netns_fd"]], "of the process that asked")
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    connection.close()
    if request["new_session"]:
        os.setsid()
    # each received descriptor to its number in the command's process: 0-2, then a rank's PMI
    # socket at the number its PMI_FD names; moved out of the way first, as one may hold another's number
    targets = {0: 0, 1: 1, 2: 2, **{int(number): index for number, index in request.get("fds_at", {}).items()}}
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in fds]
    for fd in fds:
        os.close(fd)
    for number, index in targets.items():
        os.dup2(moved[index], number, inheritable=number <= 2)
    for fd in moved:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # a fresh interpreter seeds from the OS, so children must not share a sequence: Python's random
    # reseeds itself in a forked child (os.register_at_fork), numpy's global generator does not
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # the processes this one starts (a launcher's silos) are forked by the same servers
    _Server.known(request.get("servers", {}))
    subprocess.Popen = ForkedPopen  # type: ignore[misc]
    if request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    argv = request["argv"]
    base = [p for p in sys.path[1:] if p not in _PYTHONPATH_AT_START]
    paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:] = [os.getcwd(), *paths, *base]
            sys.modules["__main__"] = types.ModuleType("__main__")  # not this server's namespace
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *paths, *base]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *paths, *base]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        # through sys.excepthook, as the interpreter does (the plugin's, in a user's script, prints
        # where the stopped run's record is and ends the process by the signal that stopped it)
        sys.excepthook(*sys.exc_info())
        _end(1, killed_by=signal.SIGINT)  # as the interpreter ends on an uncaught Ctrl-C
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
        code = 1
    _end(code)


def _finalize_mpi() -> None:
    """What mpi4py does at the interpreter's finalization (``Py_AtExit``, which ``os._exit`` skips): an
    MPI rank that ends without ``MPI_Finalize`` closes its PMI socket unfinished, and mpirun kills
    the whole job for it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end(code: int, killed_by: Optional[int] = None) -> None:
    """As the interpreter ends: wait for non-daemon threads, run atexit, flush the streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if killed_by is not None:
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    if "mpi4py.MPI" in sys.modules:  # MPICH says goodbye to mpirun in its C exit handler
        import ctypes

        ctypes.CDLL(None).exit(code)
    os._exit(code)


# ----------------------------------------------------------------------------------- the client


class _Server:
    """One of this worker's fork servers (``kind``: PRELOAD's key), started on first use; ``None``
    where it cannot start."""

    started: Dict[str, "_Server"] = {}
    failed: Set[str] = set()
    _starting = threading.Lock()  # tests may start processes from several threads at once

    process: Optional[subprocess.Popen]  # None in a forked child, which only asks

    def __init__(self, kind: str) -> None:
        folder = tempfile.mkdtemp(prefix=f"zygote-{kind}-")
        self.path = os.path.join(folder, "socket")
        # one OpenMP/BLAS thread unless the worker says otherwise (conftest.py gives each worker
        # one): with more, importing torch starts a BLAS thread, and the server refuses to fork
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        self.environment = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": threads}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.path, kind, " " * COMMAND_ROOM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=str(REPO),
            env=self.environment,
            text=True,
        )
        said = self.process.stdout.readline().strip() if self.process.stdout else ""
        if said != "ready":
            self.process.kill()
            raise RuntimeError(f"the tests' {kind} fork server did not start: {said or 'it ended'}")
        self.import_time = _import_time_environment(self.environment)
        atexit.register(self.close)

    def close(self) -> None:
        """At the worker's end: the server reads the end of its stdin, stops, and is waited for."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    @classmethod
    def known(cls, servers: Dict[str, List]) -> None:
        """In a forked child: the servers its parent's worker started (kind -> [path, import-time
        environment]), and no other: a child starts none of its own."""
        cls.started, cls.failed = {}, set(PRELOAD) - set(servers)
        for kind, (path, import_time) in servers.items():
            server = cls.__new__(cls)
            server.path, server.import_time, server.process = path, import_time, None
            cls.started[kind] = server

    @classmethod
    def addresses(cls) -> Dict[str, List]:
        """What :meth:`known` takes in a child: the servers started."""
        return {kind: [server.path, server.import_time] for kind, server in cls.started.items()}

    @classmethod
    def get(cls, kind: str) -> Optional["_Server"]:
        with cls._starting:
            return cls._get(kind)

    @classmethod
    def _get(cls, kind: str) -> Optional["_Server"]:
        if kind not in cls.started and kind not in cls.failed:
            try:
                cls.started[kind] = cls(kind)
            except (OSError, RuntimeError) as failure:
                cls.failed.add(kind)  # said once; every such command then gets a fresh interpreter
                print(f"tests/zygote.py: {failure}; processes start fresh", file=sys.stderr)
        server = cls.started.get(kind)
        if server is not None and server.process is not None and server.process.poll() is not None:
            print(f"tests/zygote.py: the {kind} fork server ended; processes start fresh", file=sys.stderr)
            del cls.started[kind]
            cls.failed.add(kind)
            return None
        return server


def enabled() -> bool:
    """Whether this pytest process forks its commands (a pytest-xdist worker, not switched off)."""
    return (
        os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw")
        and os.environ.get(SWITCH, "") != "1"
        and "COVERAGE_PROCESS_START" not in os.environ
    )


NETNS_EXEC = ["ip", "netns", "exec"]


def _kind(argv: List[str], rank: bool) -> Optional[str]:
    """Which server forks ``python ARGV`` (None: a fresh interpreter): the plugin's for
    ``-m fedml_perfedavg``, the lying silo and the probe, and (an MPI rank's) ``-c CODE`` that runs
    no script; the libraries' for a script (``python SCRIPT`` or ``-c CODE --script SCRIPT``)."""
    if argv[:2] == ["-m", "fedml_perfedavg"]:
        return PLUGIN
    if argv[0] == "-c":
        if "--script" in argv[2:]:
            return LIBRARIES
        return PLUGIN if rank else None
    if argv[0].startswith("-"):
        return None
    path = Path(argv[0]).resolve()
    if path in (LIAR, PROBE):
        return PLUGIN
    return LIBRARIES if path.suffix == ".py" and path.is_file() else None


def forkable(
    args, executable, shell, preexec_fn, pass_fds, env, cwd, **rest
) -> Optional[Tuple[List[str], str, "_Server"]]:
    """The command's arguments after the interpreter (``["-m", "fedml_perfedavg", ...]``, a
    script's), the network namespace it runs in ("" for this one) and the server that forks it, or
    None when it must start as a fresh interpreter."""
    if shell or preexec_fn is not None or pass_fds or executable not in (None, sys.executable):
        return None
    if any(value not in (None, -1, False, True) for value in rest.values()):  # uid, gid, umask, group
        return None
    if isinstance(args, (str, bytes)):
        return None
    args, netns = [str(a) for a in args], ""
    if args[:3] == NETNS_EXEC and len(args) > 4 and os.path.exists(f"/run/netns/{args[3]}"):
        args, netns = args[4:], args[3]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    argv = args[1:]
    kind = _kind(argv, rank=False)
    if kind is None:
        return None
    if cwd is not None and not os.path.isdir(cwd):
        return None  # Popen's own start says what is wrong with it
    server = _server_for(kind, env)
    if server is None:
        return None
    return argv, netns, server


def _server_for(kind: str, env) -> Optional["_Server"]:
    """This worker's ``kind`` fork server, where a command with environment ``env`` (None: this
    process's) may be forked from it: it has started, and the command reads at import what the
    server read."""
    server = _Server.get(kind)
    environment = os.environ if env is None else env
    if server is None or _import_time_environment(environment) != server.import_time:
        return None
    return server


MPIRUN_NAMES = ("mpirun", "mpiexec", "mpiexec.hydra")


def forkable_ranks(args, executable, shell, env) -> Optional[List[str]]:
    """``mpirun -n N python ...`` (whatever wraps mpirun) with each rank started by a fork server
    through tests/zygote_rank.py (the server :func:`_kind` names), or None."""
    if shell or executable is not None or isinstance(args, (str, bytes)):
        return None
    args = [str(a) for a in args]
    at = next((i for i, a in enumerate(args) if os.path.basename(a) in MPIRUN_NAMES), None)
    if at is None or args[at + 1 : at + 2] != ["-n"] or not args[at + 2 : at + 3] or not args[at + 2].isdigit():
        return None
    rank = args[at + 3 :]
    if len(rank) < 2 or rank[0] != sys.executable:
        return None
    argv = rank[1:]
    kind = _kind(argv, rank=True)
    server = None if kind is None else _server_for(kind, env)
    if server is None:
        return None
    return [*args[: at + 3], sys.executable, "-I", "-S", str(RANK), server.path, *argv]


def _ends_with_parent(preexec_fn) -> bool:
    """The launcher's ``preexec_fn`` (run/launch_silo.py: PR_SET_PDEATHSIG, SIGTERM when the launcher
    ends), which a forked child gets as the server's SIGTERM when the launcher's connection closes."""
    launcher = sys.modules.get("fedml_perfedavg.run.launch_silo")
    return launcher is not None and preexec_fn is getattr(launcher, "_end_with_parent", None)


class ForkedPopen(subprocess.Popen):
    """``subprocess.Popen`` that asks one of this worker's fork servers for the commands
    :func:`forkable` accepts; every other command starts as Popen starts it."""

    _link: Optional[socket.socket] = None  # the server's connection, until it sends the exit status
    _forked = False

    def _execute_child(  # type: ignore[override]
        self,
        args,
        executable,
        preexec_fn,
        close_fds,
        pass_fds,
        cwd,
        env,
        startupinfo,
        creationflags,
        shell,
        p2cread,
        p2cwrite,
        c2pread,
        c2pwrite,
        errread,
        errwrite,
        restore_signals,
        gid,
        gids,
        uid,
        umask,
        start_new_session,
        process_group,
    ):
        ends_with_parent = _ends_with_parent(preexec_fn)
        forked = forkable(
            args,
            executable,
            shell,
            None if ends_with_parent else preexec_fn,
            pass_fds,
            env,
            cwd,
            gid=gid,
            gids=gids,
            uid=uid,
            umask=umask,
            process_group=process_group,
        )
        if forked is None:
            args = forkable_ranks(args, executable, shell, env) or args
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group,
            )  # fmt: skip
        environment = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in (os.environ if env is None else env).items()
        }
        argv, netns, server = forked
        request = {
            "argv": argv,
            "netns": netns,
            "cwd": os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd(),
            "env": environment,
            "new_session": bool(start_new_session),
            # an exec'd interpreter keeps an ignored SIGINT (pytest-xdist's workers ignore it) and
            # otherwise installs its own handler
            "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
            "netns_fd": 3,  # this process's network namespace, where no named one is given
            "servers": _Server.addresses(),
            "tied": int(signal.SIGTERM) if ends_with_parent else 0,
        }
        namespace = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        streams = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
            namespace,
        ]
        link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            link.connect(server.path)
            socket.send_fds(link, [json.dumps(request).encode()], streams)
            answer = link.recv(4096)
        except OSError:
            link.close()
            raise
        finally:
            os.close(namespace)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if not answer:
            link.close()
            raise OSError(f"the tests' fork server did not start {args!r}")
        self.pid = json.loads(answer)["pid"]
        self._child_created = self._forked = True
        self._link = link

    def _try_wait(self, wait_flags):
        if not self._forked:
            return super()._try_wait(wait_flags)
        if self._link is None or self._link.fileno() < 0:  # the status was read (under the wait lock),
            # or the link was closed with this object in a collected cycle (Popen.__del__ then keeps
            # it for subprocess._cleanup): the server reaps the child either way
            return (self.pid, 255 << 8)
        self._link.setblocking(not wait_flags & os.WNOHANG)
        try:
            said = self._link.recv(64)
        except BlockingIOError:
            return (0, 0)
        self._link.close()
        self._link = None
        if not said:  # the server ended before this child: its status is lost
            return (self.pid, 255 << 8)
        return (self.pid, int(said))

    def _internal_poll(self, _deadstate=None, **_ignored):
        if not self._forked:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
