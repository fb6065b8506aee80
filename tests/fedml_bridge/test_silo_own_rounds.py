"""A data owner's silo's record survives a restart (progress.pt). Its rules and its protocol are
tests/silo/test_rules.py's and tests/silo/test_protocol.py's."""

from types import SimpleNamespace

import torch

from fedml_perfedavg.silo.outcome import SiloOutcome, StoredAnswer, state_digest
from fedml_perfedavg.run.silo_record import SiloProgress


def test_the_stored_answer_and_the_unmasked_list_survive_a_restart_and_the_end_of_the_run(tmp_path):
    algorithm = SimpleNamespace(keeps_client_state=False, holds_client_states=False, client_states={})
    identity = {"run_id": "7", "fingerprint": "f", "user": 1}
    progress = SiloProgress(str(tmp_path), 2, identity, algorithm, None)
    outcome = SiloOutcome(1)
    outcome.keep = progress.save
    model = {"w": torch.ones(3)}
    outcome.trained(3, StoredAnswer(3, state_digest(model), {"w": torch.zeros(3)}, 12))
    assert outcome.unmasking_problem(3, [1, 2, 4]) is None
    outcome.unmasked_for(3, [1, 2, 4])
    assert "already unmasked for the survivors [1, 2, 4]" in outcome.unmasking_problem(3, [1, 4])
    again = SiloOutcome(1)
    assert SiloProgress(str(tmp_path), 2, identity, algorithm, None).restore(again)
    assert again.trained_round == 3 and again.answer.samples == 12 and again.answer.model_digest == state_digest(model)
    assert torch.equal(again.answer.weights["w"], torch.zeros(3)) and again.unmasked == (3, (1, 2, 4))
    assert "already unmasked" in again.unmasking_problem(3, [1, 2])  # a restarted silo still refuses a second list
