"""Refusals, counted by reason and logged so that no peer can flood the log.

Every message or connection a cross-silo process refuses goes through :class:`RefusalLog`: it is
counted (``totals``, by reason: what summary.json's ``refusals`` shows), and logged with the
peer's address, its text cut to :data:`MAX_TEXT` characters, at most :data:`BURST` lines per
(peer address, reason) and then one per :data:`WINDOW_SECONDS`, and at most :data:`GLOBAL_LINES`
per :data:`WINDOW_SECONDS` from all addresses together (a sender that rotates its source address
gets no more); what was held back is counted and said in one line every :data:`REPORT_SECONDS`
(:meth:`RefusalLog.tick`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Dict, Tuple

from .gate import CONNECTION_REASONS

MAX_TEXT = 300
BURST = 3
WINDOW_SECONDS = 10.0
REPORT_SECONDS = 30.0
GLOBAL_LINES = 30  # refusal lines per WINDOW_SECONDS, all addresses together (about 9 KB)
MAX_HOSTS = 10_000  # addresses whose refusals are counted by reason (beyond, only the totals)
# What refusals of a kind from a silo's address most likely say about it (the server's words
# when that silo did not come online).
_LIKELY = {
    "handshake": "closed in the TLS handshake (its certificate not from this run's CA?)",
    "not-tls": "spoke no TLS (started with comm_args.insecure?)",
    "other-run": "were for another run (another --run_id?)",
    "identity": "claimed another rank (its certificate or --rank?)",
}


class RefusalLog:
    """Counts and logs refusals for one rank (thread-safe: gRPC's threads and the gate's call it)."""

    def __init__(self, rank: int, logger: logging.Logger, clock=time.monotonic) -> None:
        self.rank, self.logger, self.clock = rank, logger, clock
        self.totals: Counter = Counter()
        self._lines: Dict[Tuple[str, str], Tuple[int, float]] = {}  # (host, reason) -> (lines in burst, last line)
        self._held_back: Counter = Counter()  # reason -> lines not written since the last report
        self._last_report = clock()
        self._window: Tuple[float, int] = (-float("inf"), 0)  # (start, lines written in it), all addresses
        self._lock = threading.Lock()
        self._by_host: Dict[str, Counter] = {}  # host -> reason -> refusals (at most MAX_HOSTS hosts)

    def refuse(self, host: str, reason: str, text: str, where: str = "") -> None:
        """Count one refusal from ``host`` (``where``: its "host:port", if known) and log it unless
        this (host, reason) has had its share of lines."""
        now = self.clock()
        with self._lock:
            self.totals[reason] += 1
            if host in self._by_host or len(self._by_host) < MAX_HOSTS:
                self._by_host.setdefault(host, Counter())[reason] += 1
            count, last = self._lines.get((host, reason), (0, -float("inf")))
            start, written = self._window
            if now - start >= WINDOW_SECONDS:
                start, written = now, 0
            if written < GLOBAL_LINES and (count < BURST or now - last >= WINDOW_SECONDS):
                self._window = (start, written + 1)
                self._lines[(host, reason)] = (count + 1, now)
                write = True
            else:
                self._held_back[reason] += 1
                write = False
            if len(self._lines) > 10_000:  # many distinct peers: forget the oldest bursts, keep the counts
                for key in sorted(self._lines, key=lambda k: self._lines[k][1])[:5_000]:
                    del self._lines[key]
        if write:
            if len(text) > MAX_TEXT:
                text = text[:MAX_TEXT] + f"... ({len(text)} characters)"
            self.logger.warning("rank %d refused %s from %s: %s", self.rank, _what(reason), where or host, text)

    def seen_from(self, host: str) -> str:
        """What was refused from ``host``, in words ("" if nothing): what a silo that never came
        online most likely got wrong, as far as its address shows."""
        with self._lock:
            counts = dict(self._by_host.get(host, {}))
        parts = [f"{n} {_LIKELY.get(reason, f'refused ({reason})')}" for reason, n in sorted(counts.items())]
        return f"{host} sent: " + "; ".join(parts) if parts else ""

    def tick(self) -> None:
        """Say how many refusal lines were held back since the last report (every REPORT_SECONDS)."""
        now = self.clock()
        with self._lock:
            if now - self._last_report < REPORT_SECONDS or not self._held_back:
                return
            held, self._held_back = dict(self._held_back), Counter()
            seconds, self._last_report = now - self._last_report, now
        self.logger.warning(
            "rank %d: %d more refusals in the last %.0f s not logged one by one (by reason: %s); totals so far: %s",
            self.rank,
            sum(held.values()),
            seconds,
            held,
            dict(self.totals),
        )


def _what(reason: str) -> str:
    return "a connection" if reason in CONNECTION_REASONS else "a message"
