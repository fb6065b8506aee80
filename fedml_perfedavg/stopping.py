"""How a process of the plugin stops on SIGINT (Ctrl-C) or SIGTERM, in one place.

A run (the command line, a FedML user's main script, each cross-silo process) turns the first
stop signal into a KeyboardInterrupt, so the run layer writes what was measured before the
process ends; a second signal while it stops changes nothing. Code that an interrupt can land in
and swallow (a finaliser, a library's own handler) cannot lose the stop: the cross-silo receive
loop asks :func:`interrupt_if_stopping` at every message and every idle tick. The launcher, which
only watches processes, notes a signal and looks for it between its own steps (:class:`StopSignals`).
The batched engine, whose rounds are checkpointed, stops at the end of the round it is in
(:class:`RoundEndInterrupt`), so that ``--resume`` continues exactly. FedML-free: the bridge and the
run layer both use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, NoReturn, Optional

logger = logging.getLogger(__name__)


class _SignalFlag:
    """A flag a signal handler may set: no lock (a ``threading.Event``'s ``set`` takes its
    Condition's lock, and a handler that blocks on a lock held where the signal landed never
    returns: a server that caught its parent-death SIGTERM so hung for minutes in CI)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set


STOP_SIGNALLED = _SignalFlag()  # SIGTERM or SIGINT reached this process during the current run
_STOP_SIGNAL: List[int] = [signal.SIGINT]  # which one (the first)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


# A process's exit status, for monitoring (README, "Exit codes"): every process of one run ends
# with the same code for the same end, the server's and each silo's alike.
EXIT_FINISHED = 0  # every round ran
EXIT_FAILED = 1  # an error ended it (or this silo could not take part)
EXIT_REFUSED = 2  # refused at start: the config, an input or the run folder, named on stderr
EXIT_STOPPED = 3  # the server stopped the run early by its rules (divergence, rounds without an update)


def exit_code_of(status: str) -> int:
    """The exit status of a process whose part of the run ended with ``status`` (summary.json's)."""
    if status == "interrupted":
        return stopped_exit_code()
    return {"finished": EXIT_FINISHED, "stopped": EXIT_STOPPED}.get(status, EXIT_FAILED)


def stop_exit_code(err: BaseException) -> int:
    """A run that raised ``err`` (the run layer's stop): this process failed (a cross-silo peer
    gone, its port taken: :class:`SiloFailure`), or the server's rules stopped the run."""
    from .core.errors import SiloFailure

    return EXIT_FAILED if isinstance(err, SiloFailure) else EXIT_STOPPED


def exit_status(signum: int) -> int:
    """As the shell reports a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def stopped_exit_code() -> int:
    """The shell's exit status of a process stopped by the signal that stopped the run."""
    return exit_status(_STOP_SIGNAL[0])


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does (the run layer writes what was measured), in the
    plugin's command line and in a FedML user's own main script alike. Either signal is noted
    (:data:`STOP_SIGNALLED`): code the interrupt lands in (a gRPC call, say) may turn it into an
    error of its own, and the run still ends as interrupted. Only the first signal interrupts:
    one that comes while the run is stopping (a terminal's Ctrl-C and a launcher's SIGTERM at once)
    would break the stop halfway (a lock released twice)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        if STOP_SIGNALLED.is_set():  # already stopping: a second signal must not interrupt the stop itself
            return
        _STOP_SIGNAL[0] = signum
        STOP_SIGNALLED.set()
        raise KeyboardInterrupt

    STOP_SIGNALLED.clear()  # a run of its own: an earlier run's stop in this process does not count
    previous = {sig: signal.signal(sig, interrupt) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interrupt_if_stopping() -> None:
    """Raise KeyboardInterrupt in the main thread if a stop signal came and its interrupt was
    swallowed where it landed (a ``__del__``, a library's ``except BaseException``): without
    this, a process that lost it ran on until the launcher killed it."""
    if STOP_SIGNALLED.is_set() and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt


def stop_in_place_of(err: BaseException) -> None:
    """Raise KeyboardInterrupt (from ``err``) if a stop signal came: ``err`` was raised where the
    interrupt landed, in its place (torch's vmap nesting asserts as a KeyboardInterrupt unwinds
    it), so the process stops as a stopped one, not as one that failed."""
    if STOP_SIGNALLED.is_set():
        raise KeyboardInterrupt from err


_RECORDED_STOP: List[str] = []  # the line that says where a stopped run's record is


def note_recorded_stop(line: str) -> None:
    """The run layer wrote what a stopped run measured: a KeyboardInterrupt that then reaches the
    top of a FedML user's main script prints ``line`` instead of a traceback of wherever the signal
    landed, which helps nobody (the plugin's command line prints the same line itself)."""
    _RECORDED_STOP[:] = [line]


def _exit_as_signalled(hook: Any) -> Any:
    """``sys.excepthook`` for a FedML user's main script: a run stopped by a signal ends the process
    by that signal, after the usual traceback, whatever exception reached the top. Python itself
    does so only for a KeyboardInterrupt after SIGINT: a SIGTERM would end as -2 (as if Ctrl-C), and
    an interrupt that landed in code turning it into an error of its own (a library's cleanup)
    would end as exit status 1, which a launcher reads as a failure. A KeyboardInterrupt after the
    run recorded its stop prints that one line (:func:`note_recorded_stop`), not a traceback."""

    @functools.wraps(hook)
    def excepthook(kind, value, traceback):
        try:
            if issubclass(kind, KeyboardInterrupt) and _RECORDED_STOP:
                print(_RECORDED_STOP[0], file=sys.stderr)
            else:
                hook(kind, value, traceback)  # FedML's reports the error to its MLOps first, which may fail
        finally:
            signum = _STOP_SIGNAL[0]
            if STOP_SIGNALLED.is_set() and not (issubclass(kind, KeyboardInterrupt) and signum == signal.SIGINT):
                sys.stderr.flush()
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    excepthook.__wrapped__ = hook
    excepthook.exits_as_signalled = True  # type: ignore[attr-defined]
    return excepthook


def exit_as_signalled() -> None:
    """Wrap the process's ``sys.excepthook`` (see :func:`_exit_as_signalled`); again after FedML's
    ``init``, which puts its own in place (core/mlops/mlops_runtime_log.py)."""
    if not getattr(sys.excepthook, "exits_as_signalled", False):
        sys.excepthook = _exit_as_signalled(sys.excepthook)


class StopRequested(Exception):
    """SIGINT or SIGTERM reached a process that notes signals (:class:`StopSignals`)."""


class StopSignals:
    """SIGINT and SIGTERM noted, not raised: the holder looks for them between its own steps.

    For the launcher, which only watches processes. A KeyboardInterrupt raised wherever the
    signal lands could land inside ``Popen.poll`` while it holds the process's wait lock; every
    later ``poll`` then said "running" and the stop waited out each process's timeout. A second
    signal changes nothing; the first decides the exit status.
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # elsewhere the signals stay as they were
            self._previous = {signum: signal.signal(signum, self._note) for signum in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _note(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum or signal.SIGINT)

    def check(self) -> None:
        """Raise :class:`StopRequested` if a signal came."""
        if self.signum is not None:
            raise StopRequested(self.name)

    def sleep(self, seconds: float) -> None:
        """``time.sleep``, cut short (within 0.1 s) by a stop signal."""
        end = time.monotonic() + seconds
        while True:
            self.check()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.1, left))


class RoundEndInterrupt(StopSignals):
    """SIGINT or SIGTERM during a loop whose rounds are checkpointed (the batched engine): the
    first is noted and the loop stops at the end of the round it is in, once that round is kept
    (the driver writes a checkpoint, then calls :meth:`stop`), so that ``--resume`` gives the
    uninterrupted run's model; a second one interrupts at once. Ctrl-C at round 21 of the quick
    start used to leave no checkpoint (``checkpoint_every`` is 100). Main thread only: elsewhere
    the signals stay as they were."""

    def _note(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning(
                "%s: the run stops at the end of this round, kept for --resume (the signal again stops it now)",
                signal.Signals(signum).name,
            )
            return
        self.stop()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop(self) -> NoReturn:
        """End the run as interrupted by the signal that came (the run layer records it)."""
        _STOP_SIGNAL[0] = self.signum or signal.SIGINT
        STOP_SIGNALLED.set()
        raise KeyboardInterrupt
