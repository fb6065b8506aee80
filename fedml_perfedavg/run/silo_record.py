"""A data owner's own record of a cross-silo run, kept by its organization (the server keeps the
run's): ``silo-rank-R/`` in the silo's run directory, holding

- ``summary.json``: its user's personalized accuracy (and before adaptation, and the algorithm's
  own figures) at the last round it evaluated, every evaluation it sent, how the run ended for it and why;
- ``model.pt``: the last global model it evaluated;
- ``personalized.pt``: that model after its personalization step on its own training data (the
  model whose accuracy it reported);
- ``client_state.pt``: its user's own state, where the algorithm keeps one for each client
  (``keeps_client_state``): it never left the silo."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional

from ..core.evaluation import accuracy_of
from ..core.types import StateDict
from ..fedml_bridge.cross_silo.outcome import SiloOutcome
from .files import make_dir, write_json, write_torch

logger = logging.getLogger(__name__)

Personalize = Callable[[int, StateDict], StateDict]


def _figures(counts: Dict[str, Any]) -> Dict[str, Any]:
    total = int(counts["total"])
    return {
        "round": int(counts["round"]),
        "personalized_accuracy": accuracy_of(int(counts["correct"]), total) if total else None,
        "accuracy_before_adaptation": accuracy_of(int(counts["correct_before"]), total) if total else None,
        "loss": float(counts["loss"]),
        "test_samples": total,
        **({"own": dict(counts["own"])} if counts.get("own") else {}),
    }


def write_silo_record(
    run_dir: str,
    rank: int,
    outcome: SiloOutcome,
    personalize: Personalize,
    status: str,
    error: Optional[str],
    client_state: Optional[StateDict] = None,
) -> Dict[str, Any]:
    """Write silo ``rank``'s record (see the module doc) and return its summary. A run the
    server ended early is ``stopped`` here, with the server's reason."""
    if status == "finished" and outcome.ended_early:
        status, error = "stopped", outcome.ended_early
    folder = os.path.join(run_dir, f"silo-rank-{rank}")
    make_dir(folder)
    history = [_figures(counts) for counts in outcome.evaluations]
    last = history[-1] if history else {}
    summary: Dict[str, Any] = {
        "role": "silo",
        "rank": rank,
        "user": outcome.user,
        "status": status,
        "error": error,
        "personalized_accuracy": last.get("personalized_accuracy"),
        "accuracy_before_adaptation": last.get("accuracy_before_adaptation"),
        "evaluated_round": last.get("round"),
        "own_metrics": last.get("own", {}),  # the algorithm's own figures of its user (its metric_names)
        "test_samples": last.get("test_samples"),
        "privacy": outcome.evaluations[-1].get("privacy") if outcome.evaluations else None,
        "history": history,
        "model": None,
        "personalized_model": None,
        "client_state": None,
    }
    if outcome.model is not None and outcome.model_round is not None:
        write_torch(os.path.join(folder, "model.pt"), {k: v.detach().cpu() for k, v in outcome.model.items()})
        personalized = personalize(outcome.model_round, outcome.model)
        write_torch(os.path.join(folder, "personalized.pt"), {k: v.detach().cpu() for k, v in personalized.items()})
        summary["model"], summary["personalized_model"] = "model.pt", "personalized.pt"
    if client_state:
        write_torch(os.path.join(folder, "client_state.pt"), {k: v.detach().cpu() for k, v in client_state.items()})
        summary["client_state"] = "client_state.pt"
    write_json(os.path.join(folder, "summary.json"), summary)
    if last:
        logger.info(
            "silo rank %d: user %s's personalized accuracy %.4f (before adaptation %.4f) at round %d; its record "
            "and models in %s",
            rank,
            outcome.user,
            last["personalized_accuracy"],
            last["accuracy_before_adaptation"],
            last["round"],
            folder,
        )
    else:
        logger.info("silo rank %d evaluated no model (run %s); its record is in %s", rank, status, folder)
    return summary
