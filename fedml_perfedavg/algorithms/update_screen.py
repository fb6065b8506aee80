"""Which client updates a round may average, for every algorithm alike: each update is checked
against the global model before any defense or average sees it, and the record of what was
rejected (by round and by client) and which rounds had nothing left is kept for the summary and
checkpoints.

Two bounds fit what honest clients send rather than the model's size: an update's distance is
held to ``update_norm_factor`` times the median of the last accepted ones (a client that shrinks
the model to nothing, or steps against its data at the fixed bound's limit, moves it by many
honest updates' worth), and a declared sample count to ``max_weight_ratio`` times the median of
the last accepted counts (one client claiming 2^31 samples would otherwise be the average)."""

from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

from ..core.errors import RunStopped
from ..core.guards import UpdateCheck, update_bound
from ..core.types import StateDict

logger = logging.getLogger(__name__)

HISTORY = 20  # accepted update norms and sample counts the relative bounds look back on
NAMED_AFTER = 3  # a client with this many rejected updates is named in the log (once)


class UpdateScreen:
    """Updates that do not fit the global model (keys, shapes, dtypes, finiteness,
    ``max_update_ratio``, ``max_update_norm``, ``update_norm_factor``) are rejected, logged and
    counted by round and client; declared sample counts over ``max_weight_ratio`` x their median
    are lowered to it; a round with none left is skipped, and ``max_skipped_rounds`` such rounds
    stop the run."""

    def __init__(
        self,
        parameter_names: List[str],
        max_update_norm: Optional[float],
        max_update_ratio: Optional[float],
        max_skipped_rounds: int,
        update_norm_factor: Optional[float] = None,
        max_weight_ratio: Optional[float] = None,
        weigh_by_samples: bool = False,
    ) -> None:
        self.parameter_names = parameter_names
        self.max_update_norm, self.max_update_ratio = max_update_norm, max_update_ratio
        self.max_skipped_rounds = max_skipped_rounds
        self.update_norm_factor = update_norm_factor
        self.max_weight_ratio = max_weight_ratio if weigh_by_samples else None  # counts weigh nothing otherwise
        self.rejected: Dict[int, int] = {}  # round -> client updates rejected
        self.rejected_clients: Dict[str, int] = {}  # client ("user 3", "silo rank 2") -> its updates rejected
        self.lowered_counts: Dict[str, int] = {}  # client -> its sample counts lowered
        self.skipped_rounds = 0
        self.norms: Deque[float] = deque(maxlen=HISTORY)
        self.counts: Deque[float] = deque(maxlen=HISTORY)
        self._named: Set[str] = set()
        self.last_problem: Optional[str] = None  # why the last rejected update was (for a stopped run's error)
        self._bound_logged = False

    def relative_bound(self, candidates: Sequence[float] = ()) -> Optional[float]:
        """``update_norm_factor`` x the lower median of the last accepted update norms and this
        round's ``candidates`` (those that passed the fixed checks): from the first round on, one
        liar among honest clients is never its own reference. None: off."""
        norms = [n for n in (*self.norms, *candidates) if n > 0]  # a client that did not move says nothing of scale
        if self.update_norm_factor is None or not norms:
            return None
        return self.update_norm_factor * statistics.median_low(norms)

    def accept(
        self,
        round_idx: int,
        updates: Sequence[Tuple[float, StateDict]],
        global_state: StateDict,
        clients: Optional[Sequence[str]] = None,
    ) -> List[Tuple[float, StateDict]]:
        """The updates of ``round_idx`` that fit ``global_state``, in their order (``clients``: who
        sent each, for the record; positions otherwise), their counts held to the weight cap."""
        if self.max_update_ratio is not None and not self._bound_logged:
            self._bound_logged = True
            logger.info(
                "client updates are bounded: ||w_i - w|| <= train_args.max_update_ratio=%g x max(||w||, 1) "
                "(%.4g in round %d)%s; larger ones are rejected",
                self.max_update_ratio,
                update_bound(global_state, self.max_update_ratio, self.parameter_names),
                round_idx,
                ""
                if self.update_norm_factor is None
                else f", and <= train_args.update_norm_factor={self.update_norm_factor:g} x the median of the "
                f"last {HISTORY} accepted and the round's",
            )
        if clients is not None and len(clients) != len(updates):  # a hook before the screen dropped some
            clients = None
        labels = list(clients) if clients is not None else [f"client update {p}" for p in range(len(updates))]
        check = UpdateCheck(global_state, self.max_update_norm, self.parameter_names, self.max_update_ratio)
        examined = [check.examine(update) for _, update in updates]
        problems = [problem for problem, _ in examined]
        norms = [norm if problem is None else None for problem, norm in examined]
        candidates = [n for n in norms if n is not None]
        relative = self.relative_bound(candidates)
        if relative is not None and len(candidates) >= 2 and all(n > relative for n in candidates):
            # Not all of a round's clients lie: the reference is not the honest clients' (too few
            # accepted so far, or small updates in it), and a round that kept nothing would count
            # towards stopping the run. Only the fixed bounds hold this round.
            logger.warning(
                "round %d: train_args.update_norm_factor's bound (%.4g) would reject all %d updates: its "
                "reference is not the honest clients'; only the fixed bounds apply this round",
                round_idx,
                relative,
                len(candidates),
            )
            relative = None
        accepted: List[Tuple[str, float, StateDict]] = []
        kept_norms = []
        for client, (samples, update), problem, norm in zip(labels, updates, problems, norms):
            if problem is None and norm is not None and relative is not None and norm > relative:
                problem = (
                    f"update norm {norm:.4g} exceeds train_args.update_norm_factor={self.update_norm_factor:g} x "
                    f"the median of the last {len(self.norms)} accepted update norms and this round's "
                    f"({relative / (self.update_norm_factor or 1):.4g}) = {relative:.4g}"
                )
            if problem is None and norm is not None:
                accepted.append((client, samples, update))
                kept_norms.append(norm)
            else:
                self._reject(round_idx, client, clients is not None, problem)
        if len(accepted) < len(updates):
            self.rejected[round_idx] = len(updates) - len(accepted)
        self.norms.extend(kept_norms)
        return self._cap_weights(round_idx, accepted, clients is not None)

    def _reject(self, round_idx: int, client: str, known: bool, problem: Optional[str]) -> None:
        logger.warning("round %d: rejected %s: %s", round_idx, client, problem)
        self.last_problem = problem
        if not known:
            return
        self.rejected_clients[client] = self.rejected_clients.get(client, 0) + 1
        if self.rejected_clients[client] >= NAMED_AFTER and client not in self._named:
            self._named.add(client)
            logger.error(
                "%s: %d of its updates rejected so far (round %d); it keeps sending updates that do "
                "not fit the others' (summary.json: rejected_clients)",
                client,
                self.rejected_clients[client],
                round_idx,
            )

    def _cap_weights(
        self, round_idx: int, accepted: List[Tuple[str, float, StateDict]], known: bool
    ) -> List[Tuple[float, StateDict]]:
        """Counts over ``max_weight_ratio`` x the median of the last accepted counts and this
        round's (the lower median: a liar in a round of two is not half the reference) lowered to
        that; the history takes the counts as kept."""
        counts = [float(n) for _, n, _ in accepted]
        if self.max_weight_ratio is None or not counts:
            self.counts.extend(counts)
            return [(n, u) for _, n, u in accepted]
        cap = self.max_weight_ratio * statistics.median_low([*self.counts, *counts])
        capped = []
        for client, samples, update in accepted:
            if samples > cap:
                logger.warning(
                    "round %d: %s declared %s samples, over train_args.max_weight_ratio=%g x the median of "
                    "recent counts; it weighs as %g",
                    round_idx,
                    client,
                    samples,
                    self.max_weight_ratio,
                    cap,
                )
                if known:
                    self.lowered_counts[client] = self.lowered_counts.get(client, 0) + 1
                samples = cap
            capped.append((samples, update))
        self.counts.extend(min(n, cap) for n in counts)
        return capped

    def record(self) -> Dict[str, Dict[str, int]]:
        """summary.json's record: updates rejected by round, and by client where known
        (``rejected_clients``), and declared counts lowered (``lowered_counts``)."""
        by_client = {"rejected_clients": self.rejected_clients, "lowered_counts": self.lowered_counts}
        rejected = {str(k): v for k, v in self.rejected.items()}
        return {"rejected_updates": rejected, **{k: dict(sorted(v.items())) for k, v in by_client.items() if v}}

    def skip(self, round_idx: int) -> None:
        """``round_idx`` had no acceptable update (the global model is kept); :class:`RunStopped`
        at the ``max_skipped_rounds``-th such round."""
        self.skipped_rounds += 1
        logger.error(
            "round %d: no acceptable client update; the global model is kept (%d such rounds, "
            "train_args.max_skipped_rounds=%d)",
            round_idx,
            self.skipped_rounds,
            self.max_skipped_rounds,
        )
        if self.skipped_rounds >= self.max_skipped_rounds:
            last = f"; the last update rejected: {self.last_problem}" if self.last_problem else ""
            raise RunStopped(
                f"{self.skipped_rounds} rounds had no acceptable client update (train_args."
                f"max_skipped_rounds={self.max_skipped_rounds}); last at round {round_idx}{last}"
            )

    def state_dict(self) -> Dict[str, Any]:
        return {
            "skipped_rounds": self.skipped_rounds,
            "rejected": dict(self.rejected),
            "rejected_clients": dict(self.rejected_clients),
            "lowered_counts": dict(self.lowered_counts),
            "norms": list(self.norms),
            "counts": list(self.counts),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.skipped_rounds = int(state["skipped_rounds"])
        self.rejected = {int(k): int(v) for k, v in state["rejected"].items()}
        self.rejected_clients = {str(k): int(v) for k, v in state.get("rejected_clients", {}).items()}
        self.lowered_counts = {str(k): int(v) for k, v in state.get("lowered_counts", {}).items()}
        self.norms = deque((float(v) for v in state.get("norms", [])), maxlen=HISTORY)
        self.counts = deque((float(v) for v in state.get("counts", [])), maxlen=HISTORY)
        self._named = {c for c, n in self.rejected_clients.items() if n >= NAMED_AFTER}


def screen_for(parameter_names: List[str], settings: Any) -> "UpdateScreen":
    """The screen an algorithm's :class:`~.base.AlgorithmSettings` ask for."""
    return UpdateScreen(
        parameter_names,
        settings.max_update_norm,
        settings.max_update_ratio,
        settings.max_skipped_rounds,
        settings.update_norm_factor,
        settings.max_weight_ratio,
        settings.aggregation == "sample_weighted",
    )
