"""A data owner's silo keeps its progress (``silo-rank-R/progress.pt``) as it goes: a process of
the same silo started again in the same run carries on with its evaluations, its user's own state
and its DP-SGD account; another run's file is named and not used; a damaged one is named."""

import logging

import pytest
import torch

from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.silo.outcome import SiloOutcome
from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.silo_record import PROGRESS, SiloProgress, run_identity

import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD
from tests.helpers_tiny import tiny_config, tiny_data

FINGERPRINT = {"federated_optimizer": "ClippedFedSGD", "clip_norm": 10.0, "seed": 0}


class Account:
    """Stands for the silo's PrivacyLedger: what it counted is its state."""

    def __init__(self):
        self.counted = []

    def state_dict(self):
        return {"counted": list(self.counted)}

    def load_state_dict(self, state):
        self.counted = list(state["counted"])


def _silo(tmp_path, run_id="7", fingerprint=FINGERPRINT, user=1):
    config = tiny_config(federated_optimizer="ClippedFedSGD", clip_norm=10.0, client_momentum=0.9)
    model = create_model("mlp", (1, 4, 4), 3, [5])
    algorithm = create_algorithm("ClippedFedSGD", model, config)
    ledger = Account()
    progress = SiloProgress(str(tmp_path), user + 1, run_identity(run_id, fingerprint, user), algorithm, ledger)
    outcome = SiloOutcome(user)
    restored = progress.restore(outcome)
    outcome.keep = progress.save
    return algorithm, ledger, outcome, progress, model.state_dict(), restored


def _train_and_evaluate(algorithm, ledger, outcome, state, round_idx, user=1):
    split = tiny_data().users[user]
    algorithm.client_update(round_idx, user, state, split.train_x, split.train_y)
    ledger.counted.append(("training", round_idx))
    outcome.trained(round_idx)
    outcome.evaluated({"round": round_idx, "user": user, "correct": 3, "correct_before": 2, "total": 8}, state)


def test_a_silo_started_again_carries_on_with_its_evaluations_state_and_account(tmp_path):
    algorithm, ledger, outcome, _, state, restored = _silo(tmp_path)
    assert not restored
    for round_idx in (0, 1):
        _train_and_evaluate(algorithm, ledger, outcome, state, round_idx)
    assert (tmp_path / "silo-rank-2" / PROGRESS).exists()

    again, again_ledger, again_outcome, progress, _, restored = _silo(tmp_path)  # the same silo's next process
    assert restored
    assert again_outcome.trained_round == 1 and again_outcome.evaluations == outcome.evaluations
    assert again_ledger.counted == ledger.counted == [("training", 0), ("training", 1)]
    kept, carried = algorithm.client_states.get(1), again.client_states.get(1)
    assert set(carried) == set(kept) and all(torch.equal(carried[k], kept[k]) for k in kept)
    # its next round trains from the momentum it kept, as the uninterrupted silo does
    split = tiny_data().users[1]
    going_on = algorithm.client_update(2, 1, state, split.train_x, split.train_y).state
    after_restart = again.client_update(2, 1, state, split.train_x, split.train_y).state
    assert all(torch.equal(going_on[k], after_restart[k]) for k in going_on)
    assert (tmp_path / "silo-rank-2" / PROGRESS).exists()  # kept: the organization's account of its data's use


@pytest.mark.parametrize("other", [dict(run_id="8"), dict(fingerprint={**FINGERPRINT, "clip_norm": 1.0})])
def test_another_runs_progress_is_named_and_not_used(tmp_path, caplog, other):
    algorithm, ledger, outcome, _, state, _ = _silo(tmp_path)
    _train_and_evaluate(algorithm, ledger, outcome, state, 0)
    with caplog.at_level(logging.WARNING):
        fresh, fresh_ledger, fresh_outcome, _, _, restored = _silo(tmp_path, **other)
    assert not restored and "is another run's" in caplog.text and PROGRESS in caplog.text
    assert fresh.client_states.get(1) is None and fresh_ledger.counted == [] and fresh_outcome.evaluations == []


def test_a_damaged_progress_file_is_named(tmp_path):
    folder = tmp_path / "silo-rank-2"
    folder.mkdir()
    (folder / PROGRESS).write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=f"{PROGRESS}: not a readable silo progress file"):
        _silo(tmp_path)
    identity = run_identity("7", FINGERPRINT, 1)
    torch.save({"identity": identity, "trained_round": "3", "evaluations": [], "client_state": None}, folder / PROGRESS)
    with pytest.raises(ConfigError, match="its trained_round is '3'; remove the file"):
        _silo(tmp_path)
