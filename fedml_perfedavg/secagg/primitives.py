"""The cryptographic pieces of secure aggregation, each a maintained library's, none written here:

- key agreement: X25519 (``cryptography``), the shared secret stretched by HKDF-SHA256 with a
  label per use, so one agreement never serves two purposes;
- share encryption: AES-256-GCM (``cryptography``), the pair and the round as associated data;
- masks: AES-256-CTR keystream (``cryptography``) from a 32-byte seed, read as 32-bit words;
- secret sharing: Shamir's scheme from PyCryptodome (``Crypto.Protocol.SecretSharing.Shamir``,
  over GF(2^128), 16-byte secrets; a 32-byte secret is shared as two halves, as Flower does);
- key binding: ECDSA-SHA256 with the silo's own certificate key, checked against its certificate.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_BYTES = 32
KEY_BYTES = 32  # an X25519 public key
NONCE_BYTES = 12
MASK_LABEL, SHARE_LABEL = b"fedml-perfedavg secagg mask", b"fedml-perfedavg secagg share key"


class SecAggError(ValueError):
    """Input of another party that cannot be what the protocol says (a bad key, share, signature
    or ciphertext): the text says which party and what."""


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair: the private key's 32 raw bytes and the public key's."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> "KeyPair":
        key = X25519PrivateKey.generate()
        raw = serialization.Encoding.Raw
        private = key.private_bytes(raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        return cls(private, key.public_key().public_bytes(raw, serialization.PublicFormat.Raw))


def public_of(private: bytes) -> bytes:
    """The public key of a private X25519 key's raw bytes."""
    raw = serialization.Encoding.Raw
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(raw, serialization.PublicFormat.Raw)


def agree(private: bytes, public: bytes, label: bytes) -> bytes:
    """A 32-byte key both ends of a pair derive (X25519, then HKDF-SHA256 under ``label``)."""
    if len(public) != KEY_BYTES:
        raise SecAggError(f"a public key of {len(public)} bytes; X25519's have {KEY_BYTES}")
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as err:  # an all-zero shared secret: a low-order public key
        raise SecAggError(f"the public key cannot be agreed with ({err})") from None
    return HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=None, info=label).derive(shared)


def encrypt(key: bytes, plaintext: bytes, context: bytes) -> bytes:
    """AES-256-GCM under ``key``, a fresh nonce first; ``context`` is authenticated, not sent."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, context)


def decrypt(key: bytes, ciphertext: bytes, context: bytes) -> bytes:
    """The plaintext of :func:`encrypt`, or :class:`SecAggError` if it was changed or is for another context."""
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], context)
    except (InvalidTag, ValueError):
        raise SecAggError("a ciphertext does not decrypt (changed, or meant for another pair or round)") from None


def mask(seed: bytes, length: int) -> np.ndarray:
    """``length`` pseudo-random 32-bit words from ``seed`` (AES-256-CTR keystream, zero nonce: each
    seed is used for one mask only)."""
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * length)) + encryptor.finalize(), dtype="<u4").copy()


Share = Tuple[int, bytes]  # (index 1..n, 32 bytes: the shares of both halves)


def split_secret(secret: bytes, threshold: int, parties: int) -> List[Share]:
    """Shamir shares of a 32-byte ``secret`` for ``parties`` (indices 1..parties), any
    ``threshold`` of which rebuild it and fewer reveal nothing of it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret of {len(secret)} bytes; {SECRET_BYTES} are shared")
    low = Shamir.split(threshold, parties, secret[:16])
    high = Shamir.split(threshold, parties, secret[16:])
    return [(i, a + b) for (i, a), (_, b) in zip(low, high)]


def combine_secret(shares: Sequence[Share]) -> bytes:
    """The secret of at least the threshold's number of :func:`split_secret` shares."""
    if len({i for i, _ in shares}) != len(shares) or any(len(s) != SECRET_BYTES for _, s in shares):
        raise SecAggError("shares to combine must have distinct indices and 32 bytes each")
    low = Shamir.combine([(i, s[:16]) for i, s in shares])
    high = Shamir.combine([(i, s[16:]) for i, s in shares])
    return bytes(low) + bytes(high)


@functools.lru_cache(maxsize=4)
def _signing_key(private_key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    # a silo signs every share it sends (one per peer a round): its key is parsed once
    key = serialization.load_pem_private_key(private_key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("secure aggregation signs with an elliptic-curve certificate key")
    return key


def sign(private_key_pem: bytes, payload: bytes) -> bytes:
    """ECDSA-SHA256 signature of ``payload`` with a rank's certificate key (PEM)."""
    return _signing_key(private_key_pem).sign(payload, ec.ECDSA(hashes.SHA256()))


@functools.lru_cache(maxsize=256)
def _verifying_key(certificate_pem: bytes) -> ec.EllipticCurvePublicKey | None:
    # the server checks every relayed share's signature (n(n-1) a round): each certificate is parsed once
    from cryptography import x509

    try:
        key = x509.load_pem_x509_certificate(certificate_pem).public_key()
    except ValueError:
        return None
    return key if isinstance(key, ec.EllipticCurvePublicKey) else None


def verify(certificate_pem: bytes, payload: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the certificate's key's over ``payload``."""
    key = _verifying_key(bytes(certificate_pem))
    if key is None:
        return False
    try:
        key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError):
        return False


def advert_payload(run_id: str, round_idx: int, rank: int, cipher_public: bytes, mask_public: bytes) -> bytes:
    """What a silo signs of its round keys: the run, the round, its rank and both public keys."""
    return b"|".join([b"pfa-secagg-keys", run_id.encode(), b"%d" % round_idx, b"%d" % rank, cipher_public, mask_public])


def shares_payload(run_id: str, round_idx: int, sender: int, receiver: int, ciphertext: bytes) -> bytes:
    """What a silo signs of each share ciphertext it sends: the run, the round, both ranks and the
    ciphertext's digest. A receiver whose shares do not decrypt proves it only against a ciphertext
    its sender signed, so neither a server nor the wire can get an honest sender accused."""
    digest = hashlib.sha256(ciphertext).digest()
    return b"|".join(
        [b"pfa-secagg-share", run_id.encode(), b"%d" % round_idx, b"%d" % sender, b"%d" % receiver, digest]
    )


def pair_keys_bytes(keys: Sequence[Tuple[int, bytes]]) -> bytes:
    """A silo's per-pair encryption keys (peer rank, public key), as its advertisement signs them."""
    return b"".join(struct.pack(">I", rank) + public for rank, public in sorted(keys))


def survivors_payload(run_id: str, round_idx: int, survivors: Sequence[int]) -> bytes:
    """What a survivor signs in the consistency check (Bonawitz et al. 2017, section 4): the run,
    the round and the survivor list it was given."""
    ranks = b",".join(b"%d" % r for r in sorted(survivors))
    return b"|".join([b"pfa-secagg-survivors", run_id.encode(), b"%d" % round_idx, ranks])


def usable_public_key(public: bytes) -> bool:
    """Whether ``public`` is an X25519 key that agrees with a fresh key to a non-zero secret (a
    low-order point, the all-zero key among them, gives every party the same known secret)."""
    if len(public) != KEY_BYTES:
        return False
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


_SHARE_HEADER = struct.Struct(">IIHH")  # sender, receiver, index of the b share, index of the key share


def pack_shares(sender: int, receiver: int, seed_share: Share, key_share: Share) -> bytes:
    """The plaintext a silo encrypts for another: its shares of the sender's self-mask seed and
    mask key, with both ranks (so a relayed ciphertext cannot be passed off as another pair's)."""
    return _SHARE_HEADER.pack(sender, receiver, seed_share[0], key_share[0]) + seed_share[1] + key_share[1]


def unpack_shares(data: bytes, sender: int, receiver: int) -> Tuple[Share, Share]:
    if len(data) != _SHARE_HEADER.size + 2 * SECRET_BYTES:
        raise SecAggError(f"shares from rank {sender}: {len(data)} bytes, not the protocol's")
    got_sender, got_receiver, seed_index, key_index = _SHARE_HEADER.unpack_from(data)
    if (got_sender, got_receiver) != (sender, receiver):
        raise SecAggError(f"shares said to be from rank {sender} to {receiver} name {got_sender} to {got_receiver}")
    start = _SHARE_HEADER.size
    return (seed_index, data[start : start + SECRET_BYTES]), (key_index, data[start + SECRET_BYTES :])


def pair_context(run_id: str, round_idx: int, sender: int, receiver: int) -> bytes:
    return b"pfa-secagg-shares|%s|%d|%d|%d" % (run_id.encode(), round_idx, sender, receiver)


def index_of(ranks: Sequence[int]) -> Dict[int, int]:
    """Each rank's Shamir index (1..n) among the round's ranks, in rank order."""
    return {rank: position + 1 for position, rank in enumerate(sorted(ranks))}
