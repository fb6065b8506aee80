"""A silo's side of one securely aggregated round (``secagg_args.enable_secagg``): its update
(the trained model minus the round's model, over the model's parameters) clipped to the bound the
server would enforce in the clear, encoded in the round's fixed point, and its answers to each of
the server's stages (:mod:`fedml_perfedavg.secagg.rounds`). The silo checks the server's terms
against what it computes itself, and every other silo's keys against the run's CA, so a dishonest
server can neither widen the bound unseen nor pass its own keys off as a silo's."""

from __future__ import annotations

import base64
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ...secagg import fixed_point, vectors
from ...secagg.primitives import SecAggError, sign
from ...secagg.rounds import Advert, SiloRound
from . import wire
from .credentials import certificate_rank_problem
from .secure_rounds import advert_from_wire


def _text(data: bytes) -> str:
    return base64.b64encode(data).decode()


class SecureSiloRound:
    """Silo ``party.rank``'s part of round ``round_idx``, its input ``encoded``; ``ca``: the run's CA."""

    def __init__(self, round_idx: int, party: SiloRound, encoded: np.ndarray, ca: bytes) -> None:
        self.round_idx, self.party, self.encoded, self.ca = round_idx, party, encoded, ca

    @classmethod
    def start(
        cls,
        rank: int,
        round_idx: int,
        terms: Optional[Dict[str, Any]],
        threshold: Optional[int],
        received: Dict[str, torch.Tensor],
        trained: Dict[str, torch.Tensor],
        client_trainer: Any,
        settings: Any,
    ) -> "SecureSiloRound":
        """The silo's round from the server's ``terms`` (:data:`wire.SECAGG`), the model it
        ``received`` and the one it ``trained``; :class:`SecAggError` naming what does not fit."""
        if terms is None or threshold is None:
            raise SecAggError(
                "the server's model came without secure-aggregation terms, or with them while this silo's "
                "secagg_args.enable_secagg is false: the two disagree"
            )
        if terms["threshold"] != threshold:
            raise SecAggError(f"the server's threshold {terms['threshold']} is not this run's ({threshold})")
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
            settings.run_id, round_idx, rank, threshold, lambda data: sign(credentials.key, data), credentials.cert
        )
        return cls(round_idx, party, encoded, credentials.ca)

    def advertise(self) -> Advert:
        return self.party.advertise()

    def check_peer(self, advert: Advert) -> Optional[str]:
        return certificate_rank_problem(advert.certificate, self.ca, advert.rank)

    def answer(self, kind: int, params: Dict[str, Any]) -> Tuple[int, Dict[str, Any], Any]:
        """This silo's answer (type, parameters, tensors) to the server's stage message ``kind``."""
        party = self.party
        if kind == wire.SECAGG_KEYS:
            adverts = {int(r): advert_from_wire(int(r), v) for r, v in params["adverts"]}
            out = party.share(adverts, self.check_peer)
            return wire.SECAGG_SHARES_OUT, {"shares": [[r, _text(c)] for r, c in sorted(out.items())]}, None
        if kind == wire.SECAGG_SHARES:
            ciphertexts = {int(r): base64.b64decode(c, validate=True) for r, c in params["shares"]}
            masked = party.masked_input(self.encoded, ciphertexts)
            return wire.SECAGG_MASKED, {}, {wire.MASKED_KEY: torch.from_numpy(masked.view(np.int32).copy())}
        if kind == wire.SECAGG_UNMASK:
            shares = party.unmask([int(r) for r in params["survivors"]])
            rows = [[owner, which, index, _text(share)] for owner, (which, (index, share)) in sorted(shares.items())]
            return wire.SECAGG_UNMASKING, {"shares": rows}, None
        raise SecAggError(f"message type {kind} is not a stage of secure aggregation")
