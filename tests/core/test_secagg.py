"""Secure aggregation's rounds, each party a pure object: exact sums, dropouts, and what the
server cannot read (no process, no port)."""

import os

import numpy as np
import pytest

from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.secagg import fixed_point
from fedml_perfedavg.secagg.primitives import (
    SHARE_LABEL,
    SecAggError,
    agree,
    combine_secret,
    decrypt,
    pair_context,
    shares_payload,
    sign,
    split_secret,
    usable_public_key,
)
from fedml_perfedavg.secagg.rounds import (
    KEY,
    PAIR,
    SEED,
    Advert,
    RoundFailed,
    ServerRound,
    SiloRound,
    SiloRules,
    commitment,
    default_threshold,
)

RUN = "run-1"
LENGTH = 4000


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    make_certificates(str(folder), 6)

    def read(name):
        with open(os.path.join(folder, name), "rb") as stream:
            return stream.read()

    return {rank: (read(f"rank-{rank}.pem"), read(f"rank-{rank}.key")) for rank in range(7)}


def silos(certificates, ranks, threshold, round_idx=3, digest=bytes(32)):
    return {
        r: SiloRound(
            RUN,
            round_idx,
            r,
            threshold,
            lambda data, k=certificates[r][1]: sign(k, data),
            certificates[r][0],
            digest,
            peers=tuple(ranks),
        )
        for r in ranks
    }


def server_round(ranks, threshold):
    return ServerRound(3, list(ranks), threshold, LENGTH, run_id=RUN)


def sign_survivors(server, parties, survivors):
    """The consistency stage: each survivor signs the list, the server checks and collects."""
    for r in survivors:
        server.take_signature(r, parties[r].sign_survivors(survivors))
    return server.close_signatures()


def trusting(advert):
    return None  # the certificate check of the cross-silo layer (CA, rank name) is tested there


def updates(ranks, bound=0.5, seed=0):
    generator = np.random.default_rng(seed)
    return {r: fixed_point.clip(generator.normal(0, 0.05, LENGTH), bound) for r in ranks}


def run_round(parties, threshold, inputs, bits, drop_before_masked=(), drop_before_unmask=(), server=None):
    """Every stage as the cross-silo protocol runs it; returns (server, the decoded average)."""
    ranks = sorted(parties)
    server = server or server_round(ranks, threshold)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    adverts = {r: server.adverts[r] for r in server.u1()}
    for r in ranks:
        server.take_shares(r, parties[r].share(adverts, trusting))
    weight = 1.0 / len(ranks)
    for r in server.u2():
        if r not in drop_before_masked:
            encoded = fixed_point.encode(inputs[r], weight, bits)
            server.take_masked(r, parties[r].masked_input(encoded, server.shares_for(r)))
    survivors = server.close_masked()
    sign_survivors(server, parties, survivors)
    for r in survivors:
        if r not in drop_before_unmask:
            server.take_unmasking(r, parties[r].unmask(survivors, server.signatures))
    total = server.total()
    return server, fixed_point.decode(total, bits, weight * len(survivors))


def test_the_unmasked_sum_is_the_plaintext_average_within_the_stated_error(certificates):
    ranks = [1, 2, 3, 4, 5]
    inputs = updates(ranks)
    bits = fixed_point.fraction_bits(0.5)
    server, average = run_round(silos(certificates, ranks, 3), 3, inputs, bits)
    plain = np.mean([inputs[r] for r in ranks], axis=0)
    assert np.max(np.abs(average - plain)) <= fixed_point.worst_error(bits, 5) < 1e-7
    assert server.dropped() == []


def test_exact_modular_sum_of_the_encoded_inputs(certificates):
    ranks = [1, 2, 3]
    inputs = updates(ranks, seed=1)
    parties = silos(certificates, ranks, 2)
    server = server_round(ranks, 2)
    run_round(parties, 2, inputs, 24, server=server)
    expected = sum(fixed_point.encode(inputs[r], 1 / 3, 24).astype(np.uint64) for r in ranks) % 2**32
    assert np.array_equal(server.total().astype(np.uint64), expected)


@pytest.mark.parametrize("stage", ["before-masked", "before-unmask"])
def test_a_silo_lost_after_sharing_is_recovered_and_only_the_survivors_are_summed(certificates, stage):
    ranks = [1, 2, 3, 4, 5]
    inputs = updates(ranks, seed=2)
    parties = silos(certificates, ranks, 3)
    lost = {"before-masked": {"drop_before_masked": (4,)}, "before-unmask": {"drop_before_unmask": (4, 5)}}[stage]
    server, average = run_round(parties, 3, inputs, 24, **lost)
    summed = [r for r in ranks if r not in lost.get("drop_before_masked", ())]
    plain = np.mean([inputs[r] for r in summed], axis=0)
    assert np.max(np.abs(average - plain)) <= fixed_point.worst_error(24, 5, len(summed) / 5)
    assert server.survivors == summed


def test_fewer_than_the_threshold_ends_the_round_without_a_model(certificates):
    ranks = [1, 2, 3, 4, 5]
    parties = silos(certificates, ranks, 3)
    with pytest.raises(RoundFailed, match="fewer than secagg_args.reconstruction_threshold=3"):
        run_round(parties, 3, updates(ranks), 24, drop_before_masked=(3, 4, 5))
    parties = silos(certificates, ranks, 3)
    with pytest.raises(RoundFailed, match="unmasking shares from \\[1, 2\\]"):
        run_round(parties, 3, updates(ranks), 24, drop_before_unmask=(3, 4, 5))


def test_a_masked_input_as_the_server_receives_it_is_uncorrelated_with_the_update(certificates):
    ranks = [1, 2, 3]
    parties = silos(certificates, ranks, 2)
    server = server_round(ranks, 2)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    adverts = dict(server.adverts)
    for r in ranks:
        server.take_shares(r, parties[r].share(adverts, trusting))
    # Long enough that each bound below is about 10 standard deviations of what uniform words give
    # (at 4,000 words they were 3.2 and 3.7: one run in a few hundred failed by chance).
    length = 40 * LENGTH
    update = np.linspace(-0.5, 0.5, length)  # as structured as an update can be
    encoded = fixed_point.encode(update, 1 / 3, 24)
    received = parties[1].masked_input(encoded, server.shares_for(1))
    as_signed = received.astype(np.int64) - 2**31
    assert abs(np.corrcoef(as_signed, update)[0, 1]) < 0.05
    assert abs(np.corrcoef(as_signed, encoded.astype(np.int64))[0, 1]) < 0.05
    # Its words are spread over the whole range, as uniform ones are (each quarter within 10%).
    quarters = np.bincount((received >> np.uint32(30)).astype(np.int64), minlength=4) / length
    assert np.all(np.abs(quarters - 0.25) < 0.025)


def test_fewer_than_the_threshold_of_shares_reveal_nothing_the_server_can_use(certificates):
    secret = os.urandom(32)
    shares = split_secret(secret, 3, 5)
    assert combine_secret(shares[:3]) == secret and combine_secret(shares[2:]) == secret
    assert combine_secret(shares[:2]) != secret
    # Any secret is as consistent with two shares as the true one: a third share can be chosen
    # that makes them rebuild it (shares are points of a random polynomial).
    other = os.urandom(32)
    forged = split_secret(other, 2, 2)
    assert combine_secret(forged) == other
    # A server with the unmasking answers of fewer than t silos has no sum and no seed.
    ranks = [1, 2, 3, 4, 5]
    parties = silos(certificates, ranks, 3)
    with pytest.raises(RoundFailed):
        run_round(parties, 3, updates(ranks), 24, drop_before_unmask=(3, 4, 5))
    seed_shares = [parties[r].received[1][0] for r in (1, 2)]
    assert commitment(combine_secret(seed_shares)) != commitment(parties[1].seed)


def test_a_silo_reveals_one_secret_of_each_silo_once(certificates):
    ranks = [1, 2, 3]
    parties = silos(certificates, ranks, 2)
    server = server_round(ranks, 2)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    for r in ranks:
        server.take_shares(r, parties[r].share(dict(server.adverts), trusting))
    for r in ranks:
        parties[r].masked_input(np.zeros(LENGTH, np.uint32), server.shares_for(r))
    signatures = {r: parties[r].sign_survivors([1, 2]) for r in (1, 2)}
    answer = parties[1].unmask([1, 2], signatures)
    assert {owner: kind for owner, (kind, _) in answer.items()} == {1: SEED, 2: SEED, 3: KEY}
    with pytest.raises(SecAggError, match="unmask twice"):
        parties[1].unmask([1, 2, 3], signatures)  # the server asking again, claiming 3 survived, gets nothing
    with pytest.raises(SecAggError, match=r"asked to sign the survivor list \[1, 2, 3\] after \[1, 2\]"):
        parties[2].sign_survivors([1, 2, 3])


def test_keys_the_server_swapped_are_refused(certificates):
    ranks = [1, 2, 3]
    parties = silos(certificates, ranks, 2)
    adverts = {r: parties[r].advertise() for r in ranks}
    impostor = SiloRound(RUN, 3, 2, 2, lambda data: sign(certificates[0][1], data), certificates[2][0], peers=ranks)
    fake = impostor.advertise()  # the server's own keys, in rank 2's name, over rank 2's certificate
    with pytest.raises(SecAggError, match="rank 2's keys are not signed by its certificate's key"):
        parties[1].share({**adverts, 2: fake}, trusting)
    other_round = silos(certificates, ranks, 2, round_idx=4)[2].advertise()
    with pytest.raises(SecAggError, match="not signed"):
        parties[3].share(
            {**adverts, 2: Advert(2, *[getattr(other_round, f) for f in Advert.__dataclass_fields__][1:])}, trusting
        )


def test_a_changed_share_is_refused_and_a_false_share_does_not_rebuild_a_wrong_secret(certificates):
    ranks = [1, 2, 3, 4]
    parties = silos(certificates, ranks, 2)
    server = server_round(ranks, 2)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    for r in ranks:
        server.take_shares(r, parties[r].share(dict(server.adverts), trusting))
    tampered = dict(server.shares_for(1))
    ciphertext, signature = tampered[2]
    tampered[2] = (ciphertext[:-1] + bytes([ciphertext[-1] ^ 1]), signature)  # the server (or wire) changed it
    with pytest.raises(SecAggError, match="relayed as rank 2's are not signed by its certificate's key"):
        parties[1].masked_input(np.zeros(LENGTH, np.uint32), tampered)
    assert not parties[1].accused  # nothing disclosed: rank 2 did not sign what came
    inputs = updates(ranks, seed=3)
    for r in ranks:
        server.take_masked(r, parties[r].masked_input(fixed_point.encode(inputs[r], 0.25, 24), server.shares_for(r)))
    survivors = server.close_masked()
    sign_survivors(server, parties, survivors)
    for r in survivors:
        answer = parties[r].unmask(survivors, server.signatures)
        if r == 4:  # a liar: a false share of silo 1's seed
            kind, (index, share) = answer[1]
            answer[1] = (kind, (index, bytes(32)))
        server.take_unmasking(r, answer)
    average = fixed_point.decode(server.total(), 24, 1.0)
    assert np.max(np.abs(average - np.mean([inputs[r] for r in ranks], axis=0))) < 1e-6
    assert server.false_shares == {4: "a false share of rank 1's secret"}  # traced to its sender


def prepared(certificates, ranks, threshold, inputs, bits=24):
    """A round up to its masked inputs, every silo honest so far."""
    parties = silos(certificates, ranks, threshold)
    server = server_round(ranks, threshold)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    for r in ranks:
        server.take_shares(r, parties[r].share(dict(server.adverts), trusting))
    weight = 1.0 / len(ranks)
    for r in ranks:
        encoded = fixed_point.encode(inputs[r], weight, bits)
        server.take_masked(r, parties[r].masked_input(encoded, server.shares_for(r)))
    return parties, server


def test_a_share_under_another_silos_index_puts_its_sender_out_not_the_round(certificates):
    ranks = [1, 2, 3, 4]
    inputs = updates(ranks, seed=5)
    parties, server = prepared(certificates, ranks, 3, inputs)
    survivors = server.close_masked()
    sign_survivors(server, parties, survivors)
    answers = {r: parties[r].unmask(survivors, server.signatures) for r in survivors}
    forged = {owner: (kind, (1, share)) for owner, (kind, (_, share)) in answers[4].items()}  # silo 1's index
    with pytest.raises(SecAggError, match="rank 4 sent a share with Shamir index 1; its own is 4"):
        server.take_unmasking(4, forged)
    for r in (1, 2, 3):
        server.take_unmasking(r, answers[r])
    average = fixed_point.decode(server.total(), 24, 1.0)  # three honest answers: the round is recovered
    assert np.max(np.abs(average - np.mean([inputs[r] for r in ranks], axis=0))) < 1e-6


def test_silos_given_other_terms_or_a_low_order_key_refuse_before_sharing_anything(certificates):
    ranks = [1, 2, 3]
    honest = silos(certificates, ranks, 2, digest=bytes([1]) * 32)
    skewed = silos(certificates, ranks, 2, digest=bytes([2]) * 32)[2]  # the server gave silo 2 other terms
    adverts = {1: honest[1].advertise(), 2: skewed.advertise(), 3: honest[3].advertise()}
    with pytest.raises(SecAggError, match="rank 2 was given other terms for this round than this silo"):
        honest[1].share(adverts, trusting)
    assert not honest[1].received  # nothing shared
    assert not usable_public_key(bytes(32)) and usable_public_key(honest[1].masks.public)
    zero = SiloRound(
        RUN, 3, 2, 2, lambda d: sign(certificates[2][1], d), certificates[2][0], bytes([1]) * 32, peers=ranks
    )
    zero.masks = type(zero.masks)(zero.masks.private, bytes(32))  # a silo advertising the all-zero mask key
    server = server_round(ranks, 2)
    with pytest.raises(SecAggError, match="rank 2 advertised a low-order key"):
        server.take_advert(2, zero.advertise())
    silo_view = {1: adverts[1], 2: zero.advertise(), 3: adverts[3]}  # a server that relays it anyway
    honest[1].share(silo_view, trusting)
    shares = {2: zero.share(silo_view, trusting)[1], 3: honest[3].share(silo_view, trusting)[1]}
    with pytest.raises(SecAggError, match="rank 2 advertised a low-order key"):  # agreeing the pair's mask finds it
        honest[1].masked_input(np.zeros(LENGTH, np.uint32), shares)


def test_two_survivor_lists_cannot_both_gather_the_threshold_of_signatures(certificates):
    """The server tells silos 1, 2, 3 that [1, 2, 3] survived and silo 4 that [1, 2, 4] did (to
    learn silo 4's pairwise masks from the first and its seed from the second): with t = 3 > 4/2,
    only one list gets three signatures, and a silo unmasks only the list it signed."""
    ranks = [1, 2, 3, 4]
    parties, server = prepared(certificates, ranks, 3, updates(ranks, seed=6))
    first, second = [1, 2, 3], [1, 2, 4]
    signatures = {r: parties[r].sign_survivors(first) for r in first}
    signatures_second = {4: parties[4].sign_survivors(second)}
    for r in (1, 2):  # the server asks them to sign the second list too
        with pytest.raises(SecAggError, match="asked to sign the survivor list"):
            parties[r].sign_survivors(second)
    assert set(parties[1].unmask(first, signatures)) == {1, 2, 3, 4}
    with pytest.raises(SecAggError, match=r"1 valid signature\(s\) \[4\] over the survivor list \[1, 2, 4\]"):
        parties[4].unmask(second, {**signatures_second, 1: signatures[1], 2: signatures[2]})


def test_a_silo_refuses_a_threshold_below_its_rule_and_too_few_summed_silos(certificates):
    rules = SiloRules(threshold=2, max_colluding=0, min_summed=3)
    assert "not above half of the round's 4 sampled silos" in rules.problem_with(4, 4)
    assert SiloRules(3).problem_with(4, 4) is None
    assert SiloRules(3, max_colluding=1).problem_with(4, 4) is None
    assert "max_colluding_silos=2" in SiloRules(3, max_colluding=2).problem_with(4, 4)
    assert "min_summed_silos=3" in SiloRules(2).problem_with(2, 2)
    assert [default_threshold(n) for n in (3, 4, 5)] == [2, 3, 3] and default_threshold(4, 1) == 3
    assert default_threshold(4, 2) == 4
    ranks = [1, 2, 3]
    parties = silos(certificates, ranks, 2)
    for party in parties.values():
        party.min_summed = 3
    server = server_round(ranks, 2)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    for r in ranks:
        server.take_shares(r, parties[r].share(dict(server.adverts), trusting))
    parties[1].masked_input(np.zeros(LENGTH, np.uint32), server.shares_for(1))
    with pytest.raises(RoundFailed, match="summed with at least 3 silos"):
        parties[1].sign_survivors([1, 2])  # two survivors: each would learn the other's input


def test_fixed_point_holds_the_extremes_of_the_bound_without_wrapping():
    bound = 7.08
    bits = fixed_point.fraction_bits(bound)
    assert fixed_point.MIN_FRACTION_BITS <= bits <= fixed_point.MAX_FRACTION_BITS
    for sign_ in (1.0, -1.0):
        inputs = [np.full(10, sign_ * bound) for _ in range(10)]
        total = sum(fixed_point.encode(x, 0.1, bits).astype(np.uint64) for x in inputs) % 2**32
        decoded = fixed_point.decode(total.astype(np.uint32), bits, 1.0)
        assert np.allclose(decoded, sign_ * bound, atol=fixed_point.worst_error(bits, 10))
    assert fixed_point.fraction_bits(float("inf")) == -1


def test_a_round_that_sums_every_silo_that_shared_needs_no_signatures_and_reveals_seeds_only(certificates):
    """Where U3 is the whole of U2 a silo reveals only seed shares, from which no mask key can be
    rebuilt: the server skips the consistency stage. A shorter list still needs t signatures, and a
    silo that unmasked the whole list signs no other."""
    ranks = [1, 2, 3, 4]
    inputs = updates(ranks, seed=8)
    parties, server = prepared(certificates, ranks, 3, inputs)
    survivors = server.close_masked()
    assert not server.needs_consistency()
    for r in survivors:
        answer = parties[r].unmask(survivors, {})
        assert {kind for kind, _ in answer.values()} == {SEED}
        server.take_unmasking(r, answer)
    average = fixed_point.decode(server.total(), 24, 1.0)
    assert np.max(np.abs(average - np.mean([inputs[r] for r in ranks], axis=0))) < 1e-6
    with pytest.raises(SecAggError, match="asked to sign the survivor list"):
        parties[1].sign_survivors([1, 2, 3])  # the same round, a shorter list: refused
    others, _ = prepared(certificates, ranks, 3, inputs)
    with pytest.raises(SecAggError, match=r"this silo signed None"):
        others[1].unmask([1, 2, 3], {})  # silo 4 "dropped": its mask key's shares only with t signatures


def shared_round(certificates, ranks, threshold, liar=None, victims=()):
    """A round up to its shares (the server holds them), ``liar``'s to ``victims`` random bytes it
    signed itself; (parties, server)."""
    parties, server = silos(certificates, ranks, threshold), server_round(ranks, threshold)
    for r in ranks:
        server.take_advert(r, parties[r].advertise())
    for r in sorted(parties):
        out = parties[r].share(dict(server.adverts), trusting)
        if r == liar:
            for victim in victims:
                garbage = os.urandom(len(out[victim][0]))
                out[victim] = (garbage, sign(certificates[r][1], shares_payload(RUN, 3, r, victim, garbage)))
        server.take_shares(r, out)
    return parties, server


def test_shares_that_do_not_decrypt_are_proven_by_their_receiver_and_cost_their_sender_only(certificates):
    """Rule 5 of issue 75, as pure objects: silo 4 sends silo 1 signed random bytes for its shares.
    Silo 1 still masks its input and discloses its key for the pair (4, 1) alone; the server decrypts
    with it, names 4, and the round sums 1, 2 and 3 exactly (threshold 3 of 4: silo 1 holds no share
    of 4's, so every survivor reveals its pair mask with 4 instead)."""
    ranks = [1, 2, 3, 4]
    inputs = updates(ranks, seed=9)
    parties, server = shared_round(certificates, ranks, 3, liar=4, victims=[1])
    proven = {}
    for r in (4, 1, 2, 3):  # the liar's own masked input first: it is taken out once proven
        masked = parties[r].masked_input(fixed_point.encode(inputs[r], 0.25, 24), server.shares_for(r))
        proven[r] = server.take_masked(r, masked, dict(parties[r].accused))
    assert set(parties[1].accused) == {4} and proven == {4: [], 1: [4], 2: [], 3: []}
    assert "rank 1 disclosed its key for the pair" in server.liars[4]
    disclosed = parties[1].accused[4]
    other, _ = server.shares[2][1]  # the disclosed key opens the pair (1, 4) only: silo 2's shares stay sealed
    with pytest.raises(SecAggError, match="does not decrypt"):
        decrypt(agree(disclosed, server.adverts[2].cipher_key_for(1), SHARE_LABEL), other, pair_context(RUN, 3, 2, 1))
    survivors = server.close_masked()
    assert survivors == [1, 2, 3] and server.needs_consistency()
    sign_survivors(server, parties, survivors)
    liars = sorted(server.liars)
    for r in survivors:
        answer = parties[r].unmask(survivors, server.signatures, liars)
        assert answer[4][0] == PAIR and {answer[o][0] for o in survivors} == {SEED}
        server.take_unmasking(r, answer)
    expected = sum(fixed_point.encode(inputs[r], 0.25, 24).astype(np.uint64) for r in survivors) % 2**32
    assert np.array_equal(server.total().astype(np.uint64), expected)


def test_a_false_accusation_names_the_accuser_and_a_kept_liar_gets_no_answer(certificates):
    ranks = [1, 2, 3, 4]
    parties, _ = prepared(certificates, ranks, 3, updates(ranks, seed=10))
    honest = parties[1].ciphers[2].private  # another round's key for the pair (2, 1)
    fresh, server = shared_round(certificates, ranks, 3)
    masked = fresh[1].masked_input(np.zeros(LENGTH, np.uint32), server.shares_for(1))
    with pytest.raises(SecAggError, match="rank 1 accuses rank 2 of shares that do not decrypt; they decrypt"):
        server.take_masked(1, masked, {2: fresh[1].ciphers[2].private})
    with pytest.raises(SecAggError, match="not the one it advertised for their pair"):
        server.take_masked(1, masked, {2: honest})  # a key of another round's pair
    assert not server.liars and 1 not in server.masked
    # a server that keeps in the survivors a silo this silo proved false gets no answer from it
    lying, server = shared_round(certificates, ranks, 3, liar=4, victims=[1])
    for r in ranks:
        lying[r].masked_input(np.zeros(LENGTH, np.uint32), server.shares_for(r))
    signatures = {r: lying[r].sign_survivors(ranks) for r in (2, 3, 4)}
    with pytest.raises(SecAggError, match=r"keep rank\(s\) \[4\] whose shares do not decrypt"):
        lying[1].unmask(ranks, signatures)
