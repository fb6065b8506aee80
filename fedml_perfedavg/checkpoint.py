"""Checkpoints of a run: written atomically, enough to continue it exactly.

All the run's randomness is drawn from generators keyed by (seed, round, client, purpose)
(:mod:`fedml_perfedavg.sampling`), so the global model, the next round index and the record
of metrics are the whole state; torch's global RNG is saved as well for code that uses it.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
import yaml

CHECKPOINT = "checkpoint.pt"
CONFIG = "config.yaml"


def save(run_dir: str, next_round: int, model_state: Dict[str, torch.Tensor], recorder_state: Dict[str, Any],
         aggregator_state: Dict[str, Any]) -> str:
    """Write ``run_dir/checkpoint.pt`` through a temporary file and a rename."""
    path = os.path.join(run_dir, CHECKPOINT)
    tmp = path + ".tmp"
    torch.save({"next_round": next_round, "model": model_state, "recorder": recorder_state,
                "aggregator": aggregator_state, "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)
    return path


def load(run_dir: str) -> Optional[Dict[str, Any]]:
    """The run's checkpoint, or None when it has none."""
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch_rng"])
    return state


def save_config(run_dir: str, sections: Dict[str, Dict[str, Any]]) -> None:
    """The resolved config, so ``--resume RUN_DIR`` needs nothing else."""
    tmp = os.path.join(run_dir, CONFIG + ".tmp")
    with open(tmp, "w") as stream:
        yaml.safe_dump(sections, stream, sort_keys=False)
    os.replace(tmp, os.path.join(run_dir, CONFIG))
