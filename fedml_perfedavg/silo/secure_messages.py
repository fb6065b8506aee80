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


def _bytes(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _text(data: bytes) -> str:
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
        [[peer, _text(public)] for peer, public in advert.cipher_keys],
        _text(advert.mask_public),
        _text(advert.seed_commitment),
        _text(advert.signature),
        advert.certificate.decode(),
        _text(advert.terms_digest),
    ]


def signed_shares_to_wire(shares: Dict[int, Any]) -> List[Any]:
    """Shares (rank -> (ciphertext, signature)) as the wire carries them: [rank, [ciphertext, signature]]."""
    return [[r, [_text(c), _text(s)]] for r, (c, s) in sorted(shares.items())]


def signed_shares_from_wire(rows: List[Any]) -> Dict[int, Any]:
    return {int(r): (_bytes(c), _bytes(s)) for r, (c, s) in rows}


def advert_from_wire(rank: int, value: List[Any]) -> Advert:
    return Advert(
        rank,
        tuple((int(peer), _bytes(public)) for peer, public in value[0]),
        _bytes(value[1]),
        _bytes(value[2]),
        _bytes(value[3]),
        value[4].encode(),
        _bytes(value[5]),
    )
