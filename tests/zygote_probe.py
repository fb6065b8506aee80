"""What a process sees of itself, for tests/test_zygote.py: ``python zygote_probe.py ACTION``
prints one JSON line (its argv, working directory, a variable of its environment, session, the
line it read from stdin, whether it shares the random sequence, its network namespace and the
interfaces it sees there) and then does ACTION:
``exit:N``, ``raise``, ``interrupt`` (an uncaught KeyboardInterrupt), ``sleep`` (until killed), or
``thread`` (a non-daemon thread prints after the main thread returns, then atexit prints); under
mpirun, ``mpi`` (a second line: its rank, the world's size, an allreduce, its pid and parent)
and ``mpi-sleep`` (the same, then sleep until killed)."""

import atexit
import json
import os
import random
import socket
import sys
import threading
import time

import numpy


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
