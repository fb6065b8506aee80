"""Secure aggregation as states of the server's protocol, with no process or port: the silos are
in-process parties answering the protocol's actions as the real silos do (silo/secure.py)."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from fedml_perfedavg.silo.server.modes import OwnDataRounds
from fedml_perfedavg.net import wire
from fedml_perfedavg.silo.server.agreement import ServerSetup
from fedml_perfedavg.net.credentials import make_certificates
from fedml_perfedavg.silo.server.events import ROUND, Hello, Listening, Record, Refuse, SecAggMessage, Send
from fedml_perfedavg.silo.server.events import Tick, Update
from fedml_perfedavg.silo.server.policy import SiloPolicy
from fedml_perfedavg.silo.server.protocol import SiloServerProtocol
from fedml_perfedavg.silo.server.secure_rounds import advert_to_wire, terms_digest
from fedml_perfedavg.silo.secure import SecureSiloRound
from fedml_perfedavg.secagg import fixed_point
from fedml_perfedavg.secagg.primitives import sign
from fedml_perfedavg.secagg.rounds import SiloRound

from tests.fedml_bridge.test_server_protocol import Plan, hello

LENGTH = 6


class SecureModel:
    """A global model of one vector; the protocol hands it the securely averaged delta."""

    def __init__(self):
        self.state = {"w": torch.zeros(LENGTH, dtype=torch.float64)}
        self.averages, self.kept = [], []

    def params(self):
        return dict(self.state)

    def aggregate(self, round_idx, updates, senders=None):
        raise AssertionError("a secure round never averages updates in the clear")

    def secure_average(self, round_idx, average_delta):
        self.averages.append(average_delta)
        self.state = {"w": self.state["w"] + torch.from_numpy(average_delta)}
        return self.state

    def keep(self, round_idx):
        self.kept.append(round_idx)
        return self.state

    def update_bound(self):
        return 1.0

    def vector_length(self):
        return LENGTH


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    make_certificates(str(folder), 3)
    read = lambda name: open(os.path.join(folder, name), "rb").read()  # noqa: E731
    return {
        "dir": str(folder),
        "ca": read("ca.pem"),
        **{r: (read(f"rank-{r}.pem"), read(f"rank-{r}.key")) for r in (1, 2, 3)},
    }


def minted(tls, rank):
    """What whoever holds ca.key can make: a certificate for ``rank`` on a key of its own (PEMs)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from fedml_perfedavg.net.credentials import _pem_key, _rank_certificate

    ca_key = serialization.load_pem_private_key(open(os.path.join(tls["dir"], "ca.key"), "rb").read(), None)
    ca = x509.load_pem_x509_certificate(tls["ca"])
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = _rank_certificate(rank, key.public_key(), ca_key, ca.subject, now, now + datetime.timedelta(days=1))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def deltas():
    generator = np.random.default_rng(7)
    return {s: fixed_point.clip(generator.normal(0, 0.1, LENGTH), 1.0) for s in (1, 2, 3)}


def start(tls, threshold=2, checked=False, false_digest=(), roster=True, impostors=None):
    """The protocol through round 0's models, and each silo's party. ``checked``: the server checks
    each advertisement against the run CA (and with ``roster`` the run's key roster) and the terms
    it sent (ServerSetup.ca), and the parties sign the terms they were given (``false_digest``:
    those silos sign other terms). ``impostors``: rank -> (certificate, key) a party uses instead of
    the rank's own."""
    from fedml_perfedavg.net.credentials import load_credentials
    from fedml_perfedavg.net.key_roster import read_roster

    setup = ServerSetup(
        mode=OwnDataRounds(),
        silos=[1, 2, 3],
        fingerprint={"train_args.learning_rate": 0.001},
        model=nn.Sequential(nn.Linear(4, 3)),
        secure_threshold=threshold,
        run_id="run-1",
        ca=tls["ca"] if checked else None,
        roster=read_roster(os.path.join(tls["dir"], "roster.json")) if checked and roster else None,
    )
    model = SecureModel()
    p = SiloServerProtocol(setup, SiloPolicy(60.0, 30.0, 1), Plan([0, 1, 2]), model, 1, 3)
    p.handle(Listening(0.0))
    actions = []
    for rank in (1, 2, 3):
        actions += p.handle(Hello(1.0, rank, hello(rank) | {"train": 30, "test": 10}, f"s{rank}"))
    models = [m for a in actions if isinstance(a, Send) and a.purpose == ROUND for m in a.messages]
    parties = {}
    for m in models:
        terms = m.params[wire.SECAGG]
        encoded = fixed_point.encode(deltas()[m.silo], terms["weight"], terms["bits"])
        cert, key = (impostors or {}).get(m.silo, tls[m.silo])
        digest = os.urandom(32) if m.silo in false_digest else terms_digest(terms, model.params())
        party = SiloRound(
            "run-1", 0, m.silo, threshold, lambda data, k=key: sign(k, data), cert, digest, peers=tuple(terms["silos"])
        )
        parties[m.silo] = SecureSiloRound(0, party, encoded, load_credentials(tls["dir"], m.silo))
    return p, model, parties, models


def answer(p, parties, actions, skip=(), now=2.0):
    """Each message of the protocol's sends answered by its silo (those in ``skip`` are gone)."""
    out = []
    for m in [m for a in actions if isinstance(a, Send) for m in a.messages]:
        if m.silo in skip:
            continue
        kind, params, tensors = parties[m.silo].answer(m.kind, m.params)
        out += p.handle(SecAggMessage(now, m.silo, kind, 0, params, tensors, 100))
    return out


def advertise(p, parties, skip=()):
    out = []
    for s, party in parties.items():
        if s not in skip:
            out += p.handle(SecAggMessage(1.5, s, wire.SECAGG_ADVERT, 0, {"advert": advert_to_wire(party.advertise())}))
    return out


def records(actions, method):
    return [a.args for a in actions if isinstance(a, Record) and a.method == method]


def test_every_silo_to_the_end_gives_the_plaintext_average(tls):
    p, model, parties, models = start(tls)
    assert {m.params[wire.SECAGG]["weight"] for m in models} == {1 / 3}
    keys = advertise(p, parties)
    shares = answer(p, parties, keys)
    masked = answer(p, parties, shares)
    assert not [m for a in masked if isinstance(a, Send) for m in a.messages if m.kind == wire.SECAGG_SURVIVORS]
    actions = answer(p, parties, masked)  # every silo that shared is summed: no list to sign, unmasking at once
    ((round_idx, record),) = records(actions, "record_secure_round")
    assert record["summed"] == [1, 2, 3] and record["failed"] is None and record["fraction_bits"] == 30
    plain = np.mean(list(deltas().values()), axis=0)
    assert np.max(np.abs(model.averages[0] - plain)) <= fixed_point.worst_error(30, 3)
    assert records(actions, "round_finished")[0][0] == 0


@pytest.mark.parametrize("lie", ["signature", "terms", "certificate"])
def test_an_advertisement_the_honest_silos_would_refuse_costs_its_sender_alone(tls, lie):
    """Issue 75, rule 5: a silo that advertises a random signature, signs other terms than it was
    sent, or shows another rank's certificate made the honest silos decline the round it was
    relayed in (each checks every advertisement), the server dropped them and the run stopped at
    round 0, the liar named nowhere. The server now checks each advertisement as its receivers
    will, before relaying: the liar alone is out of the round, named, and the round ends as usual."""
    import dataclasses

    p, model, parties, _ = start(tls, checked=True, false_digest=(3,) if lie == "terms" else ())
    out = []
    for s, party in parties.items():
        advert = party.advertise()
        if s == 3 and lie == "signature":
            advert = dataclasses.replace(advert, signature=os.urandom(len(advert.signature)))
        if s == 3 and lie == "certificate":
            advert = dataclasses.replace(advert, certificate=tls[1][0])
        out += p.handle(SecAggMessage(1.5, s, wire.SECAGG_ADVERT, 0, {"advert": advert_to_wire(advert)}))
    ((_, lost, why),) = records(out, "record_lost_silos")
    assert lost == [3], out
    expected = {
        "signature": "its advertisement is not signed by its certificate's key",
        "terms": "signs other terms (model, silos, weights' basis) than those the server sent it",
        "certificate": "its advertisement's certificate",
    }[lie]
    assert expected in why
    (keys,) = [a for a in out if isinstance(a, Send) and a.messages[0].kind == wire.SECAGG_KEYS]
    assert [m.silo for m in keys.messages] == [1, 2] and all(r != 3 for r, _ in keys.messages[0].params["adverts"])
    actions = answer(p, parties, answer(p, parties, answer(p, parties, out)))
    ((_, record),) = records(actions, "record_secure_round")
    assert record["summed"] == [1, 2] and record["failed"] is None
    plain = np.mean([deltas()[1], deltas()[2]], axis=0)  # the survivors' weights, renormalized
    assert np.max(np.abs(model.averages[0] - plain)) <= fixed_point.worst_error(30, 2, 2 / 3)


def test_a_certificate_the_ca_signed_outside_the_roster_joins_no_round(tls):
    """Issue 75, rule 3: whoever holds ca.key (the coordinator, when certs made every key on its
    machine) minted certificates for silo ranks and rebuilt silo 4's update. A key the run's roster
    does not list is now refused by the server before relaying (it costs the impostor's seat), and,
    where the server relays it anyway (it is the CA holder), by every honest silo, naming it."""
    from fedml_perfedavg.secagg.primitives import SecAggError

    impostor = {3: minted(tls, 3)}
    p, model, parties, _ = start(tls, checked=True, impostors=impostor)
    ((_, lost, why),) = records(advertise(p, parties), "record_lost_silos")
    assert lost == [3] and "not rank 3's on the run's key roster" in why and "outside the roster" in why, why

    p, model, parties, _ = start(tls, checked=True, roster=False, impostors=impostor)  # relays it: a lying server
    keys = [a for a in advertise(p, parties) if isinstance(a, Send) and a.messages[0].kind == wire.SECAGG_KEYS]
    (message,) = [m for m in keys[0].messages if m.silo == 1]
    with pytest.raises(SecAggError, match=r"rank 3.*not rank 3's on the run's key roster"):
        parties[1].answer(message.kind, message.params)


def test_honest_advertisements_pass_the_servers_checks(tls):
    p, model, parties, _ = start(tls, checked=True)
    actions = answer(p, parties, answer(p, parties, answer(p, parties, advertise(p, parties))))
    ((_, record),) = records(actions, "record_secure_round")
    assert record["summed"] == [1, 2, 3] and record["failed"] is None and records(actions, "record_lost_silos") == []


def test_a_silo_gone_after_sharing_is_given_up_on_at_the_deadline_and_its_masks_taken_out(tls):
    p, model, parties, _ = start(tls)
    shares = answer(p, parties, advertise(p, parties))  # every silo shared its keys; now silo 3 is gone
    assert answer(p, parties, shares, skip=(3,)) == []  # the stage still awaits silo 3's masked input
    actions = p.handle(Tick(100.0))
    assert records(actions, "record_lost_silos")[0][1] == [3]
    actions = answer(p, parties, answer(p, parties, actions))
    ((_, record),) = records(actions, "record_secure_round")
    assert record["summed"] == [1, 2] and record["recovered"] == [3] and record["dropped"] == {"3": "masked"}
    plain = np.mean([deltas()[1], deltas()[2]], axis=0)
    assert np.max(np.abs(model.averages[0] - plain)) <= fixed_point.worst_error(30, 3, 2 / 3)


def test_fewer_than_the_threshold_keeps_the_global_model_and_says_who_dropped(tls):
    p, model, parties, _ = start(tls, threshold=3)
    advertise(p, parties, skip=(3,))
    actions = p.handle(Tick(100.0))
    ((_, record),) = records(actions, "record_secure_round")
    assert "fewer than the 3 a secure round needs (secagg_args.reconstruction_threshold=3" in record["failed"]
    assert record["summed"] == []
    assert model.kept == [0] and model.averages == []


def test_an_update_in_the_clear_is_refused_in_a_secure_run(tls):
    p, model, parties, _ = start(tls)
    actions = p.handle(Update(2.0, 1, 0, 30, {"w": torch.zeros(LENGTH)}))
    (refused,) = [a for a in actions if isinstance(a, Refuse)]
    assert refused.kind == "secagg" and "in the clear" in refused.text


def test_a_stage_message_out_of_turn_puts_its_silo_out_of_the_round(tls):
    p, model, parties, _ = start(tls)
    actions = p.handle(
        SecAggMessage(1.5, 2, wire.SECAGG_MASKED, 0, {}, {"masked": torch.zeros(LENGTH, dtype=torch.int32)})
    )
    (refused,) = [a for a in actions if isinstance(a, Refuse)]
    assert "while the round is training and advertising keys" in refused.text
    ((_, lost, why),) = records(actions, "record_lost_silos")  # named, with the reason
    assert lost == [2] and "while the round is training and advertising keys" in why
    keys = advertise(p, parties, skip=(2,))  # silos 1 and 3 go on without it
    assert sorted(m.silo for a in keys if isinstance(a, Send) for m in a.messages) == [1, 3]


def test_a_silo_that_does_not_clip_makes_its_round_dropped_not_averaged(tls):
    """The server cannot see one update, but the average of clipped ones is within the bound: one
    over it means a silo sent words of its own (here 5 per coordinate, against a bound of 1)."""
    p, model, parties, models = start(tls)
    terms = models[0].params[wire.SECAGG]
    parties[2].encoded = fixed_point.encode(np.full(LENGTH, 5.0), terms["weight"], terms["bits"])
    actions = advertise(p, parties)
    for _ in range(3):  # shares, masked inputs, unmasking (every silo summed: no list to sign)
        actions = answer(p, parties, actions)
    ((_, record),) = records(actions, "record_secure_round")
    assert "over the bound 1 every silo clips to" in record["failed"] and record["summed"] == []
    assert model.kept == [0] and model.averages == []


def test_the_silo_found_in_every_round_over_the_bound_and_no_good_one_is_named_after_three():
    from fedml_perfedavg.silo.server.secure_rounds import UnclippedInputs

    tracker = UnclippedInputs()
    assert tracker.note([1, 2, 3], True) == [] and tracker.note([2, 3, 4], True) == []
    assert tracker.note([1, 3, 4], False) == []  # silos 1, 3, 4 kept to the bound here
    assert tracker.note([2, 3, 5], True) == [2]  # three rounds over the bound: only silo 2 is in all, and no good one
    assert tracker.note([2, 3, 6], True) == []  # named once
    pair = UnclippedInputs()
    assert [pair.note([2, 6, k], True) for k in (3, 4, 5)] == [[], [], []]  # 2 and 6 always together: nobody
    same = UnclippedInputs()
    assert [same.note([1, 2, 3], True) for _ in range(4)] == [[], [], [], []]  # the same silos every round: nobody


class OrderedPlan(Plan):
    """Every round samples users [0, 1, 2] of the keyed order [0, 1, 2, 3]."""

    def keyed_order(self, round_idx):
        return [0, 1, 2, 3]


@pytest.mark.parametrize("reserves", [1, 0])
def test_a_lost_silos_place_goes_to_the_next_of_the_keyed_order_or_the_short_round_keeps_the_model(reserves):
    """Issue 76, item 2: four organizations, three a round, silo 2 never online. With a reserve, round
    0 goes to silos [1, 3, 4] (silo 4 next in the keyed order); with none, the round cannot be summed
    (2 silos, 3 needed): no model goes out, the global model is kept, and the run goes on."""
    plan = OrderedPlan([0, 1, 2])
    setup = ServerSetup(
        mode=OwnDataRounds(),
        silos=[1, 2, 3, 4],
        fingerprint={"train_args.learning_rate": 0.001},
        model=nn.Sequential(nn.Linear(4, 3)),
        secure_threshold=2,
        run_id="run-1",
        min_summed=3,
        reserve_silos=reserves,
        keyed_order=plan.keyed_order,
    )
    model = SecureModel()
    p = SiloServerProtocol(setup, SiloPolicy(60.0, 30.0, 3), plan, model, 2, 3)
    p.handle(Listening(0.0))
    for rank in (1, 3, 4):
        p.handle(Hello(1.0, rank, hello(1) | {"user": rank - 1, "train": 30, "test": 10}, f"s{rank}"))
    actions = p.handle(Tick(61.0))  # silo 2 did not come online within connect_timeout
    sent = [m for a in actions if isinstance(a, Send) and a.purpose == ROUND for m in a.messages]
    if reserves:
        assert sorted(m.silo for m in sent) == [1, 3, 4] and {m.params[wire.SECAGG]["weight"] for m in sent} == {1 / 3}
        assert all(m.params[wire.SECAGG]["silos"] == [1, 3, 4] for m in sent)
        assert sorted(m.user for m in sent) == [0, 2, 3]
    else:
        assert sent == [] and model.kept == [0]  # the round short: kept, and the run goes on to its evaluation
        [(_, record)] = records(actions, "record_secure_round")
        assert "2 silo(s) [1, 3] can take part, fewer than the 3 a secure round needs" in record["failed"]
        assert "silo rank(s) [2] are lost" in record["failed"] and p.phase.value == "evaluating"


def test_a_silo_whose_signed_shares_do_not_decrypt_is_proven_named_and_the_round_summed_without_it(tls):
    """Issue 75, rule 5's second half: silo 3 sends silo 1 signed random bytes for its shares. Silo
    1 had to decline (the run stopped, the liar named nowhere). Now silo 1 masks its input anyway and
    discloses its key for the pair (3, 1), the server decrypts with it and names silo 3, and the round
    sums silos 1 and 2, each revealing its pair mask with 3 at unmasking."""
    import base64

    from fedml_perfedavg.secagg.primitives import shares_payload

    p, model, parties, _ = start(tls, checked=True)
    keys = advertise(p, parties)
    out = []
    for m in [m for a in keys if isinstance(a, Send) for m in a.messages]:
        kind, params, tensors = parties[m.silo].answer(m.kind, m.params)
        if m.silo == 3:
            garbage = os.urandom(120)
            signature = sign(tls[3][1], shares_payload("run-1", 0, 3, 1, garbage))
            params = {"shares": [[r, v] for r, v in params["shares"] if r != 1]}
            params["shares"].append([1, [base64.b64encode(g).decode() for g in (garbage, signature)]])
        out += p.handle(SecAggMessage(2.0, m.silo, kind, 0, params, tensors, 100))
    masked = answer(p, parties, out)
    assert parties[1].party.accused.keys() == {3}
    ((_, lost, why),) = records(masked, "record_lost_silos")
    assert lost == [3] and "its shares for rank 1 do not decrypt (proven: rank 1 disclosed its key" in why, why
    (refused,) = [a for a in masked if isinstance(a, Refuse)]
    assert refused.silo == 3
    actions = answer(p, parties, answer(p, parties, masked, skip=(3,)))  # the survivors sign [1, 2], then unmask
    ((_, record),) = records(actions, "record_secure_round")
    assert record["summed"] == [1, 2] and record["failed"] is None and list(record["false_ciphertexts"]) == ["3"]
    plain = np.mean([deltas()[1], deltas()[2]], axis=0)
    assert np.max(np.abs(model.averages[0] - plain)) <= fixed_point.worst_error(30, 3, 2 / 3)


def test_the_evaluation_after_a_secure_round_is_a_secure_sum_and_figures_in_the_clear_are_refused(tls):
    """Issue 75, rule 2: a data owner's evaluation counts went to the server one silo at a time (a
    server with crafted models read each silo's test split through them). Under secure aggregation
    the evaluation after a round is a secure sum of each silo's figures: the server records the
    means over the summed users (and the accuracy's spread), no user's own, and refuses figures
    sent in the clear."""
    from types import SimpleNamespace

    from fedml_perfedavg.net.credentials import load_credentials
    from fedml_perfedavg.silo.server.events import Evaluation
    from fedml_perfedavg.secagg import figures
    from fedml_perfedavg.secagg.rounds import SiloRules

    p, model, parties, _ = start(tls, checked=True)
    actions = answer(p, parties, answer(p, parties, answer(p, parties, advertise(p, parties))))
    asked = [m for a in actions if isinstance(a, Send) for m in a.messages if m.kind == wire.EVALUATE]
    assert [m.silo for m in asked] == [1, 2, 3] and all(wire.SECAGG in m.params for m in asked)
    terms = asked[0].params[wire.SECAGG]
    assert (terms["threshold"], terms["length"], terms["counts"]) == (2, len(figures.FIGURES), None)
    counts = {
        s: {"round": 0, "user": s - 1, "correct": c, "correct_before": b, "total": 40, "loss": loss}
        for s, c, b, loss in ((1, 30, 20, 0.5), (2, 36, 10, 0.25), (3, 12, 12, 2.0))
    }
    setup = SimpleNamespace(secure_rules=SiloRules(2, 0, 3), keyed_order=lambda round_idx: [1, 2, 3])
    evaluating = {
        m.silo: SecureSiloRound.start_evaluation(
            m.silo,
            0,
            m.params[wire.SECAGG],
            setup,
            model.params(),
            counts[m.silo],
            SimpleNamespace(credentials=load_credentials(tls["dir"], m.silo), run_id="run-1"),
        )
        for m in asked
    }
    refused = p.handle(Evaluation(3.0, 1, counts[1]))  # figures in the clear: refused, not recorded
    assert [a.text for a in refused if isinstance(a, Refuse)] == [
        "the evaluation after round 0: silo rank 1 sent its figures in the clear; this run sums evaluations securely"
    ]
    out = []
    for s, party in evaluating.items():
        kind, params = party.opening()
        out += p.handle(SecAggMessage(4.0, s, kind, 0, params))
    actions = answer(p, evaluating, answer(p, evaluating, answer(p, evaluating, out, now=5.0), now=5.0), now=5.0)
    ((round_idx, metrics, summed, missing, _, record, _),) = records(actions, "record_secure_evaluation")
    accuracies = np.array([30 / 40, 36 / 40, 12 / 40])
    assert (round_idx, summed, missing, record["summed"], record["evaluation"]) == (0, [0, 1, 2], [], [1, 2, 3], True)
    error = figures.worst_error(3)
    assert abs(metrics["personalized_accuracy"] - accuracies.mean()) <= error
    assert abs(metrics["personalized_accuracy_std"] - accuracies.std()) <= 1e-5
    assert abs(metrics["accuracy_before_adaptation"] - 42 / 120) <= error
    assert abs(metrics["personalized_loss"] - 2.75 / 3) <= error and metrics["evaluated_users"] == 3
    assert not records(actions, "record_federated_evaluation")  # no user's own counts reach the record
