"""Imports with Python's cyclic garbage collector paused.

Importing torch and FedML creates a few hundred thousand objects that live as long as the process
and almost no garbage, while the collector, triggered by allocation counts, walks the growing heap
again and again; and every later full collection walks all of it once more. Paused during the
imports, with what survives frozen afterwards (``gc.freeze``: out of the collector's generations),
``import fedml_perfedavg, fedml`` takes about 2.1 s of user CPU instead of 4.1 on the project's
machine, and a cross-silo test's processes less than half their CPU time (issue 54). Nothing here
imports anything else, so it can come first.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Run the block with the collector off, then restore it as it was (nested uses leave it to
    the outermost). ``freeze``: first freeze every object there is, as the modules just imported
    live as long as the process. No collection runs first: with the collector off, every object
    the imports made is in the youngest generation, so one collection walks all of them (0.45 s
    of CPU here); the price is that garbage cycles already made when FedML is first imported
    stay (import the plugin and FedML at the top of a program, as usual, and there are none to
    speak of)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if freeze:
                gc.freeze()
            gc.enable()
