"""The cross-silo wire format: FedML's cross-silo messages as data only, never a pickle.

FedML's gRPC transport (core/distributed/communication/grpc/grpc_comm_manager.py) sends
``pickle.dumps(Message)`` and calls ``pickle.loads`` on whatever a peer sends, so any process
that reaches a port runs code in it. Here a message is

    MAGIC (8 bytes) | header length (4 bytes, big-endian) | header (UTF-8 JSON) | tensors

where the tensors (a model's state dict) are one ``safetensors`` blob: a format that can only
produce arrays. Decoding checks the size cap before it reads anything, then the header against
:data:`SCHEMA` (the message types FedML's cross-silo protocol uses, each with its keys and their
types); anything else raises :class:`Rejected`, which the transport logs with the peer's address.
"""
from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

MAGIC = b"PFAWIRE1"
_LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 64 * 1024  # the header holds ids and a few metrics; a model rides in the tensors
MODEL_KEY = "model_params"  # FedML's MyMessage.MSG_ARG_KEY_MODEL_PARAMS
SILO_METRICS = "plugin_silo_metrics"  # a silo's own personalized evaluation of the model it received

# FedML's cross-silo message types (cross_silo/server/message_define.py, client/message_define.py).
INIT_CONFIG, SYNC_MODEL, UPLOAD, CLIENT_STATUS, CHECK_STATUS, FINISH = 1, 2, 3, 5, 6, 7
FROM_SERVER = frozenset({INIT_CONFIG, SYNC_MODEL, CHECK_STATUS, FINISH})
FROM_SILO = frozenset({UPLOAD, CLIENT_STATUS})
MODEL_MESSAGES = frozenset({INIT_CONFIG, SYNC_MODEL})


class Rejected(ValueError):
    """Bytes that are not a well-formed message of the protocol; the text says what is wrong."""


def _digits(value: Any) -> bool:  # FedML sends the client index as a decimal string
    return isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 12


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:  # a sample count weighs the average: finite and not negative
    return _number(value) and math.isfinite(value) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 64


def _metrics(value: Any) -> bool:
    """A silo's evaluation: {round, user, accuracy, accuracy_before_adaptation} or None."""
    if value is None:
        return True
    if not isinstance(value, dict) or set(value) != {"round", "user", "accuracy", "accuracy_before_adaptation"}:
        return False
    return all(isinstance(value[k], int) and not isinstance(value[k], bool) for k in ("round", "user")) and \
        all(_number(value[k]) and (math.isnan(value[k]) or 0 <= value[k] <= 1)
            for k in ("accuracy", "accuracy_before_adaptation"))


def _status(value: Any) -> bool:
    return value in ("ONLINE", "FINISHED")


# type -> {key: (check, required)}; MODEL_KEY is carried by the tensors, not the header.
SCHEMA: Dict[int, Dict[str, Tuple[Callable[[Any], bool], bool]]] = {
    INIT_CONFIG: {"client_idx": (_digits, True), "client_os": (_text, False)},
    SYNC_MODEL: {"client_idx": (_digits, True), "client_os": (_text, False)},
    CHECK_STATUS: {"client_idx": (_digits, True)},
    FINISH: {"client_idx": (_digits, True)},
    UPLOAD: {"num_samples": (_count, True), SILO_METRICS: (_metrics, False)},
    CLIENT_STATUS: {"client_status": (_status, True), "client_os": (_text, False), SILO_METRICS: (_metrics, False)},
}
CARRIES_MODEL = frozenset({INIT_CONFIG, SYNC_MODEL, UPLOAD})
_HEADER_KEYS = {"type", "sender", "receiver", "run_id", "round", "seq", "reply_to", "params", "tensors"}
_ALLOWED_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                   torch.int16, torch.int32, torch.int64, torch.bool}


@dataclass
class Envelope:
    """One message of the protocol, decoded: who sent it to whom, for which run and round, and
    its content. ``seq`` numbers the sender's messages to this receiver (strictly increasing);
    ``reply_to`` is the ``seq`` of the model an upload answers (-1: none)."""

    type: int
    sender: int
    receiver: int
    run_id: str
    round: int
    seq: int
    params: Dict[str, Any] = field(default_factory=dict)
    model: Optional["OrderedDict[str, torch.Tensor]"] = None
    reply_to: int = -1


def _as_state_dict(model: Any, msg_type: int) -> "OrderedDict[str, torch.Tensor]":
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in model.items()):
        raise TypeError(f"message type {msg_type}: the cross-silo transport carries model parameters as a dict of "
                        f"named tensors (a state_dict); got {type(model).__name__}")
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
            raise ValueError(f"message type {envelope.type}: parameter {key}={value!r} is not allowed")
    tensors = b""
    order = None
    if envelope.type in CARRIES_MODEL:
        if envelope.model is None:
            raise ValueError(f"message type {envelope.type}: a model is required")
        state = _as_state_dict(envelope.model, envelope.type)
        order = list(state)
        tensors = save_tensors(dict(state)) if state else b""
    header = json.dumps({"type": envelope.type, "sender": envelope.sender, "receiver": envelope.receiver,
                         "run_id": envelope.run_id, "round": envelope.round, "seq": envelope.seq,
                         "reply_to": envelope.reply_to, "params": envelope.params, "tensors": order},
                        separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + tensors


def _int(header: Dict[str, Any], key: str, low: int = 0) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2 ** 62:
        raise Rejected(f"header field {key!r}={value!r} is not an integer >= {low}")
    return value


def decode(data: bytes, max_bytes: int) -> Envelope:
    """The message in ``data``, or :class:`Rejected` naming what is wrong. Nothing is read from a
    message over ``max_bytes``; nothing in it can run code."""
    if len(data) > max_bytes:
        raise Rejected(f"{len(data)} bytes, over the size cap of {max_bytes} (comm_args.max_message_bytes)")
    if not data.startswith(MAGIC):
        hint = " (a pickle: FedML's own gRPC transport, or an attack)" if data[:1] == b"\x80" else ""
        raise Rejected(f"not a message of this protocol{hint}")
    if len(data) < len(MAGIC) + _LENGTH.size:
        raise Rejected("truncated before the header")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise Rejected(f"header length {length} is over {MAX_HEADER_BYTES} bytes or past the message's end")
    try:
        header = json.loads(data[start:start + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise Rejected(f"header is not UTF-8 JSON ({err})") from None
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise Rejected(f"header fields must be {sorted(_HEADER_KEYS)}")
    msg_type = header["type"]
    schema = SCHEMA.get(msg_type) if isinstance(msg_type, int) and not isinstance(msg_type, bool) else None
    if schema is None:
        raise Rejected(f"message type {msg_type!r} is not part of the cross-silo protocol")
    run_id = header["run_id"]
    if not isinstance(run_id, str) or len(run_id) > 128:
        raise Rejected(f"run_id={run_id!r} is not a string of at most 128 characters")
    params = header["params"]
    if not isinstance(params, dict):
        raise Rejected("params must be a mapping")
    for key, value in params.items():
        check = schema.get(key)
        if check is None:
            raise Rejected(f"message type {msg_type}: unexpected parameter {key!r}")
        if not check[0](value):
            raise Rejected(f"message type {msg_type}: parameter {key}={value!r} has the wrong type or range")
    missing = [k for k, (_, required) in schema.items() if required and k not in params]
    if missing:
        raise Rejected(f"message type {msg_type}: missing parameter(s) {missing}")
    envelope = Envelope(type=msg_type, sender=_int(header, "sender"), receiver=_int(header, "receiver"),
                        run_id=run_id, round=_int(header, "round"), seq=_int(header, "seq"), params=params,
                        reply_to=_int(header, "reply_to", low=-1))
    envelope.model = _decode_model(msg_type, header["tensors"], data[start + length:])
    return envelope


def _decode_model(msg_type: int, order: Any, blob: bytes) -> Optional["OrderedDict[str, torch.Tensor]"]:
    if msg_type not in CARRIES_MODEL:
        if order is not None or blob:
            raise Rejected(f"message type {msg_type} carries no model")
        return None
    if not isinstance(order, list) or not all(isinstance(k, str) for k in order) or len(set(order)) != len(order):
        raise Rejected("the model's tensor names must be a list of distinct strings")
    if not order:
        if blob:
            raise Rejected("tensor bytes without tensor names")
        return OrderedDict()
    try:
        tensors = load_tensors(blob)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
        raise Rejected(f"the tensors are not a valid safetensors blob ({type(err).__name__}: {err})") from None
    if set(tensors) != set(order):
        raise Rejected("the tensor names in the header and in the tensors differ")
    bad = [k for k, v in tensors.items() if v.dtype not in _ALLOWED_DTYPES]
    if bad:
        raise Rejected(f"tensor(s) {bad[:3]} have a dtype the protocol does not carry")
    return OrderedDict((k, tensors[k]) for k in order)


def model_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors (what a model message carries, less the headers)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def default_size_cap(state: Mapping[str, torch.Tensor]) -> int:
    """The default per-message cap: twice the model's bytes plus 1 MiB for the headers."""
    return 2 * model_bytes(state) + (1 << 20)
