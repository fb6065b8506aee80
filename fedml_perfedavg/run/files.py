"""Every file a run writes, written whole or not at all: a temporary name beside the target,
flushed and fsynced, then renamed over it; a failed write leaves the previous good file and no
temporary behind, and says which file, which folder, and why (a full disk, a read-only one, ...)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import threading
from typing import IO, Any, Callable, Iterator, Optional

import torch
import yaml

from ..core.errors import OutputError


def record_of(run_dir: Optional[str], what: str) -> str:
    """ "; <what> is in RUN_DIR/summary.json" where this process's run wrote one (a silo, or a run
    that stopped before it started, has none)."""
    if run_dir and os.path.isfile(os.path.join(run_dir, "summary.json")):
        return f"; {what} is in {run_dir}/summary.json"
    return ""


_WHY = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "no permission to write there",
    errno.EPERM: "no permission to write there",
    errno.EFBIG: "the file is larger than allowed",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENOENT: "the folder does not exist",
}


def _why(err: OSError) -> str:
    return _WHY.get(err.errno or 0, err.strerror or str(err))


def explain(err: OSError, path: str) -> str:
    """A sentence naming the file, its folder and the cause of ``err``."""
    return f"cannot write {os.path.basename(path)} in {os.path.dirname(os.path.abspath(path))}: {_why(err)}"


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C or SIGTERM during a write acts once the write is done: an interrupt inside
    ``torch.save`` leaves its zip writer half-closed and raises a RuntimeError of its own, not the
    interrupt (seen in CI: a checkpoint written as Ctrl-C arrived). Only the main thread can."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held:
            signum, frame = held[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)  # the process's own handler (Ctrl-C's raises KeyboardInterrupt)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def write_atomic(path: str, write: Callable[[IO[bytes]], object], previous: Optional[str] = None) -> None:
    """Write ``path`` whole through ``write(stream)``, or raise :class:`OutputError` leaving the
    previous file (if any) as it was and no temporary file. With ``previous``, the file replaced
    is kept under that name. An interrupt meanwhile is raised once the file is written."""
    with _interrupts_held():
        _write_atomic(path, write, previous)


def _write_atomic(path: str, write: Callable[[IO[bytes]], object], previous: Optional[str]) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        if previous is not None and os.path.exists(path):
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        cause = _os_error(err)
        if cause is None:
            raise
        raise OutputError(explain(cause, path)) from None


def _os_error(err: Optional[BaseException]) -> Optional[OSError]:
    """The OSError behind ``err`` (torch.save reports a full disk as a RuntimeError raised while
    handling it: "basic_ios::clear: iostream error")."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def strict_json(data: Any) -> Any:
    """``data`` with every NaN and infinity replaced by None (JSON has no such numbers: Python's
    ``json`` writes ``NaN`` tokens that strict parsers refuse), tuples as lists."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: strict_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict_json(v) for v in data]
    return data


def write_json(path: str, data: Any) -> None:
    """``data`` as strict JSON (non-finite numbers become null), written whole or not at all."""
    text = json.dumps(strict_json(data), indent=2, sort_keys=False, allow_nan=False)
    write_atomic(path, lambda stream: stream.write(text.encode()))


def write_yaml(path: str, data: Any) -> None:
    write_atomic(path, lambda stream: stream.write(yaml.safe_dump(data, sort_keys=False).encode()))


def write_torch(path: str, obj: Any) -> None:
    write_atomic(path, lambda stream: torch.save(obj, stream))


def make_dir(path: str) -> None:
    """``os.makedirs`` with the same clear error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {os.path.abspath(path)}: {_why(err)}") from None


RUN_LOCK = ".run.lock"  # held (flock) by the process that owns a run directory's record, for its life
_held_locks: dict = {}  # run directory -> open lock file (closing it would release the lock)


def hold_run_dir(run_dir: str) -> None:
    """Hold ``run_dir`` for this process's life (an advisory ``flock`` the kernel releases when
    the process ends, however it ends): a second process that would start, overwrite or resume
    the run there while this one writes it gets :class:`~..core.errors.ConfigError` naming the
    holder. Where the filesystem has no locks, a warning says the folder is not guarded."""
    import fcntl
    import logging
    import socket
    import time

    from ..core.errors import ConfigError

    if run_dir in _held_locks:
        return
    path = os.path.join(run_dir, RUN_LOCK)
    try:
        stream = open(path, "a+")
    except OSError as err:
        raise OutputError(f"cannot create {path}: {_why(err)}") from None
    try:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        stream.seek(0)
        holder = stream.read(200).strip() or "a process that wrote nothing about itself"
        stream.close()
        raise ConfigError(
            f"run directory {run_dir!r} is in use by a live process ({holder}); wait for it to end, or give "
            f"another --run-dir (or common_args.run_name)"
        ) from None
    except OSError as err:  # a filesystem without flock (some network filesystems)
        logging.getLogger(__name__).warning(
            "run directory %s cannot be locked (%s): nothing stops a second process from writing it too",
            run_dir,
            _why(err),
        )
    stream.seek(0)
    stream.truncate()
    stream.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    stream.flush()
    _held_locks[run_dir] = stream


def refuse_if_held(run_dir: str) -> None:
    """:class:`~..core.errors.ConfigError` naming the process if another live process holds
    ``run_dir`` (:func:`hold_run_dir`); nothing is changed either way."""
    import fcntl

    from ..core.errors import ConfigError

    path = os.path.join(run_dir, RUN_LOCK)
    if run_dir in _held_locks or not os.path.exists(path):
        return
    try:
        with open(path) as stream:
            try:
                fcntl.flock(stream.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = stream.read(200).strip() or "a process that wrote nothing about itself"
                raise ConfigError(
                    f"run directory {run_dir!r} is in use by a live process ({holder}); wait for it to end, or "
                    f"give another --run-dir (or common_args.run_name)"
                ) from None
    except OSError:  # unreadable, or no locks on this filesystem: hold_run_dir says so
        return


def release_run_dir(run_dir: str) -> None:
    """Let go of ``run_dir`` (its run is over: a later run in this same process, or another
    process, may use it)."""
    stream = _held_locks.pop(run_dir, None)
    if stream is not None:
        stream.close()
