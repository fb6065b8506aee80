"""Checkpoints of a run: written atomically, the previous one kept, enough to continue exactly.

All the run's randomness is drawn from generators keyed by (seed, round, client, purpose)
(:mod:`fedml_perfedavg.core.sampling`), so the global model, the next round index and the
state of the objects that own the rest (the algorithm's aggregation record, the recorder's
history) are the whole state; torch's global RNG is saved as well for code that uses it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

import torch

from ..core.errors import ConfigError, OutputError
from .files import write_atomic, write_yaml

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
CONFIG = "config.yaml"


def save(run_dir: str, next_round: int, model_state: Dict[str, torch.Tensor], states: Dict[str, Dict[str, Any]]) -> str:
    """Write ``run_dir/checkpoint.pt`` through a temporary file and a rename, keeping the one
    before as ``checkpoint.prev.pt`` (``states``: each owner's ``state_dict()`` by name)."""
    path = os.path.join(run_dir, CHECKPOINT)
    model_state = {k: v.detach().cpu() for k, v in model_state.items()}  # read back on any device (restore moves it)
    state = {"next_round": next_round, "model": model_state, "states": states, "torch_rng": torch.get_rng_state()}
    write_atomic(path, lambda stream: torch.save(state, stream), previous=os.path.join(run_dir, PREVIOUS))
    return path


def _read(path: str) -> Dict[str, Any]:
    # a checkpoint is data: never code from whoever wrote the file; a GPU run's is read on any machine
    state = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(state, dict) or not {"next_round", "model", "states", "torch_rng"} <= set(state):
        raise ValueError("not a checkpoint of this plugin")
    return state


def load(run_dir: str) -> Optional[Dict[str, Any]]:
    """The run's latest readable checkpoint, or None when it has none. A damaged latest one is
    reported and the previous one used; if both are damaged, the error names them."""
    damaged = []
    for name in (CHECKPOINT, PREVIOUS):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        try:
            state = _read(path)
        except Exception as err:  # noqa: BLE001 - a truncated zip, an empty file, a foreign pickle: all damaged
            damaged.append(f"{path} ({type(err).__name__}: {err})")
            continue
        if damaged:
            logger.warning(
                "checkpoint %s is damaged; resuming from the previous one, %s (round %d)",
                damaged[0],
                path,
                state["next_round"],
            )
        torch.set_rng_state(state["torch_rng"])
        return state
    if damaged:
        raise ConfigError(
            f"--resume {run_dir}: no readable checkpoint: {'; '.join(damaged)}. Start the run again "
            f"without --resume (or restore the file)"
        )
    return None


# What ``--resume RUN_DIR --set KEY=VALUE`` may change: how many rounds, how often a checkpoint is
# written, and the reporting (wandb, the progress bar). Anything else would make the resumed rounds
# another run's (a model whose tensors the checkpoint does not hold, another step size or privacy).
RESUME_MAY_CHANGE = (
    "comm_round",
    "checkpoint_every",
    "enable_wandb",
    "wandb_project",
    "wandb_group",
    "wandb_name",
    "show_progress",
)


def resume_changes_problem(saved: Dict[str, Dict[str, Any]], asked: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why ``--resume`` refuses the ``--set`` changes between the run's ``saved`` config.yaml
    sections and the ``asked`` ones (both as :meth:`Config.sections` gives them), or None."""
    changed = []
    for section in sorted(set(saved) | set(asked)):
        before, after = saved.get(section) or {}, asked.get(section) or {}
        for key in sorted(set(before) | set(after)):
            if key not in RESUME_MAY_CHANGE and before.get(key) != after.get(key):
                changed.append(f"{section}.{key}={after.get(key)!r} (the run's: {before.get(key)!r})")
    if not changed:
        return None
    return (
        f"--resume continues the run as it was configured; it cannot change {', '.join(changed)}. Allowed with "
        f"--resume: --set {', '.join(RESUME_MAY_CHANGE)}; for other settings start a new run"
    )


def save_config(run_dir: str, sections: Dict[str, Dict[str, Any]]) -> None:
    """The resolved config, so ``--resume RUN_DIR`` needs nothing else."""
    write_yaml(os.path.join(run_dir, CONFIG), sections)


class Checkpoints:
    """A run's checkpoints in ``run_dir``. A checkpoint is a convenience: one that cannot be
    written is a warning and the run goes on; if the next one fails too the disk is not
    recovering, and the run stops then (rather than lose everything at its end)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.last_failed = False

    def save(self, next_round: int, model_state: Dict[str, torch.Tensor], states: Dict[str, Dict[str, Any]]) -> None:
        try:
            save(self.run_dir, next_round, {k: v.detach().cpu() for k, v in model_state.items()}, states)
        except OutputError as err:
            if self.last_failed:
                raise OutputError(f"{err}; the checkpoint before failed too, so the run stops here") from None
            self.last_failed = True
            logger.warning("%s; the run goes on (a second failed checkpoint in a row stops it)", err)
        else:
            self.last_failed = False

    def load(self) -> Optional[Dict[str, Any]]:
        return load(self.run_dir)
