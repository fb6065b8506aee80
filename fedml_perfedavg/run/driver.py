"""What happens each round of a run: the :class:`~fedml_perfedavg.core.types.RoundDriver`
every backend adapter calls (the batched engine, FedML's sp loop, its MPI server, the cross-silo
server). It samples with the algorithm's keyed sampling and, once a round's global model
exists, evaluates it on the run's schedule, records it and checkpoints it; the figures silos
send, the updates refused and the silos lost go to the run's record too."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional

from ..algorithms.base import FederatedAlgorithm
from ..core.training_record import valid_figures
from ..core.ledger import PrivacyLedger, ReportedPrivacy
from ..core.types import StateDict
from ..stopping import RoundEndInterrupt
from . import checkpoint
from .measures import Measurements
from .reporting import RunRecorder, record_failure
from .schedule import RoundSchedule

logger = logging.getLogger(__name__)


class RunDriver:
    """One process's side of every round. ``recorder``, ``measurements`` and ``checkpoints`` are
    the server's (None elsewhere: a silo or an MPI worker records nothing); ``global_state`` is
    the newest global model."""

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        run_dir: str,
        schedule: RoundSchedule,
        global_state: StateDict,
        recorder: Optional[RunRecorder] = None,
        measurements: Optional[Measurements] = None,
        checkpoints: Optional[checkpoint.Checkpoints] = None,
    ) -> None:
        self.algorithm, self.run_dir, self.schedule = algorithm, run_dir, schedule
        self.global_state = global_state
        self.recorder, self.measurements, self.checkpoints = recorder, measurements, checkpoints
        # A backend's own state, kept in each checkpoint by name (the cross-silo server's session
        # and run id), and what the checkpoint a run resumed from held of it.
        self.backend_states: Dict[str, Callable[[], Dict[str, Any]]] = {}
        self.restored: Dict[str, Dict[str, Any]] = {}
        # Set while the batched engine runs: a stop signal ends the run at the end of its round.
        self.stop_at_round_end: Optional[RoundEndInterrupt] = None

    @property
    def privacy(self) -> Optional[PrivacyLedger]:
        """DP-SGD's accountant (the server's record holds it), or None (also where the silos
        account for their own users)."""
        privacy = None if self.recorder is None else self.recorder.privacy
        return privacy if isinstance(privacy, PrivacyLedger) else None

    def sample_clients(self, round_idx: int) -> List[int]:
        """The round's clients (the algorithm's keyed sampling); with DP-SGD their local updates
        are counted here, before any is computed, and a client whose epsilon would pass
        ``max_epsilon`` is left out (the run's start refuses a plan that would: this guards the
        rest, and the record says so)."""
        clients = self.algorithm.sample_clients(round_idx)
        ledger = self.privacy
        if ledger is None:
            return clients
        if round_idx >= self.schedule.comm_round:  # cross-silo shared mode: the final model, evaluated on silos
            return clients  # keyed as the server's last evaluation of it: the same release, counted there
        budget = ledger.dp.max_epsilon
        if budget is not None:
            over = [c for c in clients if ledger.would_pass(round_idx, c, budget)]
            if over:
                logger.warning(
                    "round %d: user(s) %s left out: one more local update would take their epsilon past "
                    "dp_args.max_epsilon=%g",
                    round_idx,
                    over,
                    budget,
                )
                ledger.left_out(round_idx, over)
                clients = [c for c in clients if c not in over]
        ledger.trained(round_idx, clients)
        return clients

    def evaluates(self, round_idx: int) -> bool:
        return self.schedule.evaluates(round_idx)

    def round_finished(self, round_idx: int, global_state: StateDict) -> None:
        previous, self.global_state = self.global_state, global_state
        schedule = self.schedule
        training = self.algorithm.training.take(round_idx)
        if self.recorder is not None:
            self.recorder.round_finished(round_idx, training)
            if self.measurements is not None and schedule.evaluates(round_idx):  # data-owner mode: the silos do
                started = time.perf_counter()  # evaluation time is not training time
                if self.privacy is not None:
                    self.privacy.evaluated(round_idx, range(len(self.measurements.users)))
                result, extra = self.measurements.evaluate(
                    round_idx, global_state, previous, schedule.measures_stationarity(round_idx)
                )
                self.recorder.record_evaluation(round_idx, result, extra, started)
        if self.checkpoints is not None and schedule.checkpoints(round_idx):
            self.save_checkpoint(round_idx + 1)
        stop = self.stop_at_round_end
        if stop is not None and stop.requested:
            if self.checkpoints is not None and schedule.checkpoint_every and not schedule.checkpoints(round_idx):
                self.save_checkpoint(round_idx + 1)  # the signal came in this round: keep it for --resume
            stop.stop()

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, next_round: int) -> None:
        """A checkpoint of the run as it stands, to continue from ``next_round``."""
        assert self.checkpoints is not None and self.recorder is not None  # the server of a resumable run
        self.checkpoints.save(
            next_round,
            self.global_state,
            {
                "algorithm": self.algorithm.state_dict(),
                "recorder": self.recorder.state_dict(),
                **{name: state() for name, state in self.backend_states.items()},
            },
        )

    def restore(self, device: Any) -> int:
        """The run as its last checkpoint left it (model, algorithm, record); the round to go on
        from (0 without a checkpoint)."""
        assert self.checkpoints is not None and self.recorder is not None  # the server of a resumable run
        state = self.checkpoints.load()
        if state is None:
            logger.warning("no checkpoint in %s: starting from round 0", self.run_dir)
            return 0
        self.global_state = {k: v.to(device) for k, v in state["model"].items()}
        self.algorithm.load_state_dict(state["states"]["algorithm"])
        self.recorder.load_state_dict(state["states"]["recorder"])
        self.restored = {k: v for k, v in state["states"].items() if k not in ("algorithm", "recorder")}
        logger.info("resumed %s at round %d", self.run_dir, state["next_round"])
        return int(state["next_round"])

    # -- what other processes report ------------------------------------------------------------
    def record_training(self, round_idx: int, client: int, figures: List[Any]) -> None:
        """A client's training figures of ``round_idx`` [loss, accuracy], from the process that
        trained it (an MPI worker, a silo): kept for the round's record, checked first."""
        if not valid_figures(figures):
            logger.warning(
                "round %d: user %s's training figures %r are not [loss, accuracy]: left out", round_idx, client, figures
            )
            return
        self.algorithm.training.note(round_idx, client, figures)

    def record_silo_evaluation(self, label: str, mean: float, silos: Dict[int, Dict[str, Any]]) -> None:
        if self.recorder is not None:
            self.recorder.record_silo_evaluation(label, mean, silos)

    def record_federated_evaluation(
        self, round_idx: int, counts: Dict[int, Dict[str, Any]], missing: List[int], started: Optional[float] = None
    ) -> None:
        if self.recorder is not None:
            privacy = self.recorder.privacy
            if isinstance(privacy, ReportedPrivacy):  # data-owner silos account for their own users
                for entry in counts.values():
                    if "privacy" in entry:
                        privacy.note(entry["privacy"])
            self.recorder.record_federated_evaluation(round_idx, counts, missing, started)

    def record_rejected_update(self, round_idx: int) -> None:
        self.algorithm.rejected[round_idx] = self.algorithm.rejected.get(round_idx, 0) + 1

    def record_refusals(self, totals: Dict[str, int]) -> None:
        if self.recorder is not None:
            self.recorder.silos.refusals = dict(totals)

    def record_secure_round(self, round_idx: int, record: Dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.silos.secure_round(record)

    def record_secure_evaluation(
        self,
        round_idx: int,
        metrics: Optional[Dict[str, Any]],
        summed: List[int],
        missing: List[int],
        started: Optional[float],
        record: Dict[str, Any],
        privacy: Dict[int, Dict[str, Any]],
    ) -> None:
        if self.recorder is not None:
            reported = self.recorder.privacy
            if isinstance(reported, ReportedPrivacy):  # data-owner silos account for their own users
                for account in privacy.values():
                    reported.note(account)
            self.recorder.silos.secure_round(record)
            self.recorder.record_summed_evaluation(round_idx, metrics, summed, missing, started)

    def record_failure(self, why: str) -> None:
        """Another rank ends the run (a failing MPI client): summary.json says so. Never raises:
        the caller is on its way to aborting the job (a rank on another machine may not see the
        run directory)."""
        try:
            record_failure(self.run_dir, why)
        except Exception as err:  # noqa: BLE001 - the abort must still happen
            logger.warning("could not mark %s/summary.json aborted: %s", self.run_dir, err)

    def record_lost_silos(self, round_idx: int, ranks: List[int], why: str) -> None:
        if self.recorder is not None:
            self.recorder.silos.lost(round_idx, ranks, why)

    def record_rejoined_silo(self, round_idx: int, rank: int, why: str) -> None:
        if self.recorder is not None:
            self.recorder.silos.rejoined(round_idx, rank, why)
