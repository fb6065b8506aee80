"""What crosses the edge of the cross-silo server's protocol (:mod:`.protocol`): events in, actions
out, as plain data. The protocol reads no clock (every event says when it happened: ``now``, on
``time.monotonic()``'s scale), opens no socket and starts no thread; the FedML-facing server
(:mod:`.server`) turns FedML's messages into these events and carries out the actions in order.

This is the shape of h11 and h2 ("sans-IO"): a test drives the protocol with a list of events and
checks the actions, with no process and no port.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

# -- events ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listening:
    """The server's port is open: silos may announce themselves from now on."""

    now: float


@dataclass(frozen=True)
class Hello:
    """A silo announced itself (its ONLINE status): ``announced`` is :func:`.agreement.hello`'s
    mapping, already checked by the wire (None: it sent none); ``session``: its process."""

    now: float
    silo: int
    announced: Optional[Dict[str, Any]]
    session: Optional[str]


@dataclass(frozen=True)
class Update:
    """A silo's update for round ``stamped``, declaring ``declared`` training samples, with its own
    evaluation ``counts`` of the model it received (shared mode) and its ``training`` figures
    [loss, accuracy] (training_record.py; checked by the wire's schema)."""

    now: float
    silo: int
    stamped: Any
    declared: Any
    model: Any
    counts: Optional[Dict[str, Any]] = None
    training: Optional[List[Any]] = None


@dataclass(frozen=True)
class SecAggMessage:
    """A silo's message of a secure-aggregation stage (``kind``: a ``wire.SECAGG_*`` type) for
    round ``stamped``: its parameters, its tensors (the masked input), its size in bytes."""

    now: float
    silo: int
    kind: int
    stamped: Any
    params: Dict[str, Any]
    model: Any = None
    size: int = 0


@dataclass(frozen=True)
class Evaluation:
    """A silo's counts for an evaluation request (data-owner mode)."""

    now: float
    silo: int
    counts: Any


@dataclass(frozen=True)
class Goodbye:
    """A silo says it is done (shared mode, after the final model), with its evaluation of it."""

    now: float
    silo: int
    counts: Optional[Dict[str, Any]]


@dataclass(frozen=True)
class SiloFailed:
    """A silo says it fails and why (an error in its training or evaluation) before it exits, or
    (``stopped``) that its process was stopped by its operator: a new one may take its place."""

    now: float
    silo: int
    reason: str
    stopped: bool = False


@dataclass(frozen=True)
class SiloDeclined:
    """A silo's own checks refused the round the server sent it (a model, terms or schedule that
    are not this run's, a spent DP budget), and why: the round goes on without it now."""

    now: float
    silo: int
    reason: str


@dataclass(frozen=True)
class Tick:
    """Time passed with nothing received: a deadline may have passed."""

    now: float


@dataclass(frozen=True)
class Undelivered:
    """Sends of a :class:`Send` action (``purpose`` as it said) that did not reach these silos
    before its deadline: silo -> why. ``sent_in``: the protocol's (round, phase) when the send was
    made; sends are carried out in the background, so the protocol may have moved on since (the
    silo was then given up on at the deadline already), and such a report is stale."""

    now: float
    purpose: str
    silos: Dict[int, str]
    sent_in: Optional[Tuple[int, str]] = None


@dataclass(frozen=True)
class Stopped:
    """The server process ends for a reason of its own (a signal, an error): ``reason`` says which.
    ``failed``: the run failed (an error), not merely interrupted."""

    now: float
    reason: str
    failed: bool = False


Event = Any  # one of the classes above

# -- actions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToSilo:
    """One message from the server to ``silo``: a type of :mod:`.wire`, the model where it carries
    one, the user it is about, the round it is stamped with, and the plugin's flags."""

    kind: int
    silo: int
    round: int
    model: Any = None
    user: Optional[int] = None
    reason: Optional[str] = None
    refused: bool = False
    left_out: bool = False
    params: Optional[Dict[str, Any]] = None  # more of the wire's keys (secure aggregation's)


# What a Send is for, as an Undelivered event names it back.
ROUND, EVALUATION, FINAL, NOTICE = "round", "evaluation", "final", "notice"


@dataclass(frozen=True)
class Send:
    """Deliver ``messages`` at once, each before ``deadline``; the silos not reached come back as
    one :class:`Undelivered` event with this ``purpose``, except for notices (``NOTICE``: best
    effort within ``deadline``, a failure is only logged)."""

    messages: Tuple[ToSilo, ...]
    deadline: float
    purpose: str


@dataclass(frozen=True)
class Record:
    """Hand the run's record one fact: ``method`` of the run's
    :class:`~fedml_perfedavg.silo.server.records.SiloServerDriver` (``round_finished``, ``record_lost_silos``,
    ...) with ``args``. ``record_refusals`` takes the transport's totals at that point."""

    method: str
    args: Tuple[Any, ...] = ()


@dataclass(frozen=True)
class Refuse:
    """Count and log (rate-limited) a refused message of ``silo``'s, by ``kind``."""

    silo: int
    kind: str
    text: str


@dataclass(frozen=True)
class EndRun:
    """The run is over (``reason``: it failed or was stopped; None: it finished). Tell ``live``
    within ``seconds`` and then ``given_up`` (they may still be waiting) within ``given_up_seconds``,
    waiting on none that does not answer; ``heard_from`` listened once, so a closed port means they
    ended. ``stop_listening``: close the server's port at once (an early end)."""

    reason: Optional[str]
    live: Tuple[int, ...]
    given_up: Tuple[int, ...]
    heard_from: Tuple[int, ...]
    seconds: float
    given_up_seconds: float
    stop_listening: bool = True


@dataclass(frozen=True)
class Finish:
    """The server's part is over: FedML's ``finish()``."""


@dataclass(frozen=True)
class Fail:
    """The run stops with ``error`` (raised by the FedML-facing server once the actions before it
    were carried out)."""

    error: BaseException


Action = Any  # one of ToSilo's senders above: Send, Record, Refuse, EndRun, Finish, Fail


@dataclass
class Outbox:
    """The actions of one event, in order: what the protocol's pieces append to."""

    actions: List[Action] = field(default_factory=list)

    def send(self, messages: List[ToSilo], deadline: float, purpose: str) -> None:
        if messages:
            self.actions.append(Send(tuple(messages), deadline, purpose))

    def record(self, method: str, *args: Any) -> None:
        self.actions.append(Record(method, args))

    def refuse(self, silo: int, kind: str, text: str) -> None:
        self.actions.append(Refuse(silo, kind, text))

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def take(self) -> List[Action]:
        actions, self.actions = self.actions, []
        return actions
