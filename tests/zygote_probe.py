"""What a process sees of itself, for tests/test_zygote.py: ``python zygote_probe.py ACTION``
prints one JSON line (its argv, working directory, a variable of its environment, session, the
line it read from stdin, whether it shares the random sequence, its network namespace and the
interfaces it sees there, its /proc/self/cmdline) and then does ACTION:
``exit:N``, ``raise``, ``interrupt`` (an uncaught KeyboardInterrupt), ``sleep`` (until killed),
``thread`` (a non-daemon thread prints after the main thread returns, then atexit prints),
``imports`` (a second line: which of the plugin, FedML, gRPC and matplotlib were loaded when it
started), or ``launch`` (starts ``probe sleep`` as the silo launcher starts a silo, prints that
child's first line and whether it was forked, then sleeps until killed); under mpirun, ``mpi``
(a second line: its rank, the world's size, an allreduce, its pid and parent) and ``mpi-sleep``
(the same, then sleep until killed)."""

import sys

LOADED_AT_START = sorted(m for m in ("fedml", "fedml_perfedavg", "grpc", "matplotlib") if m in sys.modules)

import atexit  # noqa: E402  (after what was loaded before this script's first import)
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy  # noqa: E402


def main() -> None:
    action = sys.argv[1]
    line = sys.stdin.readline().strip() if os.environ.get("PROBE_READS") else ""
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "cwd": os.getcwd(),
                "variable": os.environ.get("PROBE_VARIABLE"),
                "leader": os.getsid(0) == os.getpid(),
                "read": line,
                "random": [random.random(), float(numpy.random.random())],
                "main": __name__,
                "path0": sys.path[0],
                "netns": os.readlink("/proc/self/ns/net"),
                "interfaces": sorted(name for _, name in socket.if_nameindex()),
                "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
            }
        ),
        flush=True,
    )
    if action in ("mpi", "mpi-sleep"):  # a rank under mpirun: MPI works, and what runs it
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        total = world.allreduce(world.Get_rank() + 1)
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")
        print(
            json.dumps(
                {
                    "rank": world.Get_rank(),
                    "size": world.Get_size(),
                    "sum": total,
                    "pid": os.getpid(),
                    "parent": [os.path.basename(a.decode()) for a in parent[:3]],
                }
            ),
            flush=True,
        )
        if action == "mpi-sleep":
            time.sleep(600)
        return
    if action == "imports":
        print(json.dumps(LOADED_AT_START), flush=True)
    if action == "launch":
        import subprocess

        from fedml_perfedavg.run.launch_silo import _end_with_parent

        child = subprocess.Popen(
            [sys.executable, __file__, "sleep"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_end_with_parent,
        )
        said = json.loads(child.stdout.readline())
        print(json.dumps({**said, "pid": child.pid, "forked": getattr(child, "_forked", False)}), flush=True)
        time.sleep(600)
    if action.startswith("exit:"):
        sys.exit(int(action[5:]))
    if action == "raise":
        raise ValueError("the probe's own error")
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "sleep":
        time.sleep(600)
    if action == "thread":
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended", flush=True))).start()


if __name__ == "__main__":
    main()
