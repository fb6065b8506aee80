"""The evaluation after a round, summed securely (data-owner mode with ``secagg_args.enable_secagg``;
issue 75, rule 2): every live silo evaluates the model on its own user and its figures
(:mod:`fedml_perfedavg.secagg.figures`) go into a secure sum over the evaluation's silos, through
the same stages as a round's updates (:class:`~.secure_rounds.SecureRound`). The server learns the
means over the summed users (accuracy and its spread, accuracy before the step, loss), never one
user's counts; each silo keeps its own in its record. The sum's signatures are bound to the run,
the round and the evaluation, so no message of a round's sum passes for its evaluation's.

The threshold is each silo's rule for the evaluation's size: above half of its silos plus the
colluding ones allowed for (``secagg_args.max_colluding_silos``); at least ``min_summed_silos``
are summed, as in a round."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from ...secagg import figures
from ...secagg.primitives import SecAggError
from ...secagg.rounds import RoundFailed, default_threshold
from .events import Outbox
from .secure_rounds import REFUSED_SECAGG, SecureRound, advert_problem, terms_digest
from ...net import wire

logger = logging.getLogger(__name__)


class SecureEvaluation:
    """The secure sum of the evaluation after round ``round_idx`` over ``silos``; ``rounds`` is the
    protocol's :class:`~.rounds.SiloRounds` (its clock, outbox, roster and members)."""

    def __init__(self, rounds: Any, secure: SecureRound, started: float) -> None:
        self.rounds, self.secure, self.started, self.closed = rounds, secure, started, False
        self.privacy: Dict[int, Dict[str, Any]] = {}  # user -> its silo's DP-SGD account, sent beside its keys

    @classmethod
    def open(cls, rounds: Any, round_idx: int, silos: List[int], now: float) -> "SecureEvaluation":
        setup = rounds.roster.setup
        threshold = default_threshold(len(silos), setup.max_colluding)
        run_id = f"{setup.run_id}|{figures.PURPOSE}"
        secure = SecureRound(
            round_idx,
            sorted(silos),
            None,
            threshold,
            len(figures.FIGURES),
            figures.fraction_bits(),
            figures.BOUND,
            run_id,
            min_summed=setup.min_summed,
        )
        if setup.ca is not None and silos:  # each advertisement checked as its receivers will check it
            digest = terms_digest(secure.terms(sorted(silos)[0]), rounds.model.params())
            ca, roster = setup.ca, setup.roster
            secure.check_advert = lambda advert: advert_problem(advert, run_id, round_idx, ca, digest, roster)
        return cls(rounds, secure, now)

    def terms(self, silo: int) -> Dict[str, Any]:
        return {wire.SECAGG: self.secure.terms(silo)}

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        r, secure = self.rounds, self.secure
        if self.closed or stamped != secure.round_idx or silo not in secure.awaiting:
            return r.ignore(now, f"a secure-aggregation message (type {kind}) of an evaluation", silo, stamped)
        if kind == wire.SECAGG_ADVERT and isinstance(params, dict) and "privacy" in params:
            account = params["privacy"]
            if account.get("user") == silo - 1:
                self.privacy[silo - 1] = dict(account)
        for out, why in secure.take(silo, kind, params, model, size):
            r.outbox.refuse(out, REFUSED_SECAGG, f"the evaluation after {why}")
            self._leave([out], f"the evaluation after {why}")
        return r.close_if_complete(now)

    def _leave(self, silos: List[int], why: str) -> None:
        self.rounds.evaluation.awaiting.difference_update(silos)
        self.rounds.give_up_on(silos, why, True)  # an evaluation never stops the run

    def drop(self, silos: List[int], why: str) -> None:
        self.secure.drop(list(silos), why)

    def ready(self) -> bool:
        return not self.closed and not self.secure.awaiting

    def advance(self, now: float) -> bool:
        """Every silo of the stage answered (or the rest were given up on): the next stage, or the
        evaluation's end with the summed figures."""
        r = self.rounds
        try:
            total = self.secure.advance(r.outbox, now + r.clock.round_seconds())
        except RoundFailed as err:
            logger.error("the evaluation after round %d: %s; it has no figures", self.secure.round_idx, err)
            return self.close(now, None, str(err))
        if total is None:
            r.clock.deadline = now + r.clock.round_seconds()
            return r.close_if_complete(now)
        return self.close(now, total, None)

    def deadline(self, now: float, why: str) -> bool:
        """The stage's deadline passed: the silos it still awaits are given up on."""
        missing = sorted(self.secure.awaiting)
        if missing:
            self._leave(missing, f"{why} ({self.secure.stage.value} of the evaluation)")
            self.secure.drop(missing, why)
        return self.advance(now)

    def close(self, now: float, total: Any, failed: Optional[str]) -> bool:
        """The evaluation's end: its means recorded (or why there are none), then the next round."""
        r, secure = self.rounds, self.secure
        self.closed = True
        metrics = None
        if total is not None:
            try:
                metrics = figures.metrics_of(secure.average(total), len(secure.server.survivors))
            except (RoundFailed, SecAggError) as err:
                logger.error("the evaluation after round %d: %s", secure.round_idx, err)
                failed = str(err)
        summed = sorted(secure.server.survivors) if metrics is not None else []
        missing = [s - 1 for s in secure.server.sampled if s not in summed]
        record = {**secure.record(failed), "evaluation": True}
        privacy = {user: account for user, account in sorted(self.privacy.items()) if user + 1 in summed}
        outbox: Outbox = r.outbox
        outbox.record(
            "record_secure_evaluation",
            secure.round_idx,
            metrics,
            [s - 1 for s in summed],
            missing,
            self.started,
            record,
            privacy,
        )
        r.evaluation.awaiting.clear()
        return r.finish_evaluation(now)
