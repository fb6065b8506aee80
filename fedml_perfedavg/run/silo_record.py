"""A data owner's own record of a cross-silo run, kept by its organization (the server keeps the
run's): ``silo-rank-R/`` in the silo's run directory, holding

- ``summary.json``: its user's personalized accuracy (and before adaptation, and the algorithm's
  own figures) at the last round it evaluated, every evaluation it sent, how the run ended for it and why;
- ``model.pt``: the last global model it evaluated;
- ``personalized.pt``: that model after its personalization step on its own training data (the
  model whose accuracy it reported);
- ``client_state.pt``: its user's own state, where the algorithm keeps one for each client
  (``keeps_client_state``) or DP-SGD's clip bound adapts (``dp_args.clip: adaptive``): it never
  left the silo;
- ``progress.pt``: what the silo process has done so far (its evaluations, its user's own state,
  its DP-SGD account of its user in this run and the run's secret, the last round it trained and
  its answer to it, the survivor list it last unmasked for), kept after every round it trains and
  every evaluation
  (:class:`SiloProgress`). A silo process started again in the same run directory (a crash, a
  reboot, the server's stop and resume: the same ``run_name`` or ``--run-dir``, ``--run_id`` and
  config) carries on from it. The end of a run leaves it: it is the organization's account of
  what its data has been used for, which no later process of the same run starts again from zero.
  The account that spans runs is the organization's own, beside its data's other runs
  (:mod:`.silo_account`): written first, each time."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable, Dict, Optional

import torch

from ..core.errors import ConfigError
from ..core.evaluation import accuracy_of
from ..core.types import StateDict
from ..silo.outcome import SiloOutcome, StoredAnswer
from .files import make_dir, write_json, write_torch
from .silo_account import KEY_BYTES, RunAccount

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
        **({"privacy": dict(counts["privacy"])} if counts.get("privacy") else {}),  # its account then
    }


def write_silo_record(
    run_dir: str,
    rank: int,
    outcome: SiloOutcome,
    personalize: Personalize,
    status: str,
    error: Optional[str],
    client_state: Optional[StateDict] = None,
    privacy: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Write silo ``rank``'s record (see the module doc) and return its summary (``status``: a
    run the server ended early comes as ``stopped``, with the server's reason: the runner's).
    ``privacy`` is its user's DP-SGD account at the end (every training and evaluation it ran,
    none at all included), where the run has DP-SGD."""
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
        "privacy": privacy,  # its ledger's, not its last evaluation's: trainings after it count too
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
    spent = "" if not privacy else f"; epsilon {privacy['epsilon']:.4g} over {privacy['uses']} uses of its data"
    if last:
        logger.info(
            "silo rank %d: user %s's personalized accuracy %.4f (before adaptation %.4f) at round %d%s; its record "
            "and models in %s",
            rank,
            outcome.user,
            last["personalized_accuracy"],
            last["accuracy_before_adaptation"],
            last["round"],
            spent,
            folder,
        )
    else:
        logger.info("silo rank %d evaluated no model (run %s)%s; its record is in %s", rank, status, spent, folder)
    return summary


PROGRESS = "progress.pt"


def run_identity(run_id: Any, fingerprint: Dict[str, Any], user: int) -> Dict[str, Any]:
    """What makes a silo's progress its own: the run id, the run's agreed config (the cross-silo
    fingerprint, as a digest) and its user."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"run_id": str(run_id), "fingerprint": digest, "user": int(user)}


class SiloProgress:
    """A data owner's silo's ``progress.pt`` (see the module doc): kept as the silo goes, read
    back by a process of the same silo started again in the same run."""

    def __init__(
        self,
        run_dir: str,
        rank: int,
        identity: Dict[str, Any],
        algorithm: Any,
        ledger: Any,
        account: Optional[RunAccount] = None,
        run_secret: Optional[bytes] = None,
    ) -> None:
        self.folder = os.path.join(run_dir, f"silo-rank-{rank}")
        self.path = os.path.join(self.folder, PROGRESS)
        self.rank, self.identity, self.algorithm, self.ledger = rank, identity, algorithm, ledger
        self.account = account
        self.run_secret = run_secret if account is None else account.run_secret

    @staticmethod
    def run_secret_in(run_dir: str, rank: int, identity: Dict[str, Any]) -> Optional[bytes]:
        """The run secret an earlier process of this run (``identity``) kept, or None (a new run,
        or a file that cannot be read: :meth:`restore` names it)."""
        path = os.path.join(run_dir, f"silo-rank-{rank}", PROGRESS)
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            secret = saved.get("run_secret") if saved.get("identity") == identity else None
            return bytes.fromhex(secret) if isinstance(secret, str) and len(secret) == 2 * KEY_BYTES else None
        except Exception:  # noqa: BLE001  missing or damaged: a new secret, and restore says why
            return None

    def refuse_a_finished_record(self, overwrite: bool) -> None:
        """:class:`ConfigError` (refused at start) where this silo's folder holds the record of a
        finished run: a process started there again would write its record over it, beside the
        old models. ``common_args.overwrite`` (``--overwrite``) replaces it. A record of a run
        that did not finish (interrupted, stopped, failed) is carried on from, as before."""
        summary = os.path.join(self.folder, "summary.json")
        try:
            with open(summary) as stream:
                status = json.load(stream).get("status")
        except (OSError, ValueError, AttributeError):
            return
        if status == "finished" and not overwrite:
            raise ConfigError(
                f"{summary}: this organization's record of a run that finished; a process started here would write "
                f"over it. Start it with another --run-dir (a new run), or with --overwrite to replace the record"
            )

    def restore(self, outcome: SiloOutcome) -> bool:
        """Carry on from an earlier process's progress, if there is one of this run: True then."""
        if not os.path.exists(self.path):
            return False
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001  a damaged file is named, not a traceback
            raise ConfigError(f"{self.path}: not a readable silo progress file ({type(err).__name__}: {err})") from None
        if not isinstance(saved, dict) or saved.get("identity") != self.identity:
            theirs = saved.get("identity") if isinstance(saved, dict) else None
            logger.warning(
                "silo rank %d: %s is another run's (%s; this run is %s): its user starts afresh and the file is "
                "replaced",
                self.rank,
                self.path,
                theirs,
                self.identity,
            )
            return False
        try:
            self._load(saved, outcome)
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{self.path}: {err}; remove the file to start this silo's user afresh") from None
        logger.info(
            "silo rank %d: carries on from its earlier process (%s): trained up to round %s, %d evaluation(s)%s%s",
            self.rank,
            self.path,
            outcome.trained_round,
            len(outcome.evaluations),
            ", its user's own state" if saved.get("client_state") is not None else "",
            ", its DP-SGD account" if saved.get("privacy") is not None else "",
        )
        return True

    def _load(self, saved: Dict[str, Any], outcome: SiloOutcome) -> None:
        evaluations = saved["evaluations"]
        if not isinstance(evaluations, list) or not all(isinstance(e, dict) for e in evaluations):
            raise TypeError("its evaluations are not a list of records")
        trained = saved["trained_round"]
        if trained is not None and (not isinstance(trained, int) or isinstance(trained, bool)):
            raise TypeError(f"its trained_round is {trained!r}")
        state, privacy = saved.get("client_state"), saved.get("privacy")
        if state is not None:
            if not self.algorithm.holds_client_states:
                raise ValueError(f"it holds a client state; {self.algorithm.label} keeps none in this run")
            self.algorithm.client_states.update({self.identity["user"]: state})
        if privacy is not None:
            if self.ledger is None:
                raise ValueError("it holds a DP-SGD account; this run has no DP-SGD")
            self.ledger.load_state_dict(privacy)
        outcome.evaluations, outcome.trained_round = [dict(e) for e in evaluations], trained
        answer, unmasked = saved.get("answer"), saved.get("unmasked")
        if answer is not None:
            outcome.answer = StoredAnswer(
                int(answer["round"]), str(answer["model_digest"]), dict(answer["weights"]), int(answer["samples"])
            )
        if unmasked is not None:
            outcome.unmasked = (int(unmasked[0]), tuple(int(r) for r in unmasked[1]))
        evaluated = saved.get("unmasked_evaluation")
        if evaluated is not None:
            outcome.unmasked_evaluation = (int(evaluated[0]), tuple(int(r) for r in evaluated[1]))

    def save(self, outcome: SiloOutcome) -> None:
        """Keep what the silo has done so far (called as it trains and evaluates)."""
        state = self.algorithm.client_states.get(self.identity["user"]) if self.algorithm.holds_client_states else None
        answer = outcome.answer
        if self.account is not None and self.ledger is not None:
            self.account.record(self.ledger)  # the organization's account first: it is what spans runs
        make_dir(self.folder)
        write_torch(
            self.path,
            {
                "identity": self.identity,
                "trained_round": outcome.trained_round,
                "evaluations": [dict(e) for e in outcome.evaluations],
                "client_state": None if state is None else {k: v.detach().cpu() for k, v in state.items()},
                "privacy": None if self.ledger is None else self.ledger.state_dict(),
                "answer": None
                if answer is None
                else {
                    "round": answer.round_idx,
                    "model_digest": answer.model_digest,
                    "weights": {k: v.detach().cpu() for k, v in answer.weights.items()},
                    "samples": answer.samples,
                },
                "unmasked": None if outcome.unmasked is None else [outcome.unmasked[0], list(outcome.unmasked[1])],
                "unmasked_evaluation": None
                if outcome.unmasked_evaluation is None
                else [outcome.unmasked_evaluation[0], list(outcome.unmasked_evaluation[1])],
                "run_secret": None if self.run_secret is None else self.run_secret.hex(),
            },
        )
