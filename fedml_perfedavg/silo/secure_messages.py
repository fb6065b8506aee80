"""Secure aggregation's messages as the wire carries them, and the digest of a round's terms:
what both sides of the protocol write and read alike (the server, :mod:`.server.secure_rounds`;
a silo, :mod:`.secure`), in one place."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Dict, List

from ..secagg.rounds import Advert
from .outcome import state_digest


def from_base64(text: str) -> bytes:
    """Bytes the wire carries as base64 text (strict: other characters are an error)."""
    return base64.b64decode(text, validate=True)


def to_base64(data: bytes) -> str:
    """Bytes as the wire carries them."""
    return base64.b64encode(data).decode()


def terms_digest(terms: Dict[str, Any], received: Dict[str, Any]) -> bytes:
    """What every silo of a round must have been given alike: the terms but the silo's own weight
    (the threshold, bits, bound, length, silos, counts) and the model itself. Each silo signs it
    into its advertisement; the server, which sent both, checks it before relaying."""
    shared = {k: v for k, v in terms.items() if k != "weight"}
    text = json.dumps({"terms": shared, "model": state_digest(received)}, sort_keys=True)
    return hashlib.sha256(b"pfa-secagg-terms" + text.encode()).digest()


def advert_to_wire(advert: Advert) -> List[Any]:
    return [
        [[peer, to_base64(public)] for peer, public in advert.cipher_keys],
        to_base64(advert.mask_public),
        to_base64(advert.seed_commitment),
        to_base64(advert.signature),
        advert.certificate.decode(),
        to_base64(advert.terms_digest),
    ]


def signed_shares_to_wire(shares: Dict[int, Any]) -> List[Any]:
    """Shares (rank -> (ciphertext, signature)) as the wire carries them: [rank, [ciphertext, signature]]."""
    return [[r, [to_base64(c), to_base64(s)]] for r, (c, s) in sorted(shares.items())]


def signed_shares_from_wire(rows: List[Any]) -> Dict[int, Any]:
    return {int(r): (from_base64(c), from_base64(s)) for r, (c, s) in rows}


def advert_from_wire(rank: int, value: List[Any]) -> Advert:
    return Advert(
        rank,
        tuple((int(peer), from_base64(public)) for peer, public in value[0]),
        from_base64(value[1]),
        from_base64(value[2]),
        from_base64(value[3]),
        value[4].encode(),
        from_base64(value[5]),
    )
