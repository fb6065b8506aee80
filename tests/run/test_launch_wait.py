"""launch-silo waits for a server that is slow to start (a loaded machine) as long as it works,
and gives up on one that is stuck (issue 43)."""

import os
import subprocess
import sys
import textwrap

import pytest

from fedml_perfedavg.fedml_bridge.cross_silo import readiness
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
