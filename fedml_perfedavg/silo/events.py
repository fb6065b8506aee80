"""What crosses the edge of a silo's protocol (:mod:`.protocol`): events in, actions out, as plain
data. The protocol reads no clock (every event says when it happened: ``now``, on
``time.monotonic()``'s scale), opens no socket, trains nothing and starts no thread; the FedML-facing
silo (fedml_bridge/cross_silo/client.py) turns FedML's messages into these events, carries out the
actions in order, and hands the result of each piece of work (a training, an evaluation, an
announcement's answer, a send that failed) back as an event.

The server's side has the same shape (silo/server/events.py); so do h11 and h2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

# -- how the server answered an announcement -----------------------------------------------------------
TAKEN = "taken"  # the silo is in the run
RUN_FINISHED = "run finished"  # it announced itself after every round ran
RUN_OVER = "run over"  # after the server ended the run early (the words say why)
DISAGREEMENT = "disagreement"  # a value that must agree does not (the words name it)
NOT_THIS_RUN = "not this run"  # another run's id, another rank's certificate or address
TWIN = "twin"  # the server still seats this silo's earlier process
ANSWERS = (TAKEN, RUN_FINISHED, RUN_OVER, DISAGREEMENT, NOT_THIS_RUN, TWIN)

# -- the stages of secure aggregation the silo answers ------------------------------------------------
KEYS, SHARES, SURVIVORS, UNMASK = "keys", "shares", "survivors", "unmask"
STAGES = (KEYS, SHARES, SURVIVORS, UNMASK)


# -- events: the silo's own process ---------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The silo's transport is up: it announces itself."""

    now: float


@dataclass(frozen=True)
class Tick:
    """Time passes with nothing received (the receive loop's idle call, a few times a second)."""

    now: float


@dataclass(frozen=True)
class WorkDone:
    """Every action of the last message was carried out (its sends included): the silo was awake
    until ``now``, however long its training or an upload's retries took."""

    now: float


@dataclass(frozen=True)
class Answered:
    """The server took an announcement (``answer`` :data:`TAKEN`) or refused it (another of
    :data:`ANSWERS`, ``words`` its reason, ``refusal`` the whole refusal as the transport gave it)."""

    now: float
    answer: str
    words: str = ""
    refusal: str = ""


@dataclass(frozen=True)
class Unanswered:
    """An announcement the server did not take by its deadline (``error``: the transport's)."""

    now: float
    error: BaseException


@dataclass(frozen=True)
class Trained:
    """A :class:`Train` done: the trained model, its declared samples, and (shared mode) the counts
    of the received model's evaluation made before training."""

    now: float
    round_idx: int
    weights: Any
    samples: int
    counts: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class Evaluated:
    """An :class:`Evaluate` done: the counts (with the user's DP-SGD account, where the run has one)."""

    now: float
    round_idx: int
    counts: Dict[str, Any]


@dataclass(frozen=True)
class NotDelivered:
    """A send the server did not take (``what`` it was, ``why`` in the transport's words)."""

    now: float
    what: str
    why: str


# -- events: the server's messages --------------------------------------------------------------------
@dataclass(frozen=True)
class ModelArrived:
    """A model to train for round ``round_idx`` on user ``user`` (or, stamped past the last round,
    shared mode's final model); ``terms``: the round's secure-aggregation terms, if any."""

    now: float
    round_idx: int
    user: int
    model: Any
    terms: Optional[Dict[str, Any]] = None
    session: Optional[str] = None


@dataclass(frozen=True)
class EvaluationAsked:
    """The server asks the silo's counts of ``model``, the global model after round ``round_idx``
    (``terms``: secure aggregation's, where the run sums evaluations securely)."""

    now: float
    round_idx: int
    model: Any
    session: Optional[str] = None
    terms: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class SecureStage:
    """A stage message of secure aggregation (``stage``: one of :data:`STAGES`; ``kind``: its wire
    type, which the round's party answers) for round ``round_idx``."""

    now: float
    stage: str
    kind: int
    round_idx: int
    params: Dict[str, Any]


@dataclass(frozen=True)
class StatusCheck:
    """The server checks the silo is there; ``left_out``: it gave up on the silo (it answered late)."""

    now: float
    left_out: bool = False


@dataclass(frozen=True)
class FinishArrived:
    """The run is over: finished (no ``reason``), ended early (``reason``), or this silo refused."""

    now: float
    reason: Optional[str] = None
    refused: bool = False


SERVER_MESSAGES = (ModelArrived, EvaluationAsked, SecureStage, StatusCheck, FinishArrived)


# -- actions ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Announce:
    """Send the silo's ONLINE status with its announcement; answer with :class:`Answered` or,
    not taken by ``deadline``, :class:`Unanswered`."""

    deadline: float


@dataclass(frozen=True)
class Train:
    """Load ``model`` and user ``user``'s data, evaluate the model first where ``figures`` (shared
    mode's counts), train round ``round_idx``; answer with :class:`Trained`."""

    round_idx: int
    user: int
    model: Any
    figures: bool = False


@dataclass(frozen=True)
class Evaluate:
    """Load ``model`` and user ``user``'s data and evaluate it for round ``round_idx``; ``final``:
    shared mode's final model (the received model's figures, not a data owner's use); answer with
    :class:`Evaluated`."""

    round_idx: int
    user: int
    model: Any
    final: bool = False


@dataclass(frozen=True)
class SendUpdate:
    """The round's update in the clear, with the received model's ``counts`` (shared mode)."""

    round_idx: int
    weights: Any
    samples: int
    counts: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class SendEvaluation:
    round_idx: int
    counts: Dict[str, Any]


@dataclass(frozen=True)
class SendSecure:
    """A secure-aggregation message of round ``round_idx`` (wire type ``kind``)."""

    kind: int
    round_idx: int
    params: Dict[str, Any]
    tensors: Any = None


@dataclass(frozen=True)
class SendDecline:
    """This silo's own checks refused round ``round_idx``: the server goes on without it now."""

    round_idx: int
    reason: str


@dataclass(frozen=True)
class SendGoodbye:
    """Shared mode's last word, with the silo's counts of the final model (best effort)."""

    counts: Dict[str, Any]


@dataclass(frozen=True)
class RetryFor:
    """An upload to a server that was up and is gone is retried this long at most."""

    seconds: float


@dataclass(frozen=True)
class StopReceiving:
    """Stop the receive loop (the server is gone)."""


@dataclass(frozen=True)
class Finish:
    """The run is over for this silo: stop as FedML's manager finishes."""


@dataclass(frozen=True)
class Fail:
    """The silo ends with this error (``error`` itself where the transport raised one)."""

    reason: str
    error: Optional[BaseException] = None


Event = Any
Action = Any
Actions = List[Action]
