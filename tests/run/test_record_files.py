"""What a run leaves on disk can always be read: strict JSON (no NaN tokens), and a run whose
process died without a word is shown as dead, not running."""

import json
import os
import socket
import subprocess
import sys

import pytest

from fedml_perfedavg.run.files import write_json
from fedml_perfedavg.run.reporting import process_start_ticks
from fedml_perfedavg.run.show import main as show, status_of


def test_summary_files_are_strict_json(tmp_path):
    path = tmp_path / "summary.json"
    write_json(str(path), {"loss": float("nan"), "history": [{"a": float("inf"), "b": (1, float("-inf"))}], "ok": 0.5})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    strict = json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    assert strict == {"loss": None, "history": [{"a": None, "b": [1, None]}], "ok": 0.5}


def _summary(pid, ticks, host=None):
    return {
        "status": "running",
        "rounds": 3,
        "wall_seconds": 1.0,
        "personalized_accuracy": 0.5,
        "process": {"host": host or socket.gethostname(), "pid": pid, "started": 0.0, "start_ticks": ticks},
    }


@pytest.mark.backend  # a real process, started and killed
def test_a_running_run_whose_process_is_gone_is_shown_dead(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert status_of(_summary(os.getpid(), process_start_ticks(os.getpid()))) == f"running (pid {os.getpid()})"
    assert status_of(_summary(gone.pid, 12345)).startswith(
        f"dead (summary.json says running, but its process {gone.pid} on this host is gone"
    )
    # the pid of a live process that started at another time is another process: the run's is gone
    assert status_of(_summary(os.getpid(), process_start_ticks(os.getpid()) + 1)).startswith("dead")
    assert status_of(_summary(1, 5, host="elsewhere")) == "running on elsewhere (pid 1; not checked from here)"
    (tmp_path / "summary.json").write_text(json.dumps(_summary(gone.pid, 12345)))
    assert show([str(tmp_path)]) == 0
    assert ", dead (summary.json says running" in capsys.readouterr().out


def test_an_interrupt_during_a_write_is_raised_once_the_file_is_whole(tmp_path):
    """Ctrl-C inside torch.save left its zip writer half-closed and raised a RuntimeError of its
    own (CI, test_ctrl_c_to_launch_silo...): the write finishes first, then the interrupt. A process
    whose SIGINT is ignored (a shell's background job: the suite run with ``&`` is one) ignores it
    during a write too; the test sets each disposition itself instead of inheriting one."""
    import signal

    import torch

    from fedml_perfedavg.run.files import write_atomic

    state = {"w": torch.arange(100000.0)}

    def write(stream):
        signal.raise_signal(signal.SIGINT)  # in this thread, in the middle of the write
        torch.save(state, stream)

    inherited = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as under a terminal
        path = str(tmp_path / "checkpoint.pt")
        with pytest.raises(KeyboardInterrupt):
            write_atomic(path, write)
        assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        path = str(tmp_path / "ignored.pt")
        write_atomic(path, write)  # ignored before, ignored now: no interrupt
        assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.fast
def test_show_says_which_accountant_and_delta_every_epsilon_is():
    """Issue 76: the server's `show` listed RDP bounds where the organization's record said PRV,
    with no label; each epsilon shown now says its accountant and delta."""
    from fedml_perfedavg.run.show import describe_run, describe_silo

    server = {
        "status": "finished",
        "rounds": 3,
        "per_user_accuracy": [0.5, 0.6],
        "privacy": {
            "epsilon_from": "opacus.rdp",
            "delta": 1e-5,
            "reported_by": "silos (each accounts for its own user)",
            "per_user": {"0": {"epsilon": 4.54, "uses": 30}, "1": {"epsilon": 4.2, "uses": 30}},
        },
    }
    shown = describe_run("run", server)
    assert "epsilon by opacus.rdp at delta 1e-05 (an RDP bound: each organization's own record" in shown
    silo = {"rank": 4, "user": 3, "status": "finished", "privacy": {"epsilon": 4.213, "uses": 30}}
    silo["privacy"].update(epsilon_from="opacus.prv", delta=1e-5)
    assert "epsilon 4.213 over 30 uses of its data (DP-SGD, by opacus.prv at delta 1e-05)" in describe_silo("r", silo)
