"""Small JSON documents a process reads from a file someone else may have written (the run's key
roster, an organization's DP-SGD account): read within a size cap, strict JSON (no NaN or
Infinity), nesting that cannot drive the parser into recursion, one top-level object naming its
format. The caller checks the fields; this checks what every such file needs first."""

from __future__ import annotations

import json
from typing import Any, Dict


def read_document(path: str, limit: int, format_name: str) -> Dict[str, Any]:
    """The JSON object in ``path``: :class:`OSError` where it cannot be read (``FileNotFoundError``
    where there is none), :class:`ValueError` saying what is wrong where it is not a document of
    ``format_name`` within ``limit`` bytes."""
    with open(path, "rb") as stream:
        raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"larger than {limit} bytes")
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested deeper than the parser goes") from None
    if not isinstance(data, dict) or data.get("format") != format_name:
        raise ValueError(f"its format is not {format_name!r}")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")
