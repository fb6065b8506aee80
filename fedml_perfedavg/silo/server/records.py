"""What the cross-silo server records beside every backend's round: the protocol the run's driver
gives the server (:class:`SiloServerDriver`), which asks for each record by name
(``fedml_bridge/cross_silo/server.py``: ``RECORDS``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

from ...core.types import RoundDriver


class SiloRecords(Protocol):
    """What the cross-silo server records beside every backend's round
    (:class:`~fedml_perfedavg.core.types.RoundDriver`): the silos it lost and took back, their own
    evaluations, the updates and messages it refused, each secure round. The protocol asks for these
    by name (``server.RECORDS``)."""

    def record_lost_silos(self, round_idx: int, ranks: List[int], why: str) -> None:
        """Cross-silo: the server went on without these silos from this round."""

    def record_silo_evaluation(self, label: str, mean: float, silos: Dict[int, Dict[str, Any]]) -> None:
        """Cross-silo: the silos' own personalized evaluations of the model they received."""

    def record_rejoined_silo(self, round_idx: int, rank: int, why: str) -> None:
        """Cross-silo: a silo the server had gone on without came back."""

    def record_federated_evaluation(
        self, round_idx: int, counts: Dict[int, Dict[str, Any]], missing: List[int], started: Optional[float] = None
    ) -> None:
        """Data-owner cross-silo: each user's counts from its own silo; the users that sent none."""

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
        """Data-owner cross-silo with secure aggregation: the evaluation's means over the ``summed``
        users (None: the sum failed, ``record`` says why), its stages' record, each user's account."""

    def record_rejected_update(self, round_idx: int) -> None:
        """Cross-silo: the server refused a silo's upload before aggregation (a false sample count)."""

    def record_refusals(self, totals: Dict[str, int]) -> None:
        """Cross-silo: what the server's transport refused so far, by reason."""

    def record_secure_round(self, round_idx: int, record: Dict[str, Any]) -> None:
        """Cross-silo with secure aggregation: who was summed, dropped and recovered, the bytes."""


class SiloServerDriver(RoundDriver, SiloRecords, Protocol):
    """The cross-silo server's driver: every backend's round and the silos' records."""
