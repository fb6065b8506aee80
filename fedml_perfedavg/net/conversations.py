"""What one cross-silo rank knows of its exchanges with each peer, apart from the transport that
carries them (transport.py): the sequence numbers it sent and accepted, each peer's process (its
session), and the models a silo has not answered yet. Every check of order is here: replays, an
upload that answers no open model, a message from a process that a newer one replaced. Who may
send what to whom (certificates, addressing, the run id) is the transport's check, made first."""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Set, Tuple

from . import wire

logger = logging.getLogger(__name__)

REPLAY, STALE, SESSION = "replay", "stale", "session"  # refusal reasons, counted by these codes
TWIN = "twin-session"  # a second process announcing with the key of a rank whose process holds its seat


class Conversations:
    """Per-peer order of one rank's messages; safe to use from gRPC's threads and the sender's."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)  # a message stamped earlier to its receiver left
        self._sent_seq: Dict[int, int] = {}  # receiver -> last seq sent
        # receiver -> seqs stamped and not yet delivered or given up on: a receiver takes a sequence
        # in order, so a message waits for the ones stamped before it (see wait_turn)
        self._on_the_way: Dict[int, Set[int]] = {}
        self._seen_seq: Dict[int, int] = {}  # sender -> last seq accepted (in its current session)
        self._sessions: Dict[int, str] = {}  # sender -> its current session
        self._retired: Dict[int, Set[str]] = {}  # sender -> its earlier sessions (their messages are replays now)
        self._seated: Set[int] = set()  # the server: silos whose current session no new one may replace
        # silo -> seqs of the models sent to it and not answered yet. Usually one; FedML's own server
        # sends a silo its first model twice when the silo reports online twice (it has no guard).
        self._open_models: Dict[int, Set[int]] = {}
        self.last_model: Tuple[int, int] = (-1, 0)  # a silo: (seq, round) of the server's last model
        self.finish_received = False  # a silo: the server said the run is over (sends stop retrying)

    def next_seq(self, kind: int, receiver: int) -> int:
        """The sequence number of the next message of type ``kind`` to ``receiver``; a model is
        open (its answer awaited) from now, before it is sent, since the answer may come first."""
        with self._lock:
            seq = self._sent_seq.get(receiver, -1) + 1
            self._sent_seq[receiver] = seq
            self._on_the_way.setdefault(receiver, set()).add(seq)
            if kind in wire.MODEL_MESSAGES:
                self._open_models.setdefault(receiver, set()).add(seq)
        return seq

    def wait_turn(self, receiver: int, seq: int, deadline: float) -> bool:
        """Wait until every message stamped before ``seq`` for ``receiver`` was delivered or given
        up on (:meth:`left`); False at ``deadline`` (``time.monotonic()``). The receiver refuses a
        sequence number below one it took as a replay, so a message sent in the background (a
        round's model) overtaken by a later one (the end of the run) would be lost (CI run of
        067e7bb: a silo never saw the round it had to refuse)."""
        with self._turn:
            while any(earlier < seq for earlier in self._on_the_way.get(receiver, ())):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._turn.wait(left)
            return True

    def left(self, receiver: int, seq: int) -> None:
        """Message ``seq`` to ``receiver`` was delivered, refused or given up on: the next may go."""
        with self._turn:
            self._on_the_way.get(receiver, set()).discard(seq)
            self._turn.notify_all()

    def hold_seats(self, silos: Set[int]) -> None:
        """The server: ``silos``' current processes keep their seats (they take part in training and
        have missed no deadline); a second process announcing with one's key is refused, and the
        seat changes hands only once the silo is given up on (see :meth:`_check_session`)."""
        with self._lock:
            self._seated = set(silos)

    def admit(self, envelope: wire.Envelope) -> None:
        """Accept ``envelope``'s place in its sender's sequence, or :class:`wire.Rejected`."""
        sender, kind = envelope.sender, envelope.type
        with self._lock:
            self._check_session(envelope)
            last = self._seen_seq.get(sender, -1)
            if envelope.seq <= last:
                raise wire.Rejected(
                    f"type {kind} from rank {sender} is a replay (sequence {envelope.seq}, already at {last})", REPLAY
                )
            if kind == wire.UPLOAD:
                if envelope.reply_to not in self._open_models.get(sender, ()):
                    raise wire.Rejected(
                        f"an upload from rank {sender} for round {envelope.round} answers no open "
                        f"model (a round already closed, or a second upload in one round)",
                        STALE,
                    )
                self._open_models[sender] = set()  # one answer closes every model sent before it
            self._seen_seq[sender] = envelope.seq
            self.finish_received |= kind == wire.FINISH
            if kind in wire.MODEL_MESSAGES:
                self.last_model = (envelope.seq, envelope.round)

    def _check_session(self, envelope: wire.Envelope) -> None:
        """A sender's messages come from one process at a time (its session). A silo that restarts
        starts a new session, which only its announcement (an ONLINE status) may open; from then on
        the earlier session's messages are replays; while the silo's current process holds its
        seat (:meth:`hold_seats`), no new one may open. A silo takes one server session: the first,
        or one that resumes it (:meth:`_resumes`)."""
        sender, session = envelope.sender, envelope.session
        current = self._sessions.get(sender)
        if current == session:
            return
        if current is not None:
            if session in self._retired.get(sender, set()):
                raise wire.Rejected(
                    f"type {envelope.type} from rank {sender} comes from an earlier process of that "
                    f"rank (session {session}), which a newer one replaced",
                    REPLAY,
                )
            if self._resumes(envelope, current):
                return
            announces = envelope.type == wire.CLIENT_STATUS and envelope.params.get("client_status") == "ONLINE"
            if self.rank != 0 or not announces:
                raise wire.Rejected(
                    f"type {envelope.type} from rank {sender} comes from another process of that rank "
                    f"(session {session}, this rank talks to session {current})"
                    + ("; a silo's new process must announce itself first" if self.rank == 0 else ""),
                    SESSION,
                )
            if sender in self._seated:
                raise wire.Rejected(
                    f"rank {sender} announced itself from a second process (session {session}) while its "
                    f"process (session {current}) takes part; the seat changes hands only once that process "
                    f"misses a deadline (a restarted silo is taken back then); two processes with one key?",
                    TWIN,
                )
            self._retired.setdefault(sender, set()).add(current)
            self._open_models.pop(sender, None)
            logger.warning(
                "rank %d: rank %d is a new process (session %s); messages of its earlier process are "
                "refused from now on",
                self.rank,
                sender,
                session,
            )
        self._sessions[sender] = session
        self._seen_seq[sender] = -1

    def _resumes(self, envelope: wire.Envelope, current: str) -> bool:
        """A silo: ``envelope`` comes from a server process that resumed the one this silo talks
        to (its checkpoint names that session), so it takes the new session from now on (the
        certificate says it is the server; a run already over is not resumed)."""
        if self.rank == 0 or envelope.sender != 0 or envelope.resumes != current or self.finish_received:
            return False
        self._retired.setdefault(0, set()).add(current)
        self._sessions[0], self._seen_seq[0] = envelope.session, -1
        self._open_models.pop(0, None)
        logger.warning(
            "rank %d: the server resumed (session %s continues session %s); the earlier process's "
            "messages are refused from now on",
            self.rank,
            envelope.session,
            current,
        )
        return True
