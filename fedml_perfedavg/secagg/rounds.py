"""One round of secure aggregation (Bonawitz et al., CCS 2017, on the complete graph of the round's
silos, as SecAgg+ is on a sparse one) as two pure objects, one per party: no sockets, no clock.
The server learns the sum of the masked inputs of the silos that got through, nothing else.

    ADVERTISE  each sampled silo: fresh X25519 key pairs (one for masks, one per other silo of
               the round to encrypt that pair's shares) and a commitment to a fresh self-mask seed,
               signed with its certificate key
    SHARE      with the advertisements (U1): Shamir shares, threshold t, of its seed and of its
               mask key, one per silo of U1, each AES-GCM-encrypted under its pair's key and
               signed; the server checks the signatures, relays them and cannot read them
    MASKED     with the shares addressed to it (their senders are U2): its encoded update plus the
               seed's mask plus, for every other silo j of U2, +mask(s_ij) if i < j else -mask(s_ij),
               s_ij agreed from the two mask keys; pairs cancel in the sum. A signed ciphertext that
               does not decrypt is proven with it: the receiver discloses its private key for that
               pair (the one key that pair's two silos share, so nothing its sender could not read
               already), the server decrypts, and names the sender, or the accuser if it decrypts.
               A proven sender is out of U3, and every survivor reveals its pair mask with it at
               UNMASK (what rebuilding a dropped silo's mask key would give), since its shares
               cannot be counted on
    CONSISTENCY where a silo of U2 sent no masked input (U3 smaller than U2, at least t): each
               survivor signs the list U3 it was given (the paper's consistency check, section 4),
               once a round
    UNMASK     for each j of U2, the share of j's seed if j is in U3, else the share of j's mask key;
               never both, only once per round, and for a U3 smaller than U2 only with at least t
               valid signatures over that one list. A server that shows two silos two lists cannot
               gather t signatures over either (t is more than half of the round's silos plus the
               colluders allowed for). Where U3 is the whole of U2 a silo reveals seed shares only,
               which no mask key can be rebuilt from, so that round needs no signatures: a server
               that tells other silos that some silo dropped still needs t signatures from silos
               that were not told the whole list (at most n - t of them, plus colluders: fewer than t)
    sum        from any t answers the server rebuilds the seeds of U3 (checked against their
               commitments) and the mask keys of U2 - U3 (checked against their public keys),
               and takes their masks out

A silo lost after SHARE costs the server only its input; fewer than t silos left at any stage
ends the round without a model (:class:`RoundFailed`), never with a wrong one.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .primitives import (
    KEY_BYTES,
    MASK_LABEL,
    SECRET_BYTES,
    SHARE_LABEL,
    KeyPair,
    SecAggError,
    Share,
    advert_payload,
    pair_keys_bytes,
    shares_payload,
    survivors_payload,
    usable_public_key,
    verify,
    agree,
    combine_secret,
    decrypt,
    encrypt,
    index_of,
    mask,
    pack_shares,
    pair_context,
    public_of,
    split_secret,
    unpack_shares,
)

SEED, KEY = "seed", "key"  # which secret an unmasking share is of
PAIR = "pair"  # an unmasking answer for a proven liar: the survivor's pair-mask seed with it, not a share
MAX_CIPHERTEXT_BYTES = 512
MAX_COMBINATIONS = 256  # subsets of shares tried when some shares are false


class RoundFailed(SecAggError):
    """Too few silos are left to finish the round (or their shares do not rebuild): no model."""


def default_threshold(sampled: int, colluding: int = 0) -> int:
    """The smallest t > (sampled + colluding) / 2: a server with ``colluding`` silos cannot
    obtain both secrets of any silo, nor gather t signatures over two survivor lists."""
    return (sampled + colluding) // 2 + 1


@dataclass(frozen=True)
class SiloRules:
    """What a silo enforces of every securely aggregated round, whatever the server asks (its own
    config's ``secagg_args``): the threshold, the colluding silos it allows for, and the fewest
    silos its input is summed with (itself included)."""

    threshold: int
    max_colluding: int = 0
    min_summed: int = 3

    def problem_with(self, sampled: int, silos: int) -> Optional[str]:
        """Why this silo will not take part in a round whose keyed schedule samples ``sampled``
        silos, ``silos`` of which the server sent the model (None: it will)."""
        if 2 * self.threshold <= sampled + self.max_colluding:
            return (
                f"the threshold {self.threshold} is not above half of the round's {sampled} sampled silos plus "
                f"secagg_args.max_colluding_silos={self.max_colluding}: a server could rebuild both secrets of a silo"
            )
        if silos < self.min_summed:
            return (
                f"the round has {silos} silo(s); this silo's input is summed with at least "
                f"secagg_args.min_summed_silos={self.min_summed} silos (fewer would learn each other's updates)"
            )
        return None


@dataclass(frozen=True)
class Advert:
    """A silo's round keys: its public keys, its seed's commitment, the digest of the round's terms
    as it was given them (the model, the silos, the weights' basis: every silo checks that all
    were given the same), its signature over them and the certificate that signature is checked with."""

    rank: int
    cipher_keys: Tuple[Tuple[int, bytes], ...]  # (peer rank, this silo's public key for that pair's shares)
    mask_public: bytes
    seed_commitment: bytes
    signature: bytes
    certificate: bytes
    terms_digest: bytes = bytes(32)

    def payload(self, run_id: str, round_idx: int) -> bytes:
        keys = self.mask_public + self.seed_commitment + self.terms_digest
        return advert_payload(run_id, round_idx, self.rank, pair_keys_bytes(self.cipher_keys), keys)

    def cipher_key_for(self, peer: int) -> Optional[bytes]:
        """This silo's public key for its pair with ``peer`` (None: it advertised none)."""
        return dict(self.cipher_keys).get(peer)


def commitment(seed: bytes) -> bytes:
    return hashlib.sha256(b"pfa-secagg-seed" + seed).digest()


def signed_mask(mine: int, other: int, pair_mask: np.ndarray) -> np.ndarray:
    """The pairwise mask as silo ``mine`` adds it: + when it has the lower rank, - otherwise."""
    return pair_mask if mine < other else (np.uint32(0) - pair_mask)


# A certificate check for a peer's advertisement: why it cannot be the rank's (None: it is).
CheckPeer = Callable[[Advert], Optional[str]]


@dataclass
class SiloRound:
    """Silo ``rank``'s part of round ``round_idx`` of run ``run_id`` with threshold ``threshold``;
    ``sign`` signs with the silo's certificate key, ``certificate`` is that certificate (PEM);
    ``terms_digest``: the round's terms as this silo was given them; ``min_summed``: the fewest
    silos this silo lets its input be summed with (itself included)."""

    run_id: str
    round_idx: int
    rank: int
    threshold: int
    sign: Callable[[bytes], bytes]
    certificate: bytes
    terms_digest: bytes = bytes(32)
    min_summed: int = 2
    peers: Sequence[int] = ()  # the round's silos (the terms'): one encryption key pair for each other
    masks: KeyPair = field(default_factory=KeyPair.generate)
    seed: bytes = field(default_factory=lambda: os.urandom(SECRET_BYTES))
    ciphers: Dict[int, KeyPair] = field(default_factory=dict)  # peer -> this silo's key pair for that pair
    adverts: Dict[int, Advert] = field(default_factory=dict)
    received: Dict[int, Tuple[Share, Share]] = field(default_factory=dict)  # sender -> (seed share, key share)
    accused: Dict[int, bytes] = field(default_factory=dict)  # sender whose signed shares do not decrypt -> pair key
    unmasked: bool = False
    signed: Optional[Tuple[int, ...]] = None  # the survivor list this silo signed

    def __post_init__(self) -> None:
        if not self.ciphers:
            self.ciphers = {int(p): KeyPair.generate() for p in sorted(set(self.peers)) if p != self.rank}

    def advertise(self) -> Advert:
        keys = tuple((peer, pair.public) for peer, pair in sorted(self.ciphers.items()))
        unsigned = Advert(self.rank, keys, self.masks.public, commitment(self.seed), b"", b"", self.terms_digest)
        signature = self.sign(unsigned.payload(self.run_id, self.round_idx))
        return Advert(
            self.rank, keys, self.masks.public, unsigned.seed_commitment, signature, self.certificate, self.terms_digest
        )

    def share(self, adverts: Dict[int, Advert], check_peer: CheckPeer) -> Dict[int, Tuple[bytes, bytes]]:
        """The encrypted shares for every other silo of U1 (``adverts``: rank -> its advertisement),
        each with this silo's signature over it (receiver -> (ciphertext, signature))."""
        if self.advertise_as_sent(adverts) is None:
            raise SecAggError(f"round {self.round_idx}: the server relayed no (or another) advertisement for this silo")
        if len(adverts) < self.threshold:
            raise RoundFailed(
                f"round {self.round_idx}: {len(adverts)} silos advertised keys, fewer than {self.threshold}"
            )
        for rank, advert in adverts.items():
            if rank == self.rank:
                continue
            theirs = advert.cipher_key_for(self.rank)
            if (
                advert.rank != rank
                or theirs is None
                or len(theirs) != KEY_BYTES
                or len(advert.mask_public) != KEY_BYTES
            ):
                raise SecAggError(f"round {self.round_idx}: the advertisement of rank {rank} is malformed")
            if rank not in self.ciphers:
                raise SecAggError(
                    f"round {self.round_idx}: rank {rank} advertised keys; it is not of the round's silos"
                )
            problem = check_peer(advert)
            if problem is not None:
                raise SecAggError(f"round {self.round_idx}: rank {rank}'s keys: {problem}")
            if not verify(advert.certificate, advert.payload(self.run_id, self.round_idx), advert.signature):
                raise SecAggError(f"round {self.round_idx}: rank {rank}'s keys are not signed by its certificate's key")
            if advert.terms_digest != self.terms_digest:
                raise SecAggError(
                    f"round {self.round_idx}: rank {rank} was given other terms for this round than this silo "
                    f"(another model, silo list, weights or threshold): the server shows silos different rounds"
                )
        self.adverts = dict(adverts)
        index = index_of(sorted(adverts))
        seed_shares = split_secret(self.seed, self.threshold, len(adverts))
        key_shares = split_secret(self.masks.private, self.threshold, len(adverts))
        out: Dict[int, Tuple[bytes, bytes]] = {}
        for rank, position in index.items():
            mine = (seed_shares[position - 1], key_shares[position - 1])
            if rank == self.rank:
                self.received[rank] = mine
                continue
            key = self._pair_key(rank)
            context = pair_context(self.run_id, self.round_idx, self.rank, rank)
            ciphertext = encrypt(key, pack_shares(self.rank, rank, *mine), context)
            out[rank] = (
                ciphertext,
                self.sign(shares_payload(self.run_id, self.round_idx, self.rank, rank, ciphertext)),
            )
        return out

    def _pair_key(self, rank: int) -> bytes:
        """The shares' key of this silo's pair with ``rank`` (both ends derive it from their keys for the pair)."""
        theirs = self.adverts[rank].cipher_key_for(self.rank)
        assert theirs is not None  # (checked in share)
        return self._agree(rank, self.ciphers[rank].private, theirs, SHARE_LABEL)

    def _agree(self, rank: int, private: bytes, public: bytes, label: bytes) -> bytes:
        """:func:`agree` with ``rank``'s key, naming ``rank`` where its key is a low-order point
        (the exchange itself finds it: no separate check is paid for every peer)."""
        try:
            return agree(private, public, label)
        except SecAggError:
            raise SecAggError(f"round {self.round_idx}: rank {rank} advertised a low-order key") from None

    def advertise_as_sent(self, adverts: Dict[int, Advert]) -> Optional[Advert]:
        """This silo's advertisement as the server should relay it (its signature is randomised,
        so the one relayed is compared on what it signs)."""
        relayed = adverts.get(self.rank)
        if relayed is None:
            return None
        same = (
            dict(relayed.cipher_keys) == {peer: pair.public for peer, pair in self.ciphers.items()}
            and relayed.mask_public == self.masks.public
            and relayed.seed_commitment == commitment(self.seed)
        )
        return relayed if same else None

    def masked_input(self, encoded: np.ndarray, ciphertexts: Dict[int, Tuple[bytes, bytes]]) -> np.ndarray:
        """``encoded`` (uint32, :mod:`.fixed_point`) masked, given the shares addressed to this silo
        (sender -> (ciphertext, its sender's signature): their senders and this silo are U2). A
        signed ciphertext that does not decrypt is noted in :attr:`accused` with this silo's key for
        that pair, which proves it; one its sender did not sign is the server's or the wire's doing,
        and this silo takes no further part (accusing on it would disclose a pair key for nothing)."""
        if not self.adverts:
            raise SecAggError(f"round {self.round_idx}: asked for a masked input before the shares")
        senders = set(ciphertexts) | {self.rank}
        unknown = senders - set(self.adverts)
        if unknown:
            raise SecAggError(f"round {self.round_idx}: shares from rank(s) {sorted(unknown)}, who advertised no keys")
        if len(senders) < self.threshold:
            raise RoundFailed(f"round {self.round_idx}: {len(senders)} silos shared, fewer than {self.threshold}")
        for sender, (ciphertext, signature) in sorted(ciphertexts.items()):
            payload = shares_payload(self.run_id, self.round_idx, sender, self.rank, ciphertext)
            if not verify(self.adverts[sender].certificate, payload, signature):
                raise SecAggError(
                    f"round {self.round_idx}: the shares relayed as rank {sender}'s are not signed by its "
                    f"certificate's key (changed after it sent them)"
                )
            try:
                plain = decrypt(
                    self._pair_key(sender), ciphertext, pair_context(self.run_id, self.round_idx, sender, self.rank)
                )
                self.received[sender] = unpack_shares(plain, sender, self.rank)
            except SecAggError:
                self.accused[sender] = self.ciphers[sender].private
        for sender in set(self.received) - senders:  # advertised, shared with nobody the server knows
            del self.received[sender]
        total = np.asarray(encoded, dtype=np.uint32) + mask(self.seed, len(encoded))
        for other in sorted(senders - {self.rank}):
            seed = self._agree(other, self.masks.private, self.adverts[other].mask_public, MASK_LABEL)
            total = total + signed_mask(self.rank, other, mask(seed, len(encoded)))
        return total

    def sign_survivors(self, survivors: Sequence[int]) -> bytes:
        """This silo's signature over the survivor list U3 it was given (the consistency check);
        one list a round: a second, other list is refused."""
        listed = self._take_list(survivors)
        return self.sign(survivors_payload(self.run_id, self.round_idx, listed))

    def _take_list(self, survivors: Sequence[int]) -> Tuple[int, ...]:
        """``survivors`` as this round's one survivor list (checked: silos that shared, this one
        among them, at least the threshold and ``min_summed``, no other list before)."""
        listed = tuple(sorted(set(int(r) for r in survivors)))
        if len(listed) != len(survivors):
            raise SecAggError(f"round {self.round_idx}: the survivor list {list(survivors)} repeats a silo")
        if self.signed is not None and self.signed != listed:
            raise SecAggError(
                f"round {self.round_idx}: asked to sign the survivor list {list(listed)} after {list(self.signed)}"
            )
        if not set(listed) <= set(self.received) or self.rank not in listed:
            raise SecAggError(f"round {self.round_idx}: the survivors {list(listed)} are not silos that shared")
        if len(listed) < max(self.threshold, self.min_summed):
            raise RoundFailed(
                f"round {self.round_idx}: {len(listed)} survivor(s) {list(listed)}: this silo's input is summed with "
                f"at least {max(self.threshold, self.min_summed)} silos (the threshold, secagg_args.min_summed_silos)"
            )
        self.signed = listed
        return listed

    def unmask(
        self, survivors: Sequence[int], signatures: Dict[int, bytes], liars: Sequence[int] = ()
    ) -> Dict[int, Tuple[str, Share]]:
        """For each silo of U2 (rank -> (which secret, this silo's share of it)): the seed's share
        for the ``survivors`` (U3), the mask key's for the others, and for ``liars`` (proven to
        have sent shares that do not decrypt) and those this silo accused, its pair-mask seed with
        them ((0, seed): what their mask key would give for this silo); once per round. Where U3 is
        the whole of U2 (seed shares only), unsigned; else only for the list this silo signed,
        with at least the threshold of valid ``signatures`` (rank -> signature) over it."""
        if self.unmasked:
            raise SecAggError(f"round {self.round_idx}: asked to unmask twice")
        survivors_set, liars_set = set(survivors), set(int(r) for r in liars) | set(self.accused)
        kept = sorted(survivors_set & liars_set)
        if kept or not liars_set <= set(self.received) | set(self.accused):
            raise SecAggError(
                f"round {self.round_idx}: the survivors {sorted(survivors_set)} keep rank(s) {kept} whose shares do "
                f"not decrypt, or the server names as liars {sorted(liars_set)} silos that did not share with this silo"
            )
        shared = set(self.received) | set(self.accused)
        if self.signed is None and survivors_set == shared and len(survivors_set) == len(survivors):
            self._take_list(survivors)  # one list a round: this one (its checks: the threshold, min_summed)
            self.unmasked = True
            return {rank: (SEED, seed_share) for rank, (seed_share, _) in self.received.items()}
        if self.signed is None or tuple(sorted(survivors_set)) != self.signed:
            raise SecAggError(
                f"round {self.round_idx}: asked to unmask for the survivors {sorted(survivors_set)}; this silo "
                f"signed {None if self.signed is None else list(self.signed)}"
            )
        payload = survivors_payload(self.run_id, self.round_idx, self.signed)
        valid = [
            rank
            for rank, signature in signatures.items()
            if rank in survivors_set
            and verify(self.certificate if rank == self.rank else self.adverts[rank].certificate, payload, signature)
        ]
        if len(valid) < self.threshold:
            raise SecAggError(
                f"round {self.round_idx}: {len(valid)} valid signature(s) {sorted(valid)} over the survivor list "
                f"{list(self.signed)}, fewer than the threshold {self.threshold}: the server may have shown other "
                f"silos another list; this silo reveals nothing"
            )
        self.unmasked = True
        answers: Dict[int, Tuple[str, Share]] = {}
        for rank in sorted(shared):
            if rank in liars_set:
                seed = self._agree(rank, self.masks.private, self.adverts[rank].mask_public, MASK_LABEL)
                answers[rank] = (PAIR, (0, seed))
            else:
                seed_share, key_share = self.received[rank]
                answers[rank] = (SEED, seed_share) if rank in survivors_set else (KEY, key_share)
        return answers


@dataclass
class ServerRound:
    """The server's part of one round: ``sampled`` silos, threshold ``threshold``, inputs of
    ``length`` words. It relays, collects and unmasks; it never holds a silo's secret before
    the unmasking stage, and never both of one silo's."""

    round_idx: int
    sampled: List[int]
    threshold: int
    length: int
    adverts: Dict[int, Advert] = field(default_factory=dict)
    shares: Dict[int, Dict[int, Tuple[bytes, bytes]]] = field(default_factory=dict)  # sender -> receiver -> signed
    masked: Dict[int, np.ndarray] = field(default_factory=dict)
    signatures: Dict[int, bytes] = field(default_factory=dict)  # survivor -> its signature over the list
    unmasking: Dict[int, Dict[int, Tuple[str, Share]]] = field(default_factory=dict)
    survivors: List[int] = field(default_factory=list)
    false_shares: Dict[int, str] = field(default_factory=dict)  # silo -> whose secret it sent a false share of
    liars: Dict[int, str] = field(default_factory=dict)  # silo proven to have sent shares that do not decrypt -> how
    run_id: str = ""

    def u1(self) -> List[int]:
        return sorted(self.adverts)

    def u2(self) -> List[int]:
        return sorted(self.shares)

    def take_advert(self, rank: int, advert: Advert) -> None:
        if rank not in self.sampled or rank in self.adverts or advert.rank != rank:
            raise SecAggError(f"round {self.round_idx}: an advertisement from rank {rank} is not awaited")
        peers = [peer for peer, _ in advert.cipher_keys]
        if sorted(peers) != sorted(set(self.sampled) - {rank}):
            raise SecAggError(
                f"round {self.round_idx}: rank {rank} advertised pair keys for ranks {peers}; the round's other silos "
                f"are {sorted(set(self.sampled) - {rank})}"
            )
        keys = [public for _, public in advert.cipher_keys] + [advert.mask_public]
        if not all(usable_public_key(public) for public in keys):
            raise SecAggError(f"round {self.round_idx}: rank {rank} advertised a low-order key")
        self.adverts[rank] = advert

    def take_shares(self, rank: int, ciphertexts: Dict[int, Tuple[bytes, bytes]]) -> None:
        """``rank``'s shares (receiver -> (ciphertext, signature)), each signature checked before
        any is relayed: an unsigned share would get its honest receiver to decline."""
        expected = set(self.adverts) - {rank}
        if rank not in self.adverts or rank in self.shares or set(ciphertexts) != expected:
            raise SecAggError(
                f"round {self.round_idx}: rank {rank} sent shares for {sorted(ciphertexts)}; the round awaits "
                f"shares for {sorted(expected)} from the silos that advertised keys"
            )
        if any(len(c) > MAX_CIPHERTEXT_BYTES for c, _ in ciphertexts.values()):
            raise SecAggError(f"round {self.round_idx}: rank {rank} sent a share longer than the protocol's")
        certificate = self.adverts[rank].certificate
        for receiver, (ciphertext, signature) in sorted(ciphertexts.items()):
            if not verify(
                certificate, shares_payload(self.run_id, self.round_idx, rank, receiver, ciphertext), signature
            ):
                raise SecAggError(
                    f"round {self.round_idx}: rank {rank}'s share for rank {receiver} is not signed by its "
                    f"certificate's key"
                )
        self.shares[rank] = dict(ciphertexts)

    def shares_for(self, receiver: int) -> Dict[int, Tuple[bytes, bytes]]:
        """The ciphertexts addressed to ``receiver`` by the silos of U2."""
        return {sender: out[receiver] for sender, out in self.shares.items() if sender != receiver}

    def take_masked(self, rank: int, values: np.ndarray, accusations: Optional[Dict[int, bytes]] = None) -> List[int]:
        """``rank``'s masked input, with its ``accusations`` (sender whose shares to it do not
        decrypt -> its private key for their pair); the senders they prove, newly out of U3. A false
        accusation (the shares decrypt under the key disclosed, or it is not the key advertised) is
        :class:`SecAggError`: the accuser is the liar."""
        if rank not in self.shares or rank in self.masked or rank in self.liars:
            raise SecAggError(f"round {self.round_idx}: a masked input from rank {rank} is not awaited")
        if values.dtype != np.uint32 or values.shape != (self.length,):
            raise SecAggError(
                f"round {self.round_idx}: rank {rank}'s masked input is {values.dtype} of shape {values.shape}; "
                f"the round takes uint32 of shape ({self.length},)"
            )
        proven = [
            sender for sender, private in sorted((accusations or {}).items()) if self._proves(rank, sender, private)
        ]
        for sender in proven:
            self.liars[sender] = (
                f"its shares for rank {rank} do not decrypt (proven: rank {rank} disclosed its key for the pair)"
            )
            self.masked.pop(sender, None)
        self.masked[rank] = values
        return proven

    def _proves(self, accuser: int, sender: int, private: bytes) -> bool:
        """Whether ``accuser``'s disclosed pair key shows ``sender``'s signed shares to it not to
        decrypt (False: the sender is already proven); :class:`SecAggError` if it does not."""
        if sender == accuser or sender not in self.shares or accuser not in self.shares[sender]:
            raise SecAggError(f"round {self.round_idx}: rank {accuser} accuses rank {sender}, which sent it no shares")
        mine, theirs = self.adverts[accuser].cipher_key_for(sender), self.adverts[sender].cipher_key_for(accuser)
        if len(private) != KEY_BYTES or mine is None or theirs is None or public_of(private) != mine:
            raise SecAggError(
                f"round {self.round_idx}: rank {accuser} accuses rank {sender} with a key that is not the one it "
                f"advertised for their pair"
            )
        ciphertext, _ = self.shares[sender][accuser]
        try:
            plain = decrypt(
                agree(private, theirs, SHARE_LABEL),
                ciphertext,
                pair_context(self.run_id, self.round_idx, sender, accuser),
            )
            unpack_shares(plain, sender, accuser)
        except SecAggError:
            return sender not in self.liars
        raise SecAggError(
            f"round {self.round_idx}: rank {accuser} accuses rank {sender} of shares that do not decrypt; they decrypt "
            f"under the key it disclosed"
        )

    def close_masked(self) -> List[int]:
        """U3: the silos whose masked input arrived; :class:`RoundFailed` if fewer than the threshold."""
        if len(self.masked) < self.threshold:
            raise RoundFailed(
                f"round {self.round_idx}: masked inputs from {sorted(self.masked)}, fewer than "
                f"secagg_args.reconstruction_threshold={self.threshold}; silos {self.dropped()} dropped out"
            )
        self.survivors = sorted(self.masked)
        return self.survivors

    def dropped(self) -> List[int]:
        return [s for s in self.sampled if s not in self.masked]

    def take_signature(self, rank: int, signature: bytes) -> None:
        """``rank``'s signature over the survivor list (checked here too: a false one puts its
        sender out of the round before the list goes to the others)."""
        if rank not in self.survivors or rank in self.signatures:
            raise SecAggError(f"round {self.round_idx}: a survivor-list signature from rank {rank} is not awaited")
        payload = survivors_payload(self.run_id, self.round_idx, self.survivors)
        if not verify(self.adverts[rank].certificate, payload, signature):
            raise SecAggError(f"round {self.round_idx}: rank {rank}'s signature over the survivor list is not valid")
        self.signatures[rank] = signature

    def needs_consistency(self) -> bool:
        """Whether a silo that shared sent no masked input: then unmasking reveals mask-key shares,
        and the survivors must first sign the list (:meth:`SiloRound.unmask`)."""
        return set(self.survivors) != set(self.shares)

    def close_signatures(self) -> List[int]:
        """The survivors that signed the list (U4); :class:`RoundFailed` if fewer than the threshold."""
        if len(self.signatures) < self.threshold:
            raise RoundFailed(
                f"round {self.round_idx}: {len(self.signatures)} survivor(s) signed the survivor list, fewer than "
                f"secagg_args.reconstruction_threshold={self.threshold}"
            )
        return sorted(self.signatures)

    def take_unmasking(self, rank: int, shares: Dict[int, Tuple[str, Share]]) -> None:
        asked = self.signatures if self.needs_consistency() else self.survivors
        if rank not in asked or rank in self.unmasking:
            raise SecAggError(f"round {self.round_idx}: unmasking shares from rank {rank} are not awaited")
        own_index = index_of(self.u1())[rank]
        if set(shares) != set(self.shares):
            raise SecAggError(
                f"round {self.round_idx}: rank {rank} sent shares of {sorted(shares)}; the round takes one of each "
                f"silo that shared: {self.u2()}"
            )
        for owner, (kind, share) in shares.items():
            want = SEED if owner in self.masked else PAIR if owner in self.liars else KEY
            if kind != want or len(share[1]) != SECRET_BYTES:
                raise SecAggError(f"round {self.round_idx}: rank {rank} sent a {kind} share of rank {owner}'s")
            if kind != PAIR and share[0] != own_index:
                raise SecAggError(
                    f"round {self.round_idx}: rank {rank} sent a share with Shamir index {share[0]}; its own is "
                    f"{own_index}"
                )
        self.unmasking[rank] = shares

    def ready(self) -> bool:
        return len(self.unmasking) >= self.threshold

    def total(self) -> np.ndarray:
        """The modular sum of U3's encoded inputs, every mask taken out; :class:`RoundFailed` if
        too few answered or their shares do not rebuild the committed secrets."""
        if not self.ready():
            raise RoundFailed(
                f"round {self.round_idx}: unmasking shares from {sorted(self.unmasking)}, fewer than "
                f"secagg_args.reconstruction_threshold={self.threshold}"
            )
        total = np.zeros(self.length, dtype=np.uint32)
        for values in self.masked.values():
            total = total + values
        for owner in self.u2():
            if owner in self.liars:
                total = total - self._pair_masks(owner)
                continue
            shares = {sender: s[owner][1] for sender, s in self.unmasking.items() if owner in s}
            advert = self.adverts[owner]
            if owner in self.masked:
                seed = self._rebuild(owner, shares, commitment, advert.seed_commitment)
                total = total - mask(seed, self.length)
            else:
                key = self._rebuild(owner, shares, public_of, advert.mask_public)
                for survivor in self.survivors:
                    pair = mask(agree(key, self.adverts[survivor].mask_public, MASK_LABEL), self.length)
                    total = total - signed_mask(survivor, owner, pair)
        return total

    def _pair_masks(self, liar: int) -> np.ndarray:
        """The masks the survivors added for their pairs with ``liar`` (proven to have sent shares
        that do not decrypt, so its mask key cannot be counted on to rebuild): each survivor's own."""
        total = np.zeros(self.length, dtype=np.uint32)
        for survivor in self.survivors:
            answer = self.unmasking.get(survivor, {}).get(liar)
            if answer is None:
                raise RoundFailed(
                    f"round {self.round_idx}: rank {survivor}, summed, did not reveal its pair mask with rank {liar} "
                    f"(proven to have sent shares that do not decrypt): a round with such a silo needs every "
                    f"survivor's unmasking answer"
                )
            total = total + signed_mask(survivor, liar, mask(answer[1][1], self.length))
        return total

    def _rebuild(self, owner: int, shares: Dict[int, Share], public: Callable[[bytes], bytes], known: bytes) -> bytes:
        """``owner``'s secret from ``shares`` (sender -> share), checked against what it published
        of it (``public`` of the secret must be ``known``): all the shares, else subsets of the
        threshold's size; a sender whose share does not lie on the rebuilt secret's polynomial is
        noted in :attr:`false_shares`."""
        senders = sorted(shares)
        candidates = itertools.chain([senders], itertools.combinations(senders, self.threshold))
        for subset in itertools.islice(candidates, MAX_COMBINATIONS):
            if len(subset) < self.threshold:
                continue
            try:
                secret = combine_secret([shares[s] for s in subset])
            except SecAggError:
                continue
            if public(secret) != known:
                continue
            base = list(subset[: self.threshold - 1])
            for sender in senders:
                if sender not in subset:
                    try:
                        if combine_secret([shares[s] for s in base] + [shares[sender]]) != secret:
                            self.false_shares[sender] = f"a false share of rank {owner}'s secret"
                    except SecAggError:
                        self.false_shares[sender] = f"a false share of rank {owner}'s secret"
            return secret
        raise RoundFailed(
            f"round {self.round_idx}: the shares of rank {owner}'s secret do not rebuild it (a silo sent false shares)"
        )
