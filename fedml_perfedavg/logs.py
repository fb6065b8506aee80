"""Every change the plugin makes to Python's logging, in one place.

The console shows the plugin's own INFO lines (not the per-user ones) and everyone's warnings;
a run's ``run.log`` keeps everything. FedML logs chatty INFO lines on the root logger, and its
``fedml.init`` (core/mlops/mlops_runtime_log.py ``init_logs``) swaps ``logging.root`` for a
logger of its own, so these functions work on the real root (``logging.Logger.manager.root``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator, Optional

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _real_root() -> logging.Logger:
    return logging.Logger.manager.root


class PluginRecords(logging.Filter):
    """The plugin's own records (not the per-user lines); with ``warnings``, everyone's warnings too."""

    def __init__(self, warnings: bool = True) -> None:
        super().__init__()
        self.warnings = warnings

    def filter(self, record: logging.LogRecord) -> bool:
        if self.warnings and record.levelno >= logging.WARNING:
            return True
        return record.name.startswith("fedml_perfedavg") and not record.name.endswith(".per_user")


def console_handler(level: int = logging.INFO, warnings: bool = True) -> logging.Handler:
    """The console's handler: the plugin's progress lines (and everyone's warnings)."""
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.addFilter(PluginRecords(warnings))
    console.setFormatter(logging.Formatter(LOG_FORMAT, "%H:%M:%S"))
    return console


def _at_least_info(root: logging.Logger) -> None:
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)


def use_console(level: str = "INFO") -> None:
    """The command line's logging: the console handler alone on the root."""
    root = _real_root()
    root.setLevel(logging.DEBUG if level == "DEBUG" else logging.INFO)
    root.handlers[:] = [console_handler(getattr(logging, level))]


@contextlib.contextmanager
def as_found_afterwards() -> Iterator[None]:
    """The root's handlers and level as they were once the block ends; those added meanwhile are
    closed. A command called in-process (a test, a notebook) would otherwise leave its console
    handler on a stream that its caller may close, and every later line would fail to print."""
    root = _real_root()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                remove_handler(handler)
        root.handlers[:] = handlers
        root.setLevel(level)


def console_if_unconfigured() -> None:
    """A library call in a script or notebook that configured no logging shows the run's
    progress lines and warnings, as the command line does; configured logging is left alone.
    (Called before FedML's import, whose ``logging.basicConfig`` would print everything.)"""
    root = _real_root()
    if not root.handlers:
        root.addHandler(console_handler())
        _at_least_info(root)


def keep_plugin_lines_visible() -> None:
    """After FedML's ``init_logs`` swapped ``logging.root``, module loggers created before still
    propagate to the original root, which may have no handler: the plugin's lines would vanish.
    The original root gets a console handler for the plugin's records alone (FedML's reach it too,
    by propagation, and FedML's own handler already shows them)."""
    root = _real_root()
    if logging.root is root or any(isinstance(f, PluginRecords) for h in root.handlers for f in h.filters):
        return
    root.addHandler(console_handler(warnings=False))
    _at_least_info(root)


def add_run_file(path: str) -> Optional[logging.Handler]:
    """Every log line (FedML's and the per-user lines included) into ``path``; None if a handler
    already writes there."""
    root = _real_root()
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == path for h in root.handlers):
        return None
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.DEBUG)
    previous = root.level
    if previous > logging.INFO or previous == logging.NOTSET:
        # The file needs INFO through the root; the caller's own handlers keep showing only what
        # the root let through before (e.g. a script's ``logging.basicConfig(level=WARNING)``).
        for existing in root.handlers if previous != logging.NOTSET else ():
            if existing.level == logging.NOTSET:
                existing.setLevel(previous)
        root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def remove_handler(handler: Optional[logging.Handler]) -> None:
    """Detach and close a handler :func:`add_run_file` added."""
    if handler is not None:
        _real_root().removeHandler(handler)
        handler.close()


def close_files_under(folder: str) -> None:
    """Close every log file the root writes inside ``folder`` (before the folder is removed)."""
    root = _real_root()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and handler.baseFilename.startswith(folder.rstrip("/") + "/"):
            remove_handler(handler)


@contextlib.contextmanager
def no_implicit_basic_config() -> Iterator[None]:
    """Code that calls module-level ``logging.info`` (FedML's) while the root has no handler would
    configure it (``basicConfig``), doubling every later line: a null handler stands in meanwhile."""
    root = _real_root()
    stand_in = logging.NullHandler() if not root.handlers else None
    if stand_in is not None:
        root.addHandler(stand_in)
    try:
        yield
    finally:
        if stand_in is not None:
            root.removeHandler(stand_in)
