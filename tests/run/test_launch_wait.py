"""launch-silo waits for a server that is slow to start (a loaded machine) as long as it works,
and gives up on one that is stuck (issue 43)."""

import os
import subprocess
import sys
import textwrap

import pytest

from fedml_perfedavg.silo.server import readiness
from fedml_perfedavg.run.launch_silo import ServerState, _wait_ready
from fedml_perfedavg.stopping import StopSignals

pytestmark = pytest.mark.backend  # starts processes


def _server(tmp_path, body: str) -> subprocess.Popen:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script)], env={**os.environ, "STATE": str(tmp_path / "state.json")})


def test_a_server_busy_starting_for_longer_than_connect_timeout_is_waited_for(tmp_path):
    state = ServerState(str(tmp_path / "state.json"))
    server = _server(
        tmp_path,
        """
        import json, os, time
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # imports on a loaded machine: busy, not listening yet
            sum(range(10000))
        json.dump({"state": "listening", "pid": os.getpid()}, open(os.environ["STATE"], "w"))
        time.sleep(5)
        """,
    )
    try:
        with StopSignals() as stop:
            _wait_ready(state, server, "127.0.0.1:1", 1.0, stop)  # 1 s: the old limit failed here
        assert readiness.read(state.path) == "listening"
    finally:
        server.kill()
        server.wait()


def test_a_stuck_server_is_given_up_on_after_connect_timeout_without_progress(tmp_path):
    state = ServerState(str(tmp_path / "state.json"))
    server = _server(tmp_path, "import time\ntime.sleep(30)\n")
    try:
        with StopSignals() as stop, pytest.raises(RuntimeError, match="has used no CPU for .* it is stuck"):
            _wait_ready(state, server, "127.0.0.1:1", 1.5, stop)
    finally:
        server.kill()
        server.wait()


def test_stopping_waits_for_a_process_still_busy_writing_and_kills_one_that_is_stuck(tmp_path, monkeypatch, caplog):
    """Ctrl-C under load: a server still writing its record after SIGTERM (busy) is waited for
    past the idle limit (the old fixed 10 s killed it at load 6-10); one that sleeps through the
    signal is killed once it has used no CPU for that long, and named."""
    import time

    from fedml_perfedavg.run import launch_silo

    monkeypatch.setattr(launch_silo, "STOP_IDLE_SECONDS", 1.5)
    busy = _server(
        tmp_path,
        """
        import signal, sys, time
        def finish(*_):
            end = time.monotonic() + 4.0  # writing what it measured, on a loaded machine
            while time.monotonic() < end:
                sum(range(10000))
            sys.exit(0)
        signal.signal(signal.SIGTERM, finish)
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    stuck = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    )
    time.sleep(1.0)  # both have set their handlers
    started = time.monotonic()
    with caplog.at_level("ERROR"):
        launch_silo.stop_processes({0: busy, 1: stuck})
    took = time.monotonic() - started
    assert busy.returncode == 0 and stuck.returncode == -9
    assert 4.0 <= took < 10, took
    assert "silo rank 1 did not stop after SIGTERM (no CPU used for 1.5 s): killed" in caplog.text
    assert "the server did not stop" not in caplog.text


@pytest.mark.fast
def test_a_failed_launch_names_every_process_exit_code(caplog, tmp_path):
    """Issue 79: a failed launch says how each process ended, the server's included, so that a
    test's message (tests/helpers.py failure_tail) and an operator see which one failed first."""
    import logging
    from types import SimpleNamespace

    from fedml_perfedavg.run.launch_silo import _exit_code

    processes = {0: SimpleNamespace(returncode=1), 1: SimpleNamespace(returncode=143), 2: SimpleNamespace(returncode=0)}
    with caplog.at_level(logging.INFO, logger="fedml_perfedavg.run.launch_silo"):
        assert _exit_code(processes, 0, str(tmp_path)) == 1
    assert "the server exited with code 1" in caplog.text
    assert "exit codes: the server 1, silo rank 1 143, silo rank 2 0" in caplog.text
