"""The cross-silo wire format: FedML's cross-silo messages as data only, never a pickle.

FedML's gRPC transport (core/distributed/communication/grpc/grpc_comm_manager.py) sends
``pickle.dumps(Message)`` and calls ``pickle.loads`` on whatever a peer sends, so any process
that reaches a port runs code in it. Here a message is

    MAGIC (8 bytes) | header length (4 bytes, big-endian) | header (UTF-8 JSON) | tensors

where the tensors (a model's state dict) are one ``safetensors`` blob: a format that can only
produce arrays. Decoding checks the size cap before it reads anything, bounds the header's
length and nesting before parsing it, then checks the header against :data:`SCHEMA` (the
message types of FedML's cross-silo protocol and the plugin's own, each with its keys and their
types and ranges); anything else raises :class:`Rejected`, whose ``reason`` is a short code the
transport counts by and whose text never echoes more than a few dozen characters of what came.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..core.evaluation import MAX_OWN_METRICS
from ..core.training_record import valid_figures

MAGIC = b"PFAWIRE2"
_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 256 * 1024  # ids, a few figures and the model's tensor names; the model rides in the tensors
MAX_BRACKETS = 256  # a header of the protocol nests a handful of lists and mappings: this bounds the parser's work
MAX_TENSORS = 100_000
MODEL_KEY = "model_params"  # FedML's MyMessage.MSG_ARG_KEY_MODEL_PARAMS
SILO_METRICS = "plugin_silo_metrics"  # a silo's personalized evaluation: counts, never ratios (see _counts)
TRAINING = "plugin_training"  # a silo's training figures of its update: [loss, accuracy] (training_record.py)
HELLO = "plugin_hello"  # what a silo announces when it comes online (silo/server/agreement.py)
REASON = "plugin_reason"  # why the server ends the run early, or a silo's part, on FINISH
REFUSED = "plugin_refused"  # on FINISH: the server refused this silo (its announcement), REASON says why
LEFT_OUT = "plugin_left_out"  # on CHECK_STATUS: the server gave up on this silo; it announces itself again

# FedML's cross-silo message types (cross_silo/server/message_define.py, client/message_define.py)
# and the plugin's own (100 and up: FedML uses none there).
INIT_CONFIG, SYNC_MODEL, UPLOAD, CLIENT_STATUS, CHECK_STATUS, FINISH = 1, 2, 3, 5, 6, 7
EVALUATE, EVALUATION = 101, 102  # data-owner mode: the server asks every silo to evaluate a model; the counts
# Secure aggregation's stages (fedml_perfedavg/secagg/rounds.py): what the server relays to a silo,
# and what a silo sends it.
SECAGG_KEYS, SECAGG_SHARES, SECAGG_UNMASK, SECAGG_SURVIVORS = 103, 104, 105, 110
SECAGG_ADVERT, SECAGG_SHARES_OUT, SECAGG_MASKED, SECAGG_UNMASKING, SECAGG_SIGNED = 106, 107, 108, 109, 111
SECAGG_FROM_SILO = frozenset({SECAGG_ADVERT, SECAGG_SHARES_OUT, SECAGG_MASKED, SECAGG_UNMASKING, SECAGG_SIGNED})
FROM_SERVER = frozenset(
    {
        INIT_CONFIG,
        SYNC_MODEL,
        CHECK_STATUS,
        FINISH,
        EVALUATE,
        SECAGG_KEYS,
        SECAGG_SHARES,
        SECAGG_SURVIVORS,
        SECAGG_UNMASK,
    }
)
FROM_SILO = frozenset({UPLOAD, CLIENT_STATUS, EVALUATION}) | SECAGG_FROM_SILO
SECAGG = "plugin_secagg"  # on a round's model: the round's secure-aggregation terms (threshold, bits, ...)
MASKED_KEY = "masked"  # the one tensor of SECAGG_MASKED: the masked input's 32-bit words
MODEL_MESSAGES = frozenset({INIT_CONFIG, SYNC_MODEL})  # a model a silo answers with an upload

# Reasons a message is refused (counted by these codes; summary.json's ``refusals``).
MALFORMED, PICKLE, OVERSIZE = "malformed", "pickle", "oversize"


DISAGREEMENT = "disagreement"  # an announcement the server refuses (its fingerprint, its data)
RUN_OVER = "run-over"  # an announcement that comes after the server ended the run
RUN_FINISHED = "the run is over (it finished)"  # RUN_OVER's words when every round ran


class Rejected(ValueError):
    """Bytes that are not a well-formed message of the protocol, or a message this rank does not
    take now; the text says what is wrong, ``reason`` is the code it is counted by. ``counted``:
    False where the protocol counts and logs it itself (a refused announcement)."""

    def __init__(self, message: str, reason: str = MALFORMED, *, counted: bool = True) -> None:
        super().__init__(message)
        self.reason, self.counted = reason, counted

    def words(self) -> str:
        """What the sender is told (its text cut to 400 characters); :func:`refusal_reason` reads
        the reason back."""
        return f"refused ({self.reason}): {str(self)[:400]}"


def refusal_reason(words: Optional[str]) -> Optional[str]:
    """The reason code in a refusal's words (:meth:`Rejected.words`), None if there is none."""
    if not words or not words.startswith("refused ("):
        return None
    return words[len("refused (") :].partition(")")[0]


def refusal_text(words: str) -> str:
    """A refusal's words (:meth:`Rejected.words`) without their reason code."""
    return words.partition("): ")[2] if refusal_reason(words) is not None else words


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: what a refusal may echo of a peer's input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def _whole(value: Any, low: int = 0, high: int = 2**31) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _digits(value: Any) -> bool:  # FedML sends the client index as a decimal string
    return isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 12


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    """A sample count: a whole number, not negative, below 2^31 (a float that holds one too:
    FedML's own trainers send ``len(...)`` as int, some loaders a float)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _whole(value)


def _text(value: Any, limit: int = 64) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _counts(value: Any) -> bool:
    """A silo's personalized evaluation of one model on one user: whole counts of its test
    split (correct after and before the alpha-step, and the total), the mean loss, and (``own``)
    the algorithm's own figures by name (the server checks the names are its algorithm's)."""
    if value is None:
        return True
    keys = {"round", "user", "correct", "correct_before", "total", "loss"}
    if not isinstance(value, dict) or not keys <= set(value) <= keys | {"privacy", "own"}:
        return False
    if "privacy" in value and not _privacy(value["privacy"], value["user"]):
        return False
    if "own" in value and not _own_figures(value["own"]):
        return False
    return (
        all(_whole(value[k]) for k in ("round", "user", "correct", "correct_before", "total"))
        and value["total"] > 0
        and value["correct"] <= value["total"]
        and value["correct_before"] <= value["total"]
        and _number(value["loss"])
        and 0 <= value["loss"] < 1e12
    )


def _own_figures(value: Any) -> bool:
    """An algorithm's own figures of one user: a few names (identifiers), finite numbers."""
    return (
        isinstance(value, dict)
        and 0 < len(value) <= MAX_OWN_METRICS
        and all(_text(k) and k.isidentifier() and _number(v) for k, v in value.items())
    )


def _privacy(value: Any, user: Any) -> bool:
    """A data owner's silo's DP-SGD account of its own user: epsilon, uses and sample rate."""
    return (
        isinstance(value, dict)
        and set(value) == {"user", "epsilon", "uses", "sample_rate"}
        and _whole(value["user"])
        and value["user"] == user
        and _number(value["epsilon"])
        and 0 <= value["epsilon"] < 1e12
        and _whole(value["uses"])
        and _number(value["sample_rate"])
        and 0 <= value["sample_rate"] <= 1
    )


_SCALAR_LIMIT = 200


def _scalar(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool)
        or _whole(value, -(2**62), 2**62)
        or _number(value)
        or _text(value, _SCALAR_LIMIT)
    )


def _hello(value: Any) -> bool:
    """What a silo announces: the values that must agree with the server's, and its data's shape."""
    if not isinstance(value, dict) or set(value) != {
        "fingerprint",
        "user",
        "train",
        "test",
        "input_shape",
        "input_dtype",
        "classes",
        "problem",
    }:
        return False
    if value["problem"] is not None and not _text(value["problem"], 500):
        return False
    fingerprint = value["fingerprint"]
    if (
        not isinstance(fingerprint, dict)
        or len(fingerprint) > 64
        or not all(_text(k) and _scalar(v) for k, v in fingerprint.items())
    ):
        return False
    if value["user"] is not None and not _whole(value["user"]):
        return False
    if value["train"] is None:  # shared mode: no data of its own to announce
        return (
            value["test"] is None
            and value["input_shape"] is None
            and value["input_dtype"] is None
            and value["classes"] is None
        )
    shape, classes = value["input_shape"], value["classes"]
    return (
        _whole(value["train"], 1)
        and _whole(value["test"], 1)
        and isinstance(shape, list)
        and len(shape) <= 8
        and all(_whole(d, 1) for d in shape)
        and _text(value["input_dtype"], 16)
        and isinstance(classes, list)
        and 0 < len(classes) <= 100_000
        and all(_whole(c) for c in classes)
    )


def _b64(value: Any, max_bytes: int) -> bool:
    """Base64 text of at most ``max_bytes`` bytes (keys, shares, signatures)."""
    if not isinstance(value, str) or len(value) > 4 * (max_bytes // 3 + 1):
        return False
    try:
        return len(base64.b64decode(value, validate=True)) <= max_bytes
    except ValueError:
        return False


MAX_SILOS = 10_000


def _pairs(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A list of [rank, value] pairs, ranks distinct, each value passing ``check``."""

    def pairs(value: Any) -> bool:
        return (
            isinstance(value, list)
            and len(value) <= MAX_SILOS
            and all(isinstance(p, list) and len(p) == 2 and _whole(p[0], 1) and check(p[1]) for p in value)
            and len({p[0] for p in value}) == len(value)
        )

    return pairs


def _advert(value: Any) -> bool:
    """A silo's round keys: its public key for each pair ([rank, key]), its mask key, a seed
    commitment, a signature, its certificate (PEM), the digest of the round's terms as it was given them."""
    return (
        isinstance(value, list)
        and len(value) == 6
        and _pairs(lambda v: _b64(v, 32))(value[0])
        and all(_b64(v, 32) for v in value[1:3])
        and _b64(value[3], 160)
        and _text(value[4], 8192)
        and _b64(value[5], 32)
    )


def _signature(value: Any) -> bool:
    return _b64(value, 160)


def _adverts(value: Any) -> bool:
    return _pairs(_advert)(value)


def _ciphertext(value: Any) -> bool:
    """[ciphertext, its sender's signature over it]."""
    return isinstance(value, list) and len(value) == 2 and _b64(value[0], 512) and _signature(value[1])


def _unmasking(value: Any) -> bool:
    """[owner, "seed" or "key", Shamir index, share] for each silo that shared (["pair", 0, its
    pair-mask seed] for one proven to have sent shares that do not decrypt)."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_SILOS
        and all(
            isinstance(p, list)
            and len(p) == 4
            and _whole(p[0], 1)
            and p[1] in ("seed", "key", "pair")
            and _whole(p[2], 0 if p[1] == "pair" else 1, 65536)
            and _b64(p[3], 32)
            for p in value
        )
        and len({p[0] for p in value}) == len(value)
    )


def _ranks(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= MAX_SILOS and all(_whole(r, 1) for r in value)


def _secagg_terms(value: Any) -> bool:
    """The round's secure-aggregation terms, as the server sends them with its model."""
    return (
        isinstance(value, dict)
        and set(value) == {"threshold", "bits", "weight", "bound", "length", "silos", "counts"}
        and _whole(value["threshold"], 2)
        and _whole(value["bits"], 0, 31)
        and _number(value["weight"])
        and 0 < value["weight"] <= 1
        and _number(value["bound"])
        and value["bound"] > 0
        and _whole(value["length"], 1)
        and _ranks(value["silos"])
        and 0 < len(value["silos"])
        and (value["counts"] is None or _pairs(lambda n: _whole(n, 1))(value["counts"]))
    )


FAILED = "FAILED"  # a silo's last word: it fails, and why (REASON)
DECLINED = "DECLINED"  # a silo's own checks refused the round the server sent, and why (REASON); it stays
LEAVING = "LEAVING"  # a silo's last word when its process is stopped (SIGINT, SIGTERM): given up on at once


def _status(value: Any) -> bool:
    return value in ("ONLINE", "FINISHED", FAILED, LEAVING, DECLINED)


def _flag(value: Any) -> bool:
    return value is True  # a flag is sent only when set


# type -> {key: (check, required)}; MODEL_KEY is carried by the tensors, not the header.
SCHEMA: Dict[int, Dict[str, Tuple[Callable[[Any], bool], bool]]] = {
    INIT_CONFIG: {"client_idx": (_digits, True), "client_os": (_text, False), SECAGG: (_secagg_terms, False)},
    SYNC_MODEL: {"client_idx": (_digits, True), "client_os": (_text, False), SECAGG: (_secagg_terms, False)},
    CHECK_STATUS: {"client_idx": (_digits, True), LEFT_OUT: (_flag, False)},
    FINISH: {
        "client_idx": (_digits, True),
        REASON: (lambda v: _text(v, 2000), False),
        REFUSED: (_flag, False),
    },
    EVALUATE: {"client_idx": (_digits, True), SECAGG: (_secagg_terms, False)},
    UPLOAD: {"num_samples": (_count, True), SILO_METRICS: (_counts, False), TRAINING: (valid_figures, False)},
    CLIENT_STATUS: {
        "client_status": (_status, True),
        "client_os": (_text, False),
        SILO_METRICS: (_counts, False),
        HELLO: (_hello, False),
        REASON: (lambda v: _text(v, 2000), False),
    },
    EVALUATION: {SILO_METRICS: (_counts, True)},
    SECAGG_KEYS: {"client_idx": (_digits, True), "adverts": (_adverts, True)},
    SECAGG_SHARES: {"client_idx": (_digits, True), "shares": (_pairs(_ciphertext), True)},
    SECAGG_SURVIVORS: {"client_idx": (_digits, True), "survivors": (_ranks, True)},
    SECAGG_UNMASK: {
        "client_idx": (_digits, True),
        "survivors": (_ranks, True),
        "signatures": (_pairs(_signature), True),
        "liars": (_ranks, False),
    },
    SECAGG_ADVERT: {
        "advert": (_advert, True),
        "privacy": (lambda v: isinstance(v, dict) and _privacy(v, v.get("user")), False),
    },
    SECAGG_SHARES_OUT: {"shares": (_pairs(_ciphertext), True)},
    SECAGG_MASKED: {"accusations": (_pairs(lambda v: _b64(v, 32)), False)},
    SECAGG_UNMASKING: {"shares": (_unmasking, True)},
    SECAGG_SIGNED: {"signature": (_signature, True)},
}
CARRIES_MODEL = frozenset({INIT_CONFIG, SYNC_MODEL, UPLOAD, EVALUATE, SECAGG_MASKED})
_HEADER_KEYS = {
    "type",
    "sender",
    "receiver",
    "run_id",
    "session",
    "resumes",
    "round",
    "seq",
    "reply_to",
    "params",
    "tensors",
}
_ALLOWED_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
}


@dataclass
class Envelope:
    """One message of the protocol, decoded: who sent it to whom, for which run and round, and
    its content. ``session`` names the sending process (a silo that restarts starts a new one);
    ``seq`` numbers its messages to this receiver (strictly increasing within a session);
    ``reply_to`` is the ``seq`` of the model an upload answers (-1: none); ``resumes`` names the
    session of the server process a resumed server continues ("" for none)."""

    type: int
    sender: int
    receiver: int
    run_id: str
    round: int
    seq: int
    params: Dict[str, Any] = field(default_factory=dict)
    model: Optional["OrderedDict[str, torch.Tensor]"] = None
    reply_to: int = -1
    session: str = "0"
    resumes: str = ""
    size: int = 0  # bytes on the wire (set when decoded)
    arrived: float = 0.0  # when the receiver took it (time.monotonic(); set by the transport)


def _as_state_dict(model: Any, msg_type: int) -> "OrderedDict[str, torch.Tensor]":
    if not isinstance(model, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise TypeError(
            f"message type {msg_type}: the cross-silo transport carries model parameters as a dict of "
            f"named tensors (a state_dict); got {type(model).__name__}"
        )
    # safetensors needs contiguous tensors that share no storage; clone keeps the sender's model intact.
    return OrderedDict((k, v.detach().to("cpu").contiguous().clone()) for k, v in model.items())


def encode(envelope: Envelope) -> bytes:
    """The bytes of ``envelope`` (raises ``TypeError``/``ValueError`` for content the schema does
    not allow: the sender's own bug, caught before anything is sent)."""
    schema = SCHEMA.get(envelope.type)
    if schema is None:
        raise ValueError(f"message type {envelope.type!r} is not part of the cross-silo protocol")
    for key, value in envelope.params.items():
        check = schema.get(key)
        if check is None or not check[0](value):
            raise ValueError(f"message type {envelope.type}: parameter {key}={short(value)} is not allowed")
    tensors = b""
    order = None
    if envelope.type in CARRIES_MODEL:
        if envelope.model is None:
            raise ValueError(f"message type {envelope.type}: a model is required")
        state = _as_state_dict(envelope.model, envelope.type)
        order = list(state)
        tensors = save_tensors(dict(state)) if state else b""
    header = json.dumps(
        {
            "type": envelope.type,
            "sender": envelope.sender,
            "receiver": envelope.receiver,
            "run_id": envelope.run_id,
            "session": envelope.session,
            "resumes": envelope.resumes,
            "round": envelope.round,
            "seq": envelope.seq,
            "reply_to": envelope.reply_to,
            "params": envelope.params,
            "tensors": order,
        },
        separators=(",", ":"),
        allow_nan=False,
    ).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + tensors


def _int(header: Dict[str, Any], key: str, low: int = 0) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**62:
        raise Rejected(f"header field {key!r}={short(value)} is not an integer >= {low}")
    return value


def _parse_header(raw: bytes) -> Any:
    """The header's JSON, parsed within fixed bounds: a header that nests more than the protocol
    ever does is refused before the parser sees it (deep nesting is how a JSON parser is driven
    into recursion); the parser's own limits are caught, never passed on."""
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:
        raise Rejected(f"the header holds more than {MAX_BRACKETS} brackets; the protocol's never do")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise Rejected(f"header is not UTF-8 JSON ({type(err).__name__}: {short(str(err), 80)})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")  # NaN and Infinity: Python's json takes them, JSON does not


def decode(data: bytes, max_bytes: int) -> Envelope:
    """The message in ``data``, or :class:`Rejected` naming what is wrong. Nothing is read from a
    message over ``max_bytes``; nothing in it can run code; the work is bounded by its size."""
    if len(data) > max_bytes:
        raise Rejected(f"{len(data)} bytes, over the size cap of {max_bytes} (comm_args.max_message_bytes)", OVERSIZE)
    if not data.startswith(MAGIC):
        if data[:1] == b"\x80":
            raise Rejected(
                "not a message of this protocol (a pickle: FedML's own gRPC transport, or an attack)", PICKLE
            )
        raise Rejected("not a message of this protocol (or of another version of it)")
    if len(data) < len(MAGIC) + _LENGTH.size:
        raise Rejected("truncated before the header")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise Rejected(f"header length {length} is over {MAX_HEADER_BYTES} bytes or past the message's end")
    header = _parse_header(data[start : start + length])
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise Rejected(f"header fields must be {sorted(_HEADER_KEYS)}")
    msg_type = header["type"]
    schema = SCHEMA.get(msg_type) if isinstance(msg_type, int) and not isinstance(msg_type, bool) else None
    if schema is None:
        raise Rejected(f"message type {short(msg_type)} is not part of the cross-silo protocol")
    run_id, session = header["run_id"], header["session"]
    if not isinstance(run_id, str) or len(run_id) > 128:
        raise Rejected(f"run_id={short(run_id)} is not a string of at most 128 characters")
    if not isinstance(session, str) or not 0 < len(session) <= 32 or not session.isalnum():
        raise Rejected(f"session={short(session)} is not 1 to 32 letters and digits")
    resumes = header["resumes"]
    if not isinstance(resumes, str) or len(resumes) > 32 or not (resumes == "" or resumes.isalnum()):
        raise Rejected(f"resumes={short(resumes)} is not empty or 1 to 32 letters and digits")
    params = header["params"]
    if not isinstance(params, dict):
        raise Rejected("params must be a mapping")
    for key, value in params.items():
        check = schema.get(key)
        if check is None:
            raise Rejected(f"message type {msg_type}: unexpected parameter {short(key)}")
        if not check[0](value):
            raise Rejected(f"message type {msg_type}: parameter {key}={short(value)} has the wrong type or range")
    missing = [k for k, (_, required) in schema.items() if required and k not in params]
    if missing:
        raise Rejected(f"message type {msg_type}: missing parameter(s) {missing}")
    envelope = Envelope(
        type=msg_type,
        sender=_int(header, "sender"),
        receiver=_int(header, "receiver"),
        run_id=run_id,
        round=_int(header, "round"),
        seq=_int(header, "seq"),
        params=params,
        reply_to=_int(header, "reply_to", low=-1),
        session=session,
        resumes=resumes,
    )
    envelope.model = _decode_model(msg_type, header["tensors"], data[start + length :])
    envelope.size = len(data)
    return envelope


def _decode_model(msg_type: int, order: Any, blob: bytes) -> Optional["OrderedDict[str, torch.Tensor]"]:
    if msg_type not in CARRIES_MODEL:
        if order is not None or blob:
            raise Rejected(f"message type {msg_type} carries no model")
        return None
    if (
        not isinstance(order, list)
        or len(order) > MAX_TENSORS
        or not all(isinstance(k, str) and 0 < len(k) <= 512 for k in order)
        or len(set(order)) != len(order)
    ):
        raise Rejected(
            f"the model's tensor names must be a list of at most {MAX_TENSORS} distinct strings of 1 to 512 characters"
        )
    if not order:
        if blob:
            raise Rejected("tensor bytes without tensor names")
        return OrderedDict()
    try:
        tensors = load_tensors(blob)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise Rejected(
            f"the tensors are not a valid safetensors blob ({type(err).__name__}: {short(str(err), 80)})"
        ) from None
    if set(tensors) != set(order):
        raise Rejected("the tensor names in the header and in the tensors differ")
    bad = [k for k, v in tensors.items() if v.dtype not in _ALLOWED_DTYPES]
    if bad:
        raise Rejected(f"tensor(s) {short(bad[:3])} have a dtype the protocol does not carry")
    return OrderedDict((k, tensors[k]) for k in order)


def model_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors (what a model message carries, less the headers)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def default_size_cap(state: Mapping[str, torch.Tensor]) -> int:
    """The default per-message cap: twice the model's bytes plus 1 MiB for the headers."""
    return 2 * model_bytes(state) + (1 << 20)
