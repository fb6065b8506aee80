"""An MPI rank's stand-in: ``mpirun -n N python -I -S tests/zygote_rank.py SOCKET ARGS...``.

mpirun (hydra) starts this in each rank's place; it asks the tests' fork server (tests/zygote.py,
listening on SOCKET) to fork ``python ARGS...`` with this process's streams, environment, working
directory, network namespace and PMI socket (``PMI_FD``, which MPICH's ``MPI_Init`` reads), then
stands for it: the signals mpirun sends go on to the rank, and this process ends with the rank's
status. If this process is killed, the server kills the rank. Where the server cannot be reached,
it becomes ``python ARGS...`` itself. Standard library only: it starts in milliseconds.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    fds = [0, 1, 2, os.open("/proc/self/ns/net", os.O_RDONLY)]
    fds_at = {}
    pmi = os.environ.get("PMI_FD", "")
    if pmi.isdigit():
        fds_at[pmi] = len(fds)
        fds.append(int(pmi))
    request = {
        "argv": argv,
        "netns": "",
        "netns_fd": 3,
        "fds_at": fds_at,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "new_session": os.getsid(0) == os.getpid(),  # hydra starts each rank in a session of its own
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "tied": int(signal.SIGKILL),  # the rank ends with this stand-in
    }
    link = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        link.connect(path)
        socket.send_fds(link, [json.dumps(request).encode()], fds)
        answer = link.recv(4096)
    except OSError:
        answer = b""
    if not answer:  # no server: the rank starts here, as mpirun would have started it
        link.close()
        os.execv(sys.executable, [sys.executable, *argv])
    pid = json.loads(answer)["pid"]
    # the rank holds its streams and PMI socket alone, as a fresh rank does: mpirun sees them close
    # when the rank ends
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for fd in fds[3:]:
        os.close(fd)

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # it has just ended; its status is on its way
            pass

    for number in FORWARDED:
        if signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, forward)
    said = link.recv(64)  # the rank's wait status, once it has ended

    code = os.waitstatus_to_exitcode(int(said)) if said else 255
    if code < 0:  # ended by a signal: so does this process, for mpirun to see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
