"""A silo that holds a valid certificate and lies, for the tests: ``python lying_silo.py LIE
<fedml-perfedavg arguments>``. It is the plugin's own silo with one thing changed:

- ``huge-once``: its upload in round 1 holds 1e30 everywhere;
- ``false-count``: every upload claims 1000 times its user's training samples;
- ``false-figures``: its evaluations claim user 424242 and every test sample right;
- ``slow:R:S``: it is honest but takes S seconds more to train round R (past the round deadline);
- ``late:PATH``: it is honest but starts listening only a second after the server's log PATH says
  it refused a silo (a silo still starting up when the server stops the run);
- ``vanish:R:STAGE``: it is honest until, in round R, the server has taken its secure-aggregation
  message of STAGE (``shares``: its key shares; ``masked``: its masked input); then it SIGKILLs itself;
- ``fail:R``: it is honest until its training in round R raises an error (a crash in its own code).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch


def lie(kind: str) -> None:
    from fedml_perfedavg.fedml_bridge.cross_silo import client
    from fedml_perfedavg.fedml_bridge.shims import AlgorithmClientTrainer

    if kind == "huge-once":
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
    elif kind.startswith("vanish:"):
        from fedml_perfedavg.fedml_bridge.cross_silo import wire

        _, vanish_round, stage = kind.split(":")
        last = {"shares": wire.SECAGG_SHARES_OUT, "masked": wire.SECAGG_MASKED}[stage]
        honest_send = client.PluginClientMasterManager._send_secagg

        def send_then_vanish(self, message_kind, params, round_idx, tensors=None):
            honest_send(self, message_kind, params, round_idx, tensors)
            if round_idx == int(vanish_round) and message_kind == last:
                os.kill(os.getpid(), signal.SIGKILL)

        client.PluginClientMasterManager._send_secagg = send_then_vanish
    else:
        raise SystemExit(f"lying_silo.py: unknown lie {kind!r}")


if __name__ == "__main__":
    import fedml_perfedavg  # noqa: F401  (installs the plugin, as a user's script would)
    from fedml_perfedavg.run.cli import main

    lie(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
