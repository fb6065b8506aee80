"""The run's key roster: every rank's public key, fixed before the first round and pinned by each
process, so that a certificate the run's CA signed is not enough to take part. Whoever holds
``ca.key`` can sign a certificate for any rank; only a key on the roster is that rank.

``roster.json`` (``fedml-perfedavg certs roster`` writes it from the ranks' certificates)::

    {"format": "fedml-perfedavg key roster, version 1",
     "ranks": {"0": "<SHA-256 of rank 0's public key (SubjectPublicKeyInfo, DER), hex>", "1": ...}}

Each organization makes its own key and signing request (``certs request``), so its private key
never leaves it; it publishes its key's fingerprint (``certs fingerprint``) and checks the roster's
rows against the fingerprints the others published before its first run. Every rank reads the
roster as untrusted (size-capped strict JSON, checked row by row) and the run's processes agree on
its digest when a silo announces itself. A peer whose certificate's key is not its rank's row is
refused and named: on the wire (:mod:`.transport`), and in secure aggregation, where a silo checks
each other silo's advertisement itself (:mod:`fedml_perfedavg.silo.secure`), whatever the server relays.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from ..core.errors import ConfigError
from ..documents import read_document

ROSTER = "roster.json"
FORMAT = "fedml-perfedavg key roster, version 1"
MAX_ROSTER_BYTES = 1 << 20
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")
_RANK = re.compile(r"^(0|[1-9]\d{0,5})$")


@functools.lru_cache(maxsize=1024)  # a peer's certificate is checked at each of its messages
def key_fingerprint(pem: bytes) -> str:
    """The SHA-256 (hex) of the public key in ``pem``: a certificate, a signing request or a private
    key (its public half). :class:`ValueError` where it holds none of them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    public = None
    for load in (
        lambda: x509.load_pem_x509_certificate(pem).public_key(),
        lambda: x509.load_pem_x509_csr(pem).public_key(),
        lambda: serialization.load_pem_private_key(pem, password=None).public_key(),
    ):
        try:
            public = load()
            break
        except (ValueError, TypeError):
            continue
    if public is None:
        raise ValueError("not a PEM certificate, signing request or private key")
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


@dataclass(frozen=True)
class KeyRoster:
    """Rank -> the fingerprint of its public key; ``path``: where it was read (named in refusals)."""

    keys: Mapping[int, str]
    path: str = ROSTER

    @property
    def digest(self) -> str:
        """What the run's processes agree on (a silo's announcement carries it)."""
        text = json.dumps({str(r): k for r, k in sorted(self.keys.items())}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def problem(self, rank: int, certificate: bytes) -> Optional[str]:
        """Why ``certificate`` (PEM) is not rank ``rank``'s on the roster, or None."""
        try:
            seen = key_fingerprint(certificate)
        except ValueError as err:
            return f"its certificate cannot be read ({err})"
        pinned = self.keys.get(rank)
        if pinned is None:
            return f"rank {rank} is not on the run's key roster ({self.path})"
        if seen != pinned:
            return (
                f"its certificate's key {seen[:16]}... is not rank {rank}'s on the run's key roster ({pinned[:16]}..., "
                f"{self.path}): a certificate the run's CA signed outside the roster"
            )
        return None


def write_roster(path: str, keys: Mapping[int, str]) -> None:
    """Write a roster of ``keys`` (rank -> fingerprint) to ``path``."""
    text = json.dumps({"format": FORMAT, "ranks": {str(r): k for r, k in sorted(keys.items())}}, indent=1)
    with open(path, "w") as stream:
        stream.write(text + "\n")


def read_roster(path: str, ranks: Optional[int] = None) -> KeyRoster:
    """The roster at ``path``, checked (with ``ranks``: it must list ranks 0..ranks-1 exactly);
    :class:`ConfigError` naming the file and what is wrong."""
    try:
        rows = read_document(path, MAX_ROSTER_BYTES, FORMAT).get("ranks")
        if not isinstance(rows, dict) or not rows:
            raise ValueError("its ranks are not a non-empty object")
        keys: Dict[int, str] = {}
        for rank, fingerprint in rows.items():
            if not isinstance(rank, str) or not _RANK.match(rank):
                raise ValueError(f"{rank!r} is not a rank")
            if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
                raise ValueError(f"rank {rank}'s key {fingerprint!r} is not a SHA-256 fingerprint (64 hex digits)")
            keys[int(rank)] = fingerprint
        if len(set(keys.values())) != len(keys):
            raise ValueError("one key is listed for two ranks")
        if ranks is not None and sorted(keys) != list(range(ranks)):
            raise ValueError(f"it lists ranks {sorted(keys)}; this run has ranks 0..{ranks - 1}")
    except OSError as err:
        raise ConfigError(f"comm_args.roster_path={path!r}: cannot read the key roster ({err.strerror})") from None
    except ValueError as err:
        raise ConfigError(f"comm_args.roster_path={path!r}: not the run's key roster ({err})") from None
    return KeyRoster(keys, path)


def roster_path_of(roster_path: Optional[str], tls_dir: Optional[str]) -> Optional[str]:
    """The roster a rank pins: ``comm_args.roster_path``, else ``tls_dir``'s roster.json where there is one."""
    if roster_path:
        return roster_path
    if tls_dir and os.path.isfile(os.path.join(tls_dir, ROSTER)):
        return os.path.join(tls_dir, ROSTER)
    return None
