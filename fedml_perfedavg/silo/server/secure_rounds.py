"""Secure aggregation as states of the cross-silo protocol's TRAINING phase
(``secagg_args.enable_secagg``; the maths is :mod:`fedml_perfedavg.secagg`'s)::

    ADVERTISE --all of the round's silos, or the deadline--> SHARE --> MASKED --> [CONSISTENCY] --> UNMASK --> sum
    (CONSISTENCY only where a silo that shared sent no masked input: secagg/rounds.py says why)
    (the model went out; silos train, then advertise keys)

Each stage waits for the silos the previous one left, with the round deadline; a silo that misses
it is given up on as a silo that misses a plaintext round is, and the round goes on with the
others while at least the threshold are left. Fewer end the round without a model: the global
model is kept (a skipped round) and the log names who dropped out, never a wrong model. Nothing
here reads a clock or sends: it is told the time, and its sends go to the event's outbox.

:class:`SecureRound` is the stage machine of one round; :class:`SecureAggregation` is the round's
aggregation that :class:`~.rounds.SiloRounds` picks when secure aggregation is on (beside
:class:`~.rounds.ClearAggregation`): it drives the stages on the round's events and deadlines and
hands the unmasked mean to the algorithm.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from ...secagg import fixed_point
from ...secagg.primitives import SecAggError, verify
from ...secagg.rounds import Advert, RoundFailed, ServerRound
from ...net.credentials import certificate_rank_problem
from ...net.key_roster import KeyRoster
from ...net import wire
from ..secure_messages import (
    from_base64,
    to_base64,
    advert_from_wire,
    advert_to_wire,
    signed_shares_from_wire,
    signed_shares_to_wire,
    terms_digest,
)
from .events import ROUND, Outbox, ToSilo
from .awaited import OpenRound
from .membership import SiloMembership
from .phases import Phase, PhaseClock
from .roster import SiloRoster

logger = logging.getLogger(__name__)

REFUSED_SECAGG = "secagg"  # a secure-aggregation message that is not what its stage takes (summary.json)


class OverBound(RoundFailed):
    """The securely summed average is over the bound every silo clips to: a silo of the round sent
    words it did not clip (which one, the sum alone cannot say)."""


NAMED_AFTER = 3  # rounds over the bound before the silos found in all of them (and no good one) are named


class UnclippedInputs:
    """Which silo keeps sending unclipped inputs, from the rounds it was summed in: the silos summed
    in every round whose average broke the bound, less those summed in a round that did not. Once
    :data:`NAMED_AFTER` rounds broke it and that leaves one silo, it is named (as the plaintext
    screen names a client whose updates it keeps rejecting). Where every round sums the same silos,
    or two silos are always summed together, nobody can be told apart, and nobody is named."""

    def __init__(self) -> None:
        self.failed: List[Set[int]] = []
        self.passed: Set[int] = set()
        self.named: Set[int] = set()

    def note(self, summed: List[int], over_bound: bool) -> List[int]:
        """A round that summed ``summed``; the silos newly found out (sorted)."""
        if not over_bound:
            self.passed.update(summed)
            return []
        self.failed.append(set(summed))
        if len(self.failed) < NAMED_AFTER:
            return []
        suspects = set.intersection(*self.failed) - self.passed - self.named
        if len(suspects) != 1:
            return []
        self.named |= suspects
        return sorted(suspects)


class Stage(enum.Enum):
    ADVERTISE = "training and advertising keys"
    SHARE = "sharing keys"
    MASKED = "sending masked inputs"
    CONSISTENCY = "signing the survivor list"
    UNMASK = "unmasking"


EXPECTS = {
    Stage.ADVERTISE: wire.SECAGG_ADVERT,
    Stage.SHARE: wire.SECAGG_SHARES_OUT,
    Stage.MASKED: wire.SECAGG_MASKED,
    Stage.CONSISTENCY: wire.SECAGG_SIGNED,
    Stage.UNMASK: wire.SECAGG_UNMASKING,
}


def protocol_weights(silos: List[int], counts: Optional[Dict[int, int]]) -> Dict[int, float]:
    """Each silo's weight as the protocol fixes it, which the server sends and each silo checks:
    equal, or its announced training samples over the round's silos' total."""
    if counts is None:
        return {s: 1.0 / len(silos) for s in silos}
    total = sum(int(counts[s]) for s in silos)
    return {s: int(counts[s]) / total for s in silos}


def advert_problem(
    advert: Advert, run_id: str, round_idx: int, ca: bytes, digest: bytes, roster: Optional[KeyRoster] = None
) -> Optional[str]:
    """Why the server must not relay ``advert`` (None: it may): a certificate that is not the run
    CA's for that rank or not the key the run's roster pins for it, a signature its certificate's
    key did not make, or terms other than those the server sent. Checked before relaying, so that
    one lying silo costs its own seat only, not the honest silos' (each of them would otherwise
    refuse the round it relays)."""
    problem = certificate_rank_problem(advert.certificate, ca, advert.rank) or (
        None if roster is None else roster.problem(advert.rank, advert.certificate)
    )
    if problem is not None:
        return f"its advertisement's certificate: {problem}"
    if not verify(advert.certificate, advert.payload(run_id, round_idx), advert.signature):
        return "its advertisement is not signed by its certificate's key"
    if advert.terms_digest != digest:
        return "its advertisement signs other terms (model, silos, weights' basis) than those the server sent it"
    return None


class SecureRound:
    """Round ``round_idx`` of run ``run_id`` over ``silos`` (those sent its model), each with its
    weight (adding up to 1; from the silos' announced sample ``counts`` where the run weights by
    samples, else equal), ``threshold`` of them needed to the end, inputs of ``length`` words with
    ``bits`` fraction bits, clipped to ``bound``."""

    def __init__(
        self,
        round_idx: int,
        silos: List[int],
        counts: Optional[Dict[int, int]],
        threshold: int,
        length: int,
        bits: int,
        bound: float,
        run_id: str = "",
        check_advert: Optional[Callable[[Advert], Optional[str]]] = None,
        min_summed: int = 0,
    ) -> None:
        self.round_idx, self.counts, self.threshold = round_idx, counts, threshold
        # the silos a stage needs to go on: the threshold, and the fewest an honest silo lets its input be
        # summed with (it would refuse a shorter survivor list: the round fails here, naming who is lost)
        self.need = max(threshold, min_summed)
        self.weights = protocol_weights(silos, counts)
        self.bits, self.bound, self.length = bits, bound, length
        self.server = ServerRound(round_idx, list(silos), threshold, length, run_id=run_id)
        self.stage = Stage.ADVERTISE
        self.stage_silos: List[int] = list(silos)
        self.awaiting: Set[int] = set(silos)
        self.bytes: Dict[int, int] = {s: 0 for s in silos}
        self.lost: Dict[int, str] = {}  # silo -> the stage it was lost in
        self.false_shares: Dict[int, str] = {}  # silo -> what false share it sent (found while unmasking)
        self.proven: List[int] = []  # silos the message being taken proved to have sent shares that do not decrypt
        self.check_advert = check_advert  # why an advertisement must not be relayed (None: no checks here)

    def terms(self, silo: int) -> Dict[str, Any]:
        """What ``silo`` needs with the round's model (:data:`wire.SECAGG`): the same for every
        silo of the round but its own weight, which each silo recomputes from the rest."""
        return {
            "threshold": self.threshold,
            "bits": self.bits,
            "weight": self.weights[silo],
            "bound": self.bound,
            "length": self.length,
            "silos": list(self.server.sampled),
            "counts": None if self.counts is None else [[s, int(self.counts[s])] for s in self.server.sampled],
        }

    def take(self, silo: int, kind: int, params: Dict[str, Any], model: Any, size: int) -> List[Tuple[int, str]]:
        """Take ``silo``'s message of ``kind``: the silos it puts out of the round, each with why
        (``silo`` itself where it is refused; the senders a masked input's accusations prove false)."""
        if kind != EXPECTS[self.stage]:
            problem = f"a message of type {kind} while the round is {self.stage.value}"
        else:
            try:
                self._take(silo, kind, params, model)
                problem = None
            except (SecAggError, ValueError, KeyError, TypeError) as err:
                problem = str(err)
        self.awaiting.discard(silo)
        self.bytes[silo] = self.bytes.get(silo, 0) + int(size)
        out = [(liar, self.server.liars[liar]) for liar in self.proven]
        self.proven = []
        if problem is not None:
            self.lost[silo] = self.stage.name.lower()
            out.insert(0, (silo, f"{problem}; it is out of the round"))
        return [(s, f"round {self.round_idx}: silo rank {s}'s secure aggregation: {why}") for s, why in out]

    def _take(self, silo: int, kind: int, params: Dict[str, Any], model: Any) -> None:
        server = self.server
        if kind == wire.SECAGG_ADVERT:
            advert = advert_from_wire(silo, params["advert"])
            problem = self.check_advert(advert) if self.check_advert is not None else None
            if problem is not None:
                raise SecAggError(problem)
            server.take_advert(silo, advert)
        elif kind == wire.SECAGG_SHARES_OUT:
            server.take_shares(silo, signed_shares_from_wire(params["shares"]))
        elif kind == wire.SECAGG_MASKED:
            tensor = (model or {}).get(wire.MASKED_KEY)
            if tensor is None or len(model) != 1 or str(tensor.dtype) != "torch.int32":
                raise SecAggError(f"a masked input must be one int32 tensor named {wire.MASKED_KEY!r}")
            accusations = {int(r): from_base64(k) for r, k in params.get("accusations", [])}
            for liar in server.take_masked(silo, tensor.numpy().reshape(-1).view(np.uint32), accusations):
                self.proven.append(liar)
                self.awaiting.discard(liar)
                self.lost[liar] = self.stage.name.lower()
        elif kind == wire.SECAGG_SIGNED:
            server.take_signature(silo, from_base64(params["signature"]))
        else:
            shares = {int(o): (k, (int(i), from_base64(b))) for o, k, i, b in params["shares"]}  # k: seed, key or pair
            server.take_unmasking(silo, shares)

    def drop(self, silos: List[int], why: str) -> None:
        """``silos`` left the run: they are awaited no more."""
        for silo in silos:
            if silo in self.awaiting:
                self.awaiting.discard(silo)
                self.lost[silo] = self.stage.name.lower()

    def answered(self) -> List[int]:
        return [s for s in self.stage_silos if s not in self.awaiting and s not in self.lost]

    def advance(self, outbox: Outbox, deadline: float) -> Optional[np.ndarray]:
        """The next stage (its messages to the outbox), or the unmasked sum after the last;
        :class:`RoundFailed` when fewer than the threshold are left."""
        server, round_idx = self.server, self.round_idx
        if self.stage is Stage.ADVERTISE:
            self._enough(server.u1())
            adverts = [[r, advert_to_wire(server.adverts[r])] for r in server.u1()]
            self._next(Stage.SHARE, server.u1())
            outbox.send(
                [ToSilo(wire.SECAGG_KEYS, s, round_idx, params={"adverts": adverts}) for s in server.u1()],
                deadline,
                ROUND,
            )
        elif self.stage is Stage.SHARE:
            self._enough(server.u2())
            self._next(Stage.MASKED, server.u2())
            messages = [
                ToSilo(
                    wire.SECAGG_SHARES,
                    s,
                    round_idx,
                    params={"shares": signed_shares_to_wire(server.shares_for(s))},
                )
                for s in server.u2()
            ]
            outbox.send(messages, deadline, ROUND)
        elif self.stage is Stage.MASKED:
            survivors = server.close_masked()
            self._enough(survivors)
            if server.needs_consistency():  # mask-key shares will be revealed: the list is signed first
                stage, kind, params = Stage.CONSISTENCY, wire.SECAGG_SURVIVORS, {"survivors": survivors}
            else:  # every silo that shared is summed: seed shares only, no list to sign
                stage, kind, params = Stage.UNMASK, wire.SECAGG_UNMASK, self._unmask_params([])
            self._next(stage, survivors)
            outbox.send([ToSilo(kind, s, round_idx, params=params) for s in survivors], deadline, ROUND)
        elif self.stage is Stage.CONSISTENCY:
            signers = server.close_signatures()
            self._next(Stage.UNMASK, signers)
            signed = [[r, to_base64(server.signatures[r])] for r in signers]
            params = self._unmask_params(signed)
            outbox.send([ToSilo(wire.SECAGG_UNMASK, s, round_idx, params=params) for s in signers], deadline, ROUND)
            return None
        else:
            total = server.total()
            self.false_shares.update(server.false_shares)
            return total
        return None

    def _unmask_params(self, signed: List[Any]) -> Dict[str, Any]:
        params: Dict[str, Any] = {"survivors": self.server.survivors, "signatures": signed}
        if self.server.liars:  # each survivor reveals its pair mask with them (secagg/rounds.py)
            params["liars"] = sorted(self.server.liars)
        return params

    def _enough(self, silos: List[int]) -> None:
        if len(silos) < self.need:
            raise RoundFailed(
                f"round {self.round_idx}: {len(silos)} silo(s) {silos} finished {self.stage.value}, fewer than the "
                f"{self.need} a secure round needs (secagg_args.reconstruction_threshold={self.threshold}, "
                f"min_summed_silos); lost: {self.lost or 'none'}"
            )

    def _next(self, stage: Stage, silos: List[int]) -> None:
        self.stage, self.stage_silos, self.awaiting = stage, list(silos), set(silos)

    def average(self, total: np.ndarray) -> np.ndarray:
        """The weighted average of the summed silos' deltas; :class:`RoundFailed` when its norm is
        over the bound. Each honest input is clipped to the bound and the weights make the average a
        convex combination, so only a silo that did not clip (it sent words of its own) can push it
        over: the server cannot see which, so the round is dropped rather than averaged."""
        weight = sum(self.weights[s] for s in self.server.survivors)
        average = fixed_point.decode(total, self.bits, weight)
        slack = fixed_point.worst_error(self.bits, len(self.server.survivors), weight) * np.sqrt(len(average))
        norm = float(np.linalg.norm(average))
        if norm > self.bound + slack:
            raise OverBound(
                f"round {self.round_idx}: the securely summed average has norm {norm:.4g}, over the bound "
                f"{self.bound:.4g} every silo clips to: a silo of {self.server.survivors} sent an unclipped "
                f"update; the round is dropped"
            )
        return average

    def record(self, failed: Optional[str]) -> Dict[str, Any]:
        """The round as summary.json's ``secure_aggregation`` keeps it."""
        summed = list(self.server.survivors) if failed is None else []
        return {
            "round": self.round_idx,
            "sampled": list(self.server.sampled),
            "summed": summed,
            "dropped": {str(s): stage for s, stage in sorted(self.lost.items())},
            "recovered": [s for s in self.server.u2() if s not in self.server.masked] if failed is None else [],
            "threshold": self.threshold,
            "false_shares": {str(s): why for s, why in sorted(self.false_shares.items())},
            "false_ciphertexts": {str(s): why for s, why in sorted(self.server.liars.items())},
            "fraction_bits": self.bits,
            "bound": self.bound,  # each silo's input clipped to it: how far one silo can move the model
            "bytes_per_silo": {str(s): b for s, b in sorted(self.bytes.items())},
            "failed": failed,
        }


class OpenRounds(Protocol):
    """What :class:`SecureAggregation` uses of the rounds that run it (``rounds.SiloRounds``)."""

    round_idx: int
    round: OpenRound
    roster: SiloRoster
    model: Any  # rounds.GlobalModel, whose module imports this one
    clock: PhaseClock
    members: SiloMembership
    outbox: Outbox
    unclipped: "UnclippedInputs"
    averaged_from: List[int]  # the silos whose updates the last round's new model was given

    def give_up_on(self, silos: List[int], why: str, go_on: bool) -> None: ...

    def ignore(self, now: float, what: str, silo: int, stamped: Any, note: str = "") -> bool: ...

    def close_if_complete(self, now: float) -> bool: ...

    def round_closed(self, now: float, round_idx: int, params: Any) -> bool: ...


class SecureAggregation:
    """A round of :class:`~.rounds.SiloRounds` aggregated securely: :class:`SecureRound`'s stages
    driven by the round's events and deadlines, the sum through the algorithm (the global model's
    owner), the round's end through ``rounds.round_closed``."""

    def __init__(self, rounds: OpenRounds, secure: SecureRound) -> None:
        self.rounds, self.secure, self.closed = rounds, secure, False

    @classmethod
    def open(cls, rounds: OpenRounds) -> "SecureAggregation":
        """The open round's secure aggregation: the protocol's weights over the silos sent its model
        (equal, or by the counts they announced), fraction bits that the sum of inputs within the
        update bound cannot wrap."""
        setup, silos, round_idx = rounds.roster.setup, sorted(rounds.round.assigned), rounds.round_idx
        counts = None
        if setup.sample_weighted:
            counts = {s: rounds.roster.counts_of(s, rounds.round.assigned[s][1])[0] for s in silos}
        bound = rounds.model.update_bound()
        bits = fixed_point.fraction_bits(bound)
        if bits < fixed_point.MIN_FRACTION_BITS:
            raise SecAggError(
                f"round {round_idx}: the update bound {bound:.4g} (train_args.max_update_ratio x max(||w||, 1), "
                f"or max_update_norm) leaves {bits} fraction bits in 32-bit fixed point, fewer than "
                f"{fixed_point.MIN_FRACTION_BITS}; lower train_args.max_update_ratio or set max_update_norm"
            )
        assert setup.secure_threshold is not None  # (opened for secure runs alone)
        threshold = int(setup.secure_threshold)
        length = rounds.model.vector_length()
        secure = SecureRound(
            round_idx, silos, counts, threshold, length, bits, bound, setup.run_id, min_summed=setup.min_summed
        )
        if setup.ca is not None:  # each advertisement checked as its receivers will check it, before relaying
            digest = terms_digest(secure.terms(silos[0]), rounds.model.params()) if silos else b""
            ca, run_id, roster = setup.ca, setup.run_id, setup.roster
            secure.check_advert = lambda advert: advert_problem(advert, run_id, round_idx, ca, digest, roster)
        return cls(rounds, secure)

    def terms(self, silo: int) -> Optional[Dict[str, Any]]:
        return {wire.SECAGG: self.secure.terms(silo)}

    def on_update(
        self, now: float, silo: int, stamped: Any, declared: Any, model: Any, counts: Any, training: Any = None
    ) -> bool:
        r = self.rounds
        if r.clock.phase is Phase.TRAINING and not self.closed:
            why = f"round {r.round_idx}: silo rank {silo} sent its update in the clear; this run aggregates securely"
            r.outbox.refuse(silo, REFUSED_SECAGG, why)
            return False
        return r.ignore(now, "an update", silo, stamped)

    def on_secagg(self, now: float, silo: int, kind: int, stamped: Any, params: Any, model: Any, size: int) -> bool:
        r, secure = self.rounds, self.secure
        if r.clock.phase is not Phase.TRAINING or self.closed or stamped != r.round_idx or silo not in secure.awaiting:
            return r.ignore(now, f"a secure-aggregation message (type {kind})", silo, stamped)
        for out, why in secure.take(silo, kind, params, model, size):  # one bad silo fails only itself, named
            r.outbox.refuse(out, REFUSED_SECAGG, why)
            r.give_up_on([out], why, self.go_on([out]))
        return r.close_if_complete(now)

    def short_at_start(self) -> Optional[str]:
        """Why the open round cannot be summed before it starts (None: it can): fewer silos can take
        part than it needs (lost ones with no silo left in the keyed order to take their places)."""
        r, silos = self.rounds, sorted(self.rounds.round.assigned)
        if len(silos) >= self.secure.need:
            return None
        missing = [s for s in r.round.expected if s not in silos]
        return (
            f"round {r.round_idx}: {len(silos)} silo(s) {silos} can take part, fewer than the {self.secure.need} a "
            f"secure round needs; silo rank(s) {missing} are lost and no silo of the round's keyed order within "
            f"secagg_args.reserve_silos={r.roster.setup.reserve_silos} is left to take their places"
        )

    def go_on(self, leaving: Sequence[int]) -> bool:
        """Whether the run goes on once ``leaving`` are given up on: a secure round short of silos
        fails by itself (the global model is kept) and later rounds fill lost places from the keyed
        order (secagg_args.reserve_silos), so the run stops only when fewer silos than
        comm_args.min_clients_per_round (by default what a round needs) are left in it."""
        r = self.rounds
        left = [s for s in r.roster.live if s not in set(leaving)]
        return len(left) >= r.members.policy.min_clients

    def drop(self, silos: Sequence[int], why: str) -> None:
        self.secure.drop(list(silos), why)

    def ready(self) -> bool:
        return not self.closed and not self.secure.awaiting

    def advance(self, now: float) -> bool:
        """Every silo of the stage answered (or the rest were given up on): the next stage, or the
        round's end with the unmasked sum; fewer than the threshold left end it without one."""
        r = self.rounds
        try:
            total = self.secure.advance(r.outbox, now + r.clock.round_seconds())
        except RoundFailed as err:
            logger.error("%s; the global model is kept", err)
            return self.close(now, None, str(err))
        if total is None:
            r.clock.deadline = now + r.clock.round_seconds()
            return r.close_if_complete(now)
        for silo, why in sorted(self.secure.false_shares.items()):  # the round was rebuilt without them
            problem = f"round {r.round_idx}: silo rank {silo}'s secure aggregation: {why}"
            r.outbox.refuse(silo, REFUSED_SECAGG, problem)
            r.give_up_on([silo], problem, True)
        return self.close(now, total, None)

    def deadline(self, now: float, why: str) -> bool:
        """The stage's deadline passed: the silos it still awaits are given up on."""
        r, secure = self.rounds, self.secure
        missing = sorted(secure.awaiting)
        r.give_up_on(missing, f"{why} ({secure.stage.value})", self.go_on(missing))
        secure.drop(missing, why)
        return self.advance(now)

    def close(self, now: float, total: Any, failed: Optional[str]) -> bool:
        """The round's end: the new global model from the sum (or the kept one), recorded."""
        r, secure, round_idx = self.rounds, self.secure, self.rounds.round_idx
        r.clock.disarm()
        self.closed = True
        if total is not None and not secure.lost and set(secure.server.survivors) >= set(r.round.expected):
            r.clock.measure_round(now)
        average = None
        if total is not None:
            try:
                average = secure.average(total)
            except RoundFailed as err:
                logger.error("%s; the global model is kept", err)
                failed = str(err)
            self.found_out(now, list(secure.server.survivors), average is None)
        params = r.model.keep(round_idx) if average is None else r.model.secure_average(round_idx, average)
        r.averaged_from = sorted(secure.server.survivors) if average is not None else []
        r.outbox.record("record_secure_round", round_idx, secure.record(failed))
        return r.round_closed(now, round_idx, params)

    def found_out(self, now: float, summed: List[int], over_bound: bool) -> None:
        """Refuse the silo that the rounds over the bound single out (:class:`UnclippedInputs`):
        one silo that keeps sending unclipped inputs stops failing everyone's rounds."""
        r = self.rounds
        for silo in r.unclipped.note(summed, over_bound):
            problem = (
                f"round {r.round_idx}: silo rank {silo} was summed in every one of the last rounds whose secure "
                f"average broke the update bound ({len(r.unclipped.failed)}), and in no round that kept to it: "
                f"it sends inputs it does not clip"
            )
            r.members.refuse(now, r.round_idx, silo, problem, True)
