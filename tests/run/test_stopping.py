"""A process stopped by a signal ends by that signal, whatever exception the interrupt became."""

import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = """
import os, signal, sys
from fedml_perfedavg.stopping import exit_as_signalled, sigterm_as_interrupt
exit_as_signalled()
with sigterm_as_interrupt():
    try:
        os.kill(os.getpid(), {signum})
        signal.sigtimedwait([], 0)  # the handler runs here at the latest
    except KeyboardInterrupt:
        {then}
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("then", ["raise", "raise RuntimeError('a cleanup that failed on the interrupt')"])
def test_a_stopped_script_ends_by_its_signal_even_when_the_interrupt_became_another_error(signum, then):
    code = SCRIPT.format(signum=int(signum), then=then)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == -signum, out.stderr[-2000:]
    assert ("RuntimeError" in out.stderr) == ("RuntimeError" in then)  # the traceback is still shown
