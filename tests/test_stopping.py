"""How a process stops on SIGINT or SIGTERM (fedml_perfedavg/stopping.py): the first signal
interrupts once, a second does not break the stop, a swallowed interrupt is not lost, and the
launcher notes signals instead of raising them where they land."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import REPO
from fedml_perfedavg.stopping import (
    STOP_SIGNALLED,
    StopRequested,
    StopSignals,
    interrupt_if_stopping,
    sigterm_as_interrupt,
    stopped_exit_code,
)


def test_a_second_signal_does_not_interrupt_the_stop_of_the_first():
    """A terminal's Ctrl-C and a launcher's SIGTERM came at once: the second interrupted the
    process while it handled the first (RuntimeError: release unlocked lock)."""
    stopped = []
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                assert STOP_SIGNALLED.is_set()
                os.kill(os.getpid(), signal.SIGTERM)  # while stopping: ignored, the stop goes on
                stopped.append(True)
                raise
    assert stopped == [True]
    assert stopped_exit_code() == 130


def test_an_interrupt_swallowed_where_it_landed_is_raised_again_at_the_next_check():
    """A finaliser or a library's ``except BaseException`` ate the KeyboardInterrupt: the receive
    loop's check raises it again (the process ran on until it was killed)."""
    with sigterm_as_interrupt():
        interrupt_if_stopping()  # no signal yet: nothing happens
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except BaseException:  # noqa: BLE001 - what the code it landed in did
            pass
        with pytest.raises(KeyboardInterrupt):
            interrupt_if_stopping()
        assert stopped_exit_code() == 143
        elsewhere = []

        def off_the_main_thread():
            try:
                interrupt_if_stopping()  # only the main thread is interrupted, as by the signal itself
                elsewhere.append("went on")
            except KeyboardInterrupt:
                elsewhere.append("interrupted")

        thread = threading.Thread(target=off_the_main_thread)
        thread.start()
        thread.join()
        assert elsewhere == ["went on"]
    STOP_SIGNALLED.clear()


def test_the_launcher_notes_signals_and_stops_between_its_own_steps():
    """No KeyboardInterrupt lands inside ``Popen.poll`` (it could keep the wait lock forever):
    the signal is noted, the sleep ends within 0.1 s and StopRequested is raised there; the first
    signal sets the exit status, a second changes nothing; the handlers are put back."""
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        stop.check()
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        started = time.monotonic()
        with pytest.raises(StopRequested, match="SIGTERM"):
            stop.sleep(30)
        assert time.monotonic() - started < 2
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        assert (stop.name, stop.exit_status) == ("SIGTERM", 143)
    assert signal.getsignal(signal.SIGINT) is before


STOPPED_SCRIPT = """
import os, signal, sys
from fedml_perfedavg.stopping import exit_as_signalled, sigterm_as_interrupt
{hook}
exit_as_signalled()
with sigterm_as_interrupt():
    try:
        os.kill(os.getpid(), {signum})
        signal.sigtimedwait([], 0)  # the handler runs here at the latest
    except KeyboardInterrupt:
        {then}
"""


@pytest.mark.backend  # a subprocess
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("then", ["raise", "raise RuntimeError('a cleanup that failed on the interrupt')"])
def test_a_stopped_script_ends_by_its_signal_even_when_the_interrupt_became_another_error(signum, then):
    code = STOPPED_SCRIPT.format(signum=int(signum), then=then, hook="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == -signum, out.stderr[-2000:]
    assert ("RuntimeError" in out.stderr) == ("RuntimeError" in then)  # the traceback is still shown


@pytest.mark.backend  # a subprocess
def test_a_stopped_script_ends_by_its_signal_even_when_the_hook_it_wraps_fails():
    """FedML's excepthook reports an error to its MLOps first; should that fail, the stop still ends
    the process by its signal."""
    hook = "def broken(*info):\n    raise OSError('MLOps unreachable')\nsys.excepthook = broken"
    code = STOPPED_SCRIPT.format(signum=int(signal.SIGTERM), then="raise RuntimeError('cleanup')", hook=hook)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == -signal.SIGTERM, out.stderr[-2000:]
