"""A silo that holds a valid certificate and lies, for the tests: ``python lying_silo.py LIE
<fedml-perfedavg arguments>``. It is the plugin's own silo with one thing changed:

- ``huge-once``: its upload in round 1 holds 1e30 everywhere;
- ``false-count``: every upload claims 1000 times its user's training samples;
- ``false-figures``: its evaluations claim user 424242 and every test sample right;
- ``slow:R:S``: it is honest but takes S seconds more to train round R (past the round deadline);
- ``pace:S``: it is honest but each round's training takes at least S seconds (a slower
  organization: the run's rounds take that long at least, whatever the machine's load);
- ``late:PATH``: it is honest but starts listening only a second after the server's log PATH says
  it refused a silo (a silo still starting up when the server stops the run);
- ``vanish:R:STAGE``: it is honest until, in round R, the server has taken its secure-aggregation
  message of STAGE (``shares``: its key shares; ``masked``: its masked input); then it SIGKILLs itself;
- ``fail:R``: it is honest until its training in round R raises an error (a crash in its own code);
- ``shrink``: every upload is 0.001 times the model it received;
- ``boundmax``: every upload steps against its honest update's direction, 0.99 of the fixed bound
  (``max_update_ratio`` = 1 x max(||w||, 1)) away from the model it received;
- ``weight``: it announces, and claims in every upload, 2^31 - 1 training samples;
- ``flood:R``: it is honest until the server's model of round R comes; then it closes its own port
  and sends the server 100 announcements in 10 s, from its own process, before it trains.
- ``zero-key``: under secure aggregation it advertises the all-zero (low-order) mask key;
- ``share-index``: under secure aggregation its unmasking shares carry Shamir index 1 (another
  silo's) instead of its own.
- ``false-signature``: under secure aggregation its advertisement's signature is random bytes;
- ``false-terms``: under secure aggregation its advertisement signs other terms than the server sent;
- ``false-ciphertext``: under secure aggregation its shares for the lowest other rank of each round
  are random bytes, which it signs as it signs its honest shares.
- ``unclipped``: under secure aggregation its input is its update scaled to 6 times the bound it
  should clip to (inside its fixed point's range, so the sum does not wrap).

Run as rank 0, a lie is the server's (its certificate is the run's, its code patched):

- ``server-sample-all``: every silo is sent every round's model, whatever the keyed schedule says;
- ``server-skew-weights``: under secure aggregation, silo 2's weight in the round's terms is 1 and
  every other silo's 1e-300 (so that the sum is silo 2's update).
- ``server-threshold-2``: under secure aggregation, the round's terms and the server's own unmasking
  ask for 2 silos' shares, whatever the config says (two survivor lists of two could then each be
  unmasked, giving one silo's update by subtraction).
- ``server-replay``: once round 1 is summed, it runs round 1 again on the same model without silo
  2 (two sums of one round over two silo lists give silo 2's update by subtraction);
- ``server-other-model``: once round 1 is summed, it sends every silo round 1 again with another
  model (with DP-SGD, training it would reuse the round's noise on a second model).
- ``server-evaluate-more``: with the evaluation after round 0 it also asks every silo to evaluate
  round 0 again on a model moved by 1e-6, rounds 1, 5 and 7, and sends it a model stamped
  round = comm_round (a final model mid-run); it ignores every silo's refusal.
- ``server-ignore-roster``: the coordinator holds ca.key: it takes any certificate the run's CA
  signed, on the wire and in secure-aggregation advertisements, whatever the key roster lists, and
  any silo's roster.

- ``server-evaluate-plain``: under secure aggregation, it asks for each evaluation without the
  secure sum's terms and takes the figures in the clear (as before rule 2 of issue 75).

Lies join with ``+`` (``server-sample-all+server-skew-weights``).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch


def lie(kind: str) -> None:
    from fedml_perfedavg.fedml_bridge.cross_silo import client
    from fedml_perfedavg.fedml_bridge.trainer_aggregator import AlgorithmClientTrainer

    if "+" in kind:
        for one in kind.split("+"):
            lie(one)
    elif kind == "server-sample-all":
        from fedml_perfedavg.algorithms.base import FederatedAlgorithm

        def every_user(self, round_idx):
            return list(range(self.settings.client_num_in_total))

        FederatedAlgorithm.sample_clients = every_user
    elif kind == "server-skew-weights":
        from fedml_perfedavg.silo.server import secure_rounds

        def skewed(silos, counts):
            return {s: 1.0 if s == 2 else 1e-300 for s in silos}

        secure_rounds.protocol_weights = skewed
    elif kind == "server-threshold-2":
        from fedml_perfedavg.silo.server import secure_rounds

        honest_init = secure_rounds.SecureRound.__init__

        def low_threshold(self, round_idx, silos, counts, threshold, *rest, **kwargs):
            honest_init(self, round_idx, silos, counts, 2, *rest, **kwargs)

        secure_rounds.SecureRound.__init__ = low_threshold
    elif kind == "zero-key":
        from fedml_perfedavg.secagg.rounds import KeyPair, SiloRound

        honest_advertise = SiloRound.advertise

        def zero_key(self):
            self.masks = KeyPair(self.masks.private, bytes(32))
            return honest_advertise(self)

        SiloRound.advertise = zero_key
    elif kind in ("false-signature", "false-terms"):
        import dataclasses
        import hashlib

        from fedml_perfedavg.secagg.rounds import SiloRound

        honest_advertise = SiloRound.advertise

        def false_advert(self):
            if kind == "false-signature":  # random bytes where its key's signature should be
                advert = honest_advertise(self)
                return dataclasses.replace(advert, signature=os.urandom(len(advert.signature)))
            own = self.terms_digest  # other terms than the server sent, signed as its own
            self.terms_digest = hashlib.sha256(b"other terms" + own).digest()
            try:
                return honest_advertise(self)
            finally:
                self.terms_digest = own

        SiloRound.advertise = false_advert
    elif kind == "share-index":
        from fedml_perfedavg.secagg.rounds import SiloRound

        honest_unmask = SiloRound.unmask

        def other_index(self, survivors, signatures, liars=()):
            answer = honest_unmask(self, survivors, signatures, liars)
            return {owner: (which, (1, share)) for owner, (which, (_, share)) in answer.items()}

        SiloRound.unmask = other_index
    elif kind == "unclipped":
        import numpy as np

        from fedml_perfedavg.secagg import figures, fixed_point

        honest_clip = fixed_point.clip

        def unclipped(vector, bound):
            if len(vector) == len(figures.FIGURES):  # its evaluation figures stay honest: the lie is its updates
                return honest_clip(vector, bound)
            return vector * (6 * bound / max(float(np.linalg.norm(vector)), 1e-12))

        fixed_point.clip = unclipped
    elif kind in ("server-replay", "server-other-model"):
        from fedml_perfedavg.silo.server import rounds
        from fedml_perfedavg.net import wire

        honest_open, honest_closed = rounds.SiloRounds.open_round, rounds.SiloRounds.round_closed
        kept = {}

        def remembering_open(self, now, message_kind):
            if self.round_idx == 1 and "model" not in kept:
                kept["model"] = {k: v.detach().clone() for k, v in self.model.params().items()}
            return honest_open(self, now, message_kind)

        def replaying_close(self, now, round_idx, params):
            if round_idx != 1 or kept.get("replayed"):
                self.__dict__.pop("sampled", None)
                return honest_closed(self, now, round_idx, params)
            kept["replayed"] = True
            model = kept["model"]
            if kind == "server-other-model":
                model = {k: v + 0.01 if v.is_floating_point() else v for k, v in model.items()}
            else:
                honest_sampled = self.sampled
                self.sampled = lambda r: (
                    rounds.OpenRound(r, *self.roster.assignment([u for u in self.plan.sample_clients(r) if u != 1]))
                    if r == 1
                    else honest_sampled(r)
                )
            self.model.aggregator.set_global_model_params(model)
            return self.open_round(now, wire.SYNC_MODEL)

        rounds.SiloRounds.open_round = remembering_open
        rounds.SiloRounds.round_closed = replaying_close
    elif kind == "server-evaluate-more":
        from fedml_perfedavg.silo.server import protocol, rounds
        from fedml_perfedavg.net import wire
        from fedml_perfedavg.silo.server.events import EVALUATION, ToSilo

        honest_evaluation = rounds.SiloRounds.open_evaluation

        def evaluate_more(self, now, round_idx):
            closed = honest_evaluation(self, now, round_idx)
            if round_idx == 0:
                params = self.model.params()
                moved = {k: v + 1e-6 if v.is_floating_point() else v for k, v in params.items()}
                lies = []
                for silo in self.roster.live:
                    lies.append(ToSilo(wire.EVALUATE, silo, 0, moved, silo - 1))
                    lies += [ToSilo(wire.EVALUATE, silo, r, params, silo - 1) for r in (1, 5, 7)]
                    lies.append(ToSilo(wire.SYNC_MODEL, silo, self.round_num, params, silo - 1))
                self.outbox.send(lies, self.clock.deadline or now, EVALUATION)
            return closed

        rounds.SiloRounds.open_evaluation = evaluate_more
        protocol.silo_declined = lambda rounds_, now, silo, reason: False
    elif kind == "huge-once":
        honest = AlgorithmClientTrainer.get_model_params

        def get_model_params(self):
            state = honest(self)
            if int(self.args.round_idx) == 1:
                return type(state)((k, torch.full_like(v, 1e30)) for k, v in state.items())
            return state

        AlgorithmClientTrainer.get_model_params = get_model_params
    elif kind == "false-count":
        honest_train = client.PluginTrainerDistAdapter.train

        def train(self, round_idx):
            weights, samples = honest_train(self, round_idx)
            return weights, samples * 1000

        client.PluginTrainerDistAdapter.train = train
    elif kind == "false-figures":
        honest_evaluate = client.PluginFedMLTrainer.evaluate

        def evaluate(self, round_idx, **how):
            counts = honest_evaluate(self, round_idx, **how)
            return {**counts, "user": 424242, "correct": counts["total"], "correct_before": counts["total"]}

        client.PluginFedMLTrainer.evaluate = evaluate
    elif kind.startswith("slow:"):
        _, slow_round, seconds = kind.split(":")
        honest_train = client.PluginTrainerDistAdapter.train

        def slow_train(self, round_idx):
            if round_idx == int(slow_round):
                time.sleep(float(seconds))
            return honest_train(self, round_idx)

        client.PluginTrainerDistAdapter.train = slow_train
    elif kind.startswith("pace:"):
        seconds, honest_train = float(kind.split(":")[1]), client.PluginTrainerDistAdapter.train

        def paced_train(self, round_idx):
            started = time.monotonic()
            result = honest_train(self, round_idx)
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
            return result

        client.PluginTrainerDistAdapter.train = paced_train
    elif kind.startswith("late:"):
        from fedml_perfedavg.fedml_bridge.cross_silo import transport

        server_log, listen = Path(kind.split(":", 1)[1]), transport.listen

        def listen_late(*args, **kwargs):
            while not (server_log.exists() and "it is refused" in server_log.read_text()):
                time.sleep(0.05)
            time.sleep(1.0)  # the server's first try to tell this silo has met a closed port
            return listen(*args, **kwargs)

        transport.listen = listen_late
    elif kind.startswith("fail:"):
        failing_round = int(kind.split(":")[1])
        honest_train = client.PluginTrainerDistAdapter.train

        def failing_train(self, round_idx):
            if round_idx == failing_round:
                raise RuntimeError(f"a crash in the silo's own code in round {round_idx}")
            return honest_train(self, round_idx)

        client.PluginTrainerDistAdapter.train = failing_train
    elif kind in ("shrink", "boundmax"):
        honest_train = client.PluginTrainerDistAdapter.train
        honest_update = client.PluginTrainerDistAdapter.update_model

        def remember(self, model_params):
            self.received = {k: v.detach().clone() for k, v in model_params.items()}
            return honest_update(self, model_params)

        def lying_train(self, round_idx):
            weights, samples = honest_train(self, round_idx)
            received = self.received
            if kind == "shrink":
                return type(weights)((k, 0.001 * received[k]) for k in weights), samples
            delta = {k: weights[k].double() - received[k].double() for k in weights}
            norm = float(torch.sqrt(sum((d**2).sum() for d in delta.values())))
            size = float(torch.sqrt(sum((v.double() ** 2).sum() for v in received.values())))
            step = 0.99 * max(size, 1.0) / max(norm, 1e-12)
            return type(weights)(
                (k, (received[k].double() - step * delta[k]).to(weights[k].dtype)) for k in weights
            ), samples

        client.PluginTrainerDistAdapter.update_model = remember
        client.PluginTrainerDistAdapter.train = lying_train
    elif kind == "weight":
        from fedml_perfedavg.silo.server import agreement

        honest_hello, honest_train = agreement.hello, client.PluginTrainerDistAdapter.train
        claimed = 2**31 - 1

        def lying_hello(*args, **kwargs):
            announced = honest_hello(*args, **kwargs)
            return {**announced, "train": claimed} if announced["train"] is not None else announced

        def lying_count(self, round_idx):
            weights, _ = honest_train(self, round_idx)
            return weights, claimed

        agreement.hello = lying_hello
        client.PluginTrainerDistAdapter.train = lying_count
    elif kind.startswith("flood:"):
        flood_round, honest_model = int(kind.split(":")[1]), client.PluginClientMasterManager._on_model

        def flooding(self, msg_params):
            from fedml_perfedavg.fedml_bridge.cross_silo.transport import ROUND_KEY

            if int(msg_params.get(ROUND_KEY)) == flood_round:
                self.com_manager.gate.stop()  # the server's answers meet a closed port
                for _ in range(100):
                    self._announce(time.monotonic() + 5)
                    time.sleep(0.1)
            return honest_model(self, msg_params)

        client.PluginClientMasterManager._on_model = flooding
    elif kind.startswith("vanish:"):
        from fedml_perfedavg.net import wire

        _, vanish_round, stage = kind.split(":")
        last = {"shares": wire.SECAGG_SHARES_OUT, "masked": wire.SECAGG_MASKED}[stage]
        honest_send = client.PluginClientMasterManager._send_secagg

        def send_then_vanish(self, message_kind, params, round_idx, tensors=None):
            honest_send(self, message_kind, params, round_idx, tensors)
            if round_idx == int(vanish_round) and message_kind == last:
                os.kill(os.getpid(), signal.SIGKILL)

        client.PluginClientMasterManager._send_secagg = send_then_vanish
    elif kind == "false-ciphertext":
        from fedml_perfedavg.secagg import rounds
        from fedml_perfedavg.secagg.primitives import shares_payload

        honest_share = rounds.SiloRound.share

        def false_share(self, adverts, check_peer):
            out = honest_share(self, adverts, check_peer)
            victim = min(out)
            garbage = os.urandom(len(out[victim][0]))
            out[victim] = (garbage, self.sign(shares_payload(self.run_id, self.round_idx, self.rank, victim, garbage)))
            return out

        rounds.SiloRound.share = false_share
    elif kind == "server-ignore-roster":
        from fedml_perfedavg.silo.server import agreement, roster
        from fedml_perfedavg.net import key_roster

        key_roster.KeyRoster.problem = lambda self, rank, certificate: None
        honest_disagreement = agreement.disagreement

        def blind(server, silo, rank):
            drop = agreement.ROSTER_DIGEST
            if isinstance(silo, dict):
                silo = {k: v for k, v in silo.items() if k != drop}
            return honest_disagreement({k: v for k, v in server.items() if k != drop}, silo, rank)

        roster.disagreement = blind
    elif kind == "server-evaluate-plain":
        import dataclasses

        from fedml_perfedavg.silo.server import rounds as server_rounds

        honest_open = server_rounds.SiloRounds.open_evaluation

        def in_the_clear(self, now, round_idx):
            setup = self.roster.setup
            self.roster.setup = dataclasses.replace(setup, secure_threshold=None)
            try:
                return honest_open(self, now, round_idx)
            finally:
                self.roster.setup = setup

        server_rounds.SiloRounds.open_evaluation = in_the_clear
    else:
        raise SystemExit(f"lying_silo.py: unknown lie {kind!r}")


if __name__ == "__main__":
    import fedml_perfedavg  # noqa: F401  (installs the plugin, as a user's script would)
    from fedml_perfedavg.command import main  # the command line: the plugin takes the process

    lie(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
