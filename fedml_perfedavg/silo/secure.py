"""A silo's side of one securely aggregated round (``secagg_args.enable_secagg``): its update
(the trained model minus the round's model, over the model's parameters) clipped to the bound the
server would enforce in the clear, encoded in the round's fixed point, and its answers to each of
the server's stages (:mod:`fedml_perfedavg.secagg.rounds`). The silo checks the server's terms
against what it computes itself (the bound, the weights the protocol fixes, the round's silos
against its own copy of the keyed schedule, its own config's threshold rules), signs a digest of
them with its keys so that every silo sees whether all were given the same round, and checks every
other silo's keys against the run's CA: a dishonest server can neither widen the bound or skew the
weights unseen, nor show silos different rounds, nor pass its own keys off as a silo's."""

from __future__ import annotations

import base64
import logging
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ..secagg import figures, fixed_point, vectors
from ..secagg.primitives import SecAggError, sign
from ..secagg.rounds import Advert, SiloRound, SiloRules
from ..net import wire
from ..core.sampling import reserve_problem
from ..net.credentials import Credentials, certificate_rank_problem
from .secure_messages import (
    to_base64,
    advert_from_wire,
    advert_to_wire,
    signed_shares_from_wire,
    signed_shares_to_wire,
    terms_digest,
)

logger = logging.getLogger(__name__)


def weight_problem(rank: int, terms: Dict[str, Any], setup: Any) -> Optional[str]:
    """Why the server's weight for this silo is not the protocol's (None: it is): equal over the
    round's silos, or, weighting by samples, this silo's own count (checked) over the counts all
    silos were given (every silo checks its own entry, and the digest that all got one table)."""
    silos = [int(s) for s in terms["silos"]]
    counts = terms.get("counts")
    if setup.sample_weighted != (counts is not None):
        return "the server's weights are not of this run's train_args.aggregation"
    if counts is None:
        expected = 1.0 / len(silos)
    else:
        table = {int(s): int(n) for s, n in counts}
        own = setup.user_counts.get(rank - 1, (None, None))[0]
        if sorted(table) != sorted(silos) or table.get(rank) != own or min(table.values()) < 1:
            return f"the server's sample counts {counts} do not give this silo's own ({own})"
        expected = own / sum(table.values())
    if abs(float(terms["weight"]) - expected) > 1e-12 * max(expected, 1e-300):
        return f"the server's weight {terms['weight']!r} for this silo is not the protocol's ({expected!r})"
    return None


class SecureSiloRound:
    """Silo ``party.rank``'s part of round ``round_idx``, its input ``encoded``; ``credentials``: its
    own, with the run's CA and the key roster it pins."""

    def __init__(
        self,
        round_idx: int,
        party: SiloRound,
        encoded: np.ndarray,
        credentials: Credentials,
        evaluation: bool = False,
        privacy: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.round_idx, self.party, self.encoded, self.credentials = round_idx, party, encoded, credentials
        self.evaluation = evaluation  # it sums the evaluation after the round, not the round's updates
        self.privacy = privacy  # its user's DP-SGD account, sent with its advertisement (no data figure)

    @classmethod
    def start_evaluation(
        cls,
        rank: int,
        round_idx: int,
        terms: Dict[str, Any],
        setup: Any,
        model: Dict[str, torch.Tensor],
        counts: Dict[str, Any],
        settings: Any,
    ) -> "SecureSiloRound":
        """The silo's part of the secure sum of the evaluation after ``round_idx`` (issue 75, rule 2):
        its user's figures (:mod:`fedml_perfedavg.secagg.figures`) of ``model``, from ``counts``, in a
        sum the server's ``terms`` describe, checked against this silo's own rules: every silo of the
        evaluation is one of the run's, at least ``min_summed_silos`` are summed, the threshold is
        above half of them plus the colluders allowed for, equal weights, the figures' bound."""
        rules, credentials = setup.secure_rules, getattr(settings, "credentials", None)
        if rules is None or credentials is None:
            raise SecAggError("a secure evaluation needs secagg_args.enable_secagg and comm_args.tls_dir on the silo")
        silos = [int(s) for s in terms["silos"]]
        everyone = setup.keyed_order(round_idx) if setup.keyed_order is not None else silos
        if rank not in silos or len(set(silos)) != len(silos) or not set(silos) <= set(everyone):
            raise SecAggError(
                f"the server's silos {silos} for the evaluation after round {round_idx} are not the run's"
            )
        threshold = int(terms["threshold"])
        own = SiloRules(threshold, rules.max_colluding, rules.min_summed)
        problem = own.problem_with(len(silos), len(silos))
        if problem is None and threshold > len(silos):
            problem = f"the threshold {threshold} is more than the evaluation's {len(silos)} silos"
        if problem is None and terms["counts"] is not None:
            problem = "an evaluation's figures are summed with equal weights; the server sent sample counts"
        if problem is None and abs(float(terms["weight"]) - 1.0 / len(silos)) > 1e-12:
            problem = f"the server's weight {terms['weight']!r} is not 1/{len(silos)}"
        if problem is None and (float(terms["bound"]) != figures.BOUND or int(terms["length"]) != len(figures.FIGURES)):
            problem = "the server's bound or length is not the evaluation figures'"
        if problem is None and not fixed_point.MIN_FRACTION_BITS <= int(terms["bits"]) <= figures.fraction_bits():
            problem = f"{terms['bits']} fraction bits: the sum could wrap, or lose more than the stated error"
        if problem is not None:
            raise SecAggError(f"the evaluation after round {round_idx}: {problem}")
        vector = fixed_point.clip(figures.figures_vector(counts), figures.BOUND)
        encoded = fixed_point.encode(vector, float(terms["weight"]), int(terms["bits"]))
        party = SiloRound(
            f"{settings.run_id}|{figures.PURPOSE}",
            round_idx,
            rank,
            threshold,
            lambda data: sign(credentials.key, data),
            credentials.cert,
            terms_digest(terms, model),
            rules.min_summed,
            peers=tuple(silos),
        )
        return cls(round_idx, party, encoded, credentials, evaluation=True, privacy=counts.get("privacy"))

    @classmethod
    def start(
        cls,
        rank: int,
        round_idx: int,
        terms: Optional[Dict[str, Any]],
        setup: Any,
        received: Dict[str, torch.Tensor],
        trained: Dict[str, torch.Tensor],
        client_trainer: Any,
        settings: Any,
    ) -> "SecureSiloRound":
        """The silo's round from the server's ``terms`` (:data:`wire.SECAGG`), the run's
        ``setup`` (:class:`SiloSetup`: its rules and schedule), the model it ``received`` and the
        one it ``trained``; :class:`SecAggError` naming what does not fit."""
        rules = setup.secure_rules
        if terms is None or rules is None:
            raise SecAggError(
                "the server's model came without secure-aggregation terms, or with them while this silo's "
                "secagg_args.enable_secagg is false: the two disagree"
            )
        threshold = rules.threshold
        if terms["threshold"] != threshold:
            raise SecAggError(f"the server's threshold {terms['threshold']} is not this run's ({threshold})")
        silos = [int(s) for s in terms["silos"]]
        scheduled = setup.scheduled(round_idx) if setup.scheduled is not None else silos
        reserves, order = getattr(setup, "reserve_silos", 0), getattr(setup, "keyed_order", None)
        allowed = order(round_idx)[: len(scheduled) + reserves] if reserves and order is not None else None
        # lost silos' places taken by the next of the round's keyed order (secagg_args.reserve_silos)
        replaced = allowed is not None and reserve_problem(allowed, len(scheduled), reserves, silos) is None
        if rank not in silos or not (set(silos) <= set(scheduled) or replaced) or len(set(silos)) != len(silos):
            within = f" (or, in lost ones' places, up to secagg_args.reserve_silos={reserves} of {allowed})"
            raise SecAggError(
                f"the server's silos {silos} for round {round_idx} are not of the keyed schedule, which samples "
                f"{scheduled}" + (within if allowed else "")
            )
        problem = rules.problem_with(len(scheduled), len(silos)) or weight_problem(rank, terms, setup)
        missing = sorted(set(scheduled) - set(silos))
        if problem is not None and missing:  # name the organizations the round is without, as this silo sees it
            problem += (
                f"; the keyed schedule samples silo rank(s) {sorted(scheduled)}, and rank(s) {missing} are not in it"
            )
        if problem is not None:
            raise SecAggError(problem)
        algorithm = getattr(client_trainer, "algorithm", None)
        credentials = getattr(settings, "credentials", None)
        if algorithm is None or credentials is None:
            raise SecAggError("secure aggregation needs the plugin's ClientTrainer and comm_args.tls_dir on the silo")
        names = algorithm.parameter_names
        local = algorithm.settings
        bound = vectors.bound(received, names, local.max_update_ratio, local.max_update_norm)
        if abs(bound - terms["bound"]) > 1e-6 * max(bound, 1.0):
            raise SecAggError(
                f"the server's update bound {terms['bound']:.6g} is not the one this silo computes ({bound:.6g})"
            )
        bits = int(terms["bits"])
        if bits < fixed_point.MIN_FRACTION_BITS or bits > fixed_point.fraction_bits(bound):
            raise SecAggError(f"{bits} fraction bits: the round's sum could wrap, or lose more than the stated error")
        if terms["length"] != vectors.length(received, names):
            raise SecAggError(f"the server's input length {terms['length']} is not this model's")
        delta = fixed_point.clip(vectors.delta(received, trained, names), bound)
        encoded = fixed_point.encode(delta, float(terms["weight"]), bits)
        party = SiloRound(
            settings.run_id,
            round_idx,
            rank,
            threshold,
            lambda data: sign(credentials.key, data),
            credentials.cert,
            terms_digest(terms, received),
            rules.min_summed,
            peers=tuple(silos),
        )
        return cls(round_idx, party, encoded, credentials)

    def advertise(self) -> Advert:
        return self.party.advertise()

    def opening(self) -> Tuple[int, Dict[str, Any]]:
        """The round's first message from this silo: its signed advertisement (and, summing an
        evaluation under DP-SGD, its user's account, which no data figure is part of)."""
        params: Dict[str, Any] = {"advert": advert_to_wire(self.advertise())}
        if self.privacy is not None:
            params["privacy"] = dict(self.privacy)
        return wire.SECAGG_ADVERT, params

    def check_peer(self, advert: Advert) -> Optional[str]:
        """Why another silo's advertisement is not that rank's (whatever the server relays), or None:
        its certificate must be the run CA's for the rank and, whoever holds the CA's key, carry the
        key the run's roster pins for it."""
        pem, rank = advert.certificate, advert.rank
        return certificate_rank_problem(pem, self.credentials.ca, rank) or self.credentials.peer_problem(rank, pem)

    def answer(self, kind: int, params: Dict[str, Any]) -> Tuple[int, Dict[str, Any], Any]:
        """This silo's answer (type, parameters, tensors) to the server's stage message ``kind``."""
        party = self.party
        if kind == wire.SECAGG_KEYS:
            adverts = {int(r): advert_from_wire(int(r), v) for r, v in params["adverts"]}
            out = party.share(adverts, self.check_peer)
            return wire.SECAGG_SHARES_OUT, {"shares": signed_shares_to_wire(out)}, None
        if kind == wire.SECAGG_SHARES:
            masked = party.masked_input(self.encoded, signed_shares_from_wire(params["shares"]))
            answer: Dict[str, Any] = {}
            if party.accused:
                logger.warning(
                    "silo rank %d: round %d: the shares rank(s) %s signed for this silo do not decrypt; it discloses "
                    "its key for each such pair (what that silo could read already) to prove it",
                    party.rank,
                    self.round_idx,
                    sorted(party.accused),
                )
                answer["accusations"] = [[r, to_base64(k)] for r, k in sorted(party.accused.items())]
            return wire.SECAGG_MASKED, answer, {wire.MASKED_KEY: torch.from_numpy(masked.view(np.int32).copy())}
        if kind == wire.SECAGG_SURVIVORS:
            signature = party.sign_survivors([int(r) for r in params["survivors"]])
            return wire.SECAGG_SIGNED, {"signature": to_base64(signature)}, None
        if kind == wire.SECAGG_UNMASK:
            signatures = {int(r): base64.b64decode(s, validate=True) for r, s in params["signatures"]}
            liars = [int(r) for r in params.get("liars", [])]
            shares = party.unmask([int(r) for r in params["survivors"]], signatures, liars)
            rows = [
                [owner, which, index, to_base64(share)] for owner, (which, (index, share)) in sorted(shares.items())
            ]
            return wire.SECAGG_UNMASKING, {"shares": rows}, None
        raise SecAggError(f"message type {kind} is not a stage of secure aggregation")
