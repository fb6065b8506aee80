"""How a cross-silo server tells the process that launched it where it stands, without anyone
parsing its log: when the environment names a file (:data:`STATE_FILE_VARIABLE`, set by
``launch-silo``), each change of the server's phase is written there atomically as one small JSON
object (``{"state": ..., "pid": ...}``). ``listening`` first (its port is open), then the
protocol's phases in lower case (``online``, ``training``, ..., ``done``)."""

from __future__ import annotations

import json
import os
from typing import Optional

STATE_FILE_VARIABLE = "FEDML_PERFEDAVG_STATE_FILE"
LISTENING = "listening"
TRAINING_STATES = frozenset({"training", "evaluating", "finishing"})  # every silo came online


def signal(state: str) -> None:
    """Write ``state`` to the state file, if one is named (a reader never sees half a file)."""
    path = os.environ.get(STATE_FILE_VARIABLE)
    if not path:
        return
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as stream:
        json.dump({"state": state, "pid": os.getpid()}, stream)
    os.replace(partial, path)


def read(path: str) -> Optional[str]:
    """The state the file says, or None when there is none yet (or it is not such a file)."""
    try:
        with open(path) as stream:
            value = json.load(stream)
    except (OSError, ValueError):
        return None
    state = value.get("state") if isinstance(value, dict) else None
    return state if isinstance(state, str) else None
