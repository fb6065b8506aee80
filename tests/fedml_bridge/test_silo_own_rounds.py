"""A data owner's silo trains a round at most once, in order, only when the keyed schedule samples
it and within its own DP budget; a resumed server gets the stored answer (client.py's
``_own_round``, on the silo's own record as progress.pt keeps it)."""

from types import SimpleNamespace

import torch

from fedml_perfedavg.fedml_bridge.cross_silo.client import PluginClientMasterManager
from fedml_perfedavg.fedml_bridge.cross_silo.outcome import SiloOutcome, StoredAnswer, state_digest
from fedml_perfedavg.run.silo_record import SiloProgress


def silo(scheduled=lambda r: [1, 2, 3], ledger=None):
    setup = SimpleNamespace(scheduled=scheduled, privacy=ledger)
    return SimpleNamespace(rank=2, own_user=1, setup=setup, outcome=SiloOutcome(1))


def own_round(manager, round_idx, model):
    return PluginClientMasterManager._own_round(manager, round_idx, model)


def test_a_round_is_trained_once_in_order_and_a_resumed_server_gets_the_stored_answer():
    manager = silo()
    model = {"w": torch.ones(3)}
    assert own_round(manager, 0, model) == (None, None)  # train it
    answer = StoredAnswer(0, state_digest(model), {"w": torch.full((3,), 2.0)}, 30)
    manager.outcome.trained(0, answer)
    assert own_round(manager, 0, {"w": torch.ones(3)}) == (None, answer)  # the same model again: stored answer
    refusal, stored = own_round(manager, 0, {"w": torch.tensor([1.0, 1.0, 1.0 + 1e-7])})
    assert stored is None and "trained round 0 already, on another model" in refusal
    manager.outcome.trained(4, None)
    refusal, _ = own_round(manager, 3, model)
    assert "it has trained round 4; rounds go forwards" in refusal


def test_a_round_the_schedule_does_not_sample_this_silo_in_is_refused():
    refusal, _ = own_round(silo(scheduled=lambda r: [1, 3, 4]), 5, {"w": torch.ones(1)})
    assert "does not sample this silo in round 5; it samples silo rank(s) [1, 3, 4]" in refusal


def test_training_past_the_silos_own_budget_is_refused():
    ledger = SimpleNamespace(
        dp=SimpleNamespace(max_epsilon=5.0),
        after_training=lambda r, u: 5.2 if r >= 7 else 4.9,
        would_pass=lambda r, u, budget: (5.2 if r >= 7 else 4.9) > budget,
        epsilon=lambda u: 4.9,
    )
    assert own_round(silo(ledger=ledger), 6, {"w": torch.ones(1)}) == (None, None)
    refusal, _ = own_round(silo(ledger=ledger), 7, {"w": torch.ones(1)})
    assert "epsilon from 4.9 to 5.2, past this silo's dp_args.max_epsilon=5" in refusal


def test_the_stored_answer_and_the_unmasked_list_survive_a_restart_and_the_end_of_the_run(tmp_path):
    algorithm = SimpleNamespace(keeps_client_state=False, holds_client_states=False, client_states={})
    identity = {"run_id": "7", "fingerprint": "f", "user": 1}
    progress = SiloProgress(str(tmp_path), 2, identity, algorithm, None)
    outcome = SiloOutcome(1)
    outcome.keep = progress.save
    model = {"w": torch.ones(3)}
    outcome.trained(3, StoredAnswer(3, state_digest(model), {"w": torch.zeros(3)}, 12))
    assert outcome.unmasking(3, [1, 2, 4]) is None
    assert "already unmasked for the survivors [1, 2, 4]" in outcome.unmasking(3, [1, 4])
    again = SiloOutcome(1)
    assert SiloProgress(str(tmp_path), 2, identity, algorithm, None).restore(again)
    assert again.trained_round == 3 and again.answer.samples == 12 and again.answer.model_digest == state_digest(model)
    assert torch.equal(again.answer.weights["w"], torch.zeros(3)) and again.unmasked == (3, (1, 2, 4))
    assert "already unmasked" in again.unmasking(3, [1, 2])  # a restarted silo still refuses a second list


def test_a_restarted_silo_answers_nothing_meant_for_its_earlier_process_until_it_is_taken_back(monkeypatch):
    """Refused as a twin (its killed process still holds the seat), a silo started again may get the
    model the server sent that process; it must neither train on it (its user's data, its DP
    budget) nor take it as the server's answer, which stopped its announcements (5025f72)."""
    import types

    from fedml.core.distributed.communication.message import Message
    from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
    from fedml.cross_silo.client.message_define import MyMessage

    from fedml_perfedavg.fedml_bridge.cross_silo.client import State

    handled = []
    monkeypatch.setattr(ClientMasterManager, "receive_message", lambda self, kind, params: handled.append(kind))
    manager = object.__new__(PluginClientMasterManager)
    manager.rank, manager.state, manager.last_heard, manager.last_awake = 2, State.ANNOUNCING, 0.0, 0.0
    manager.last_model, manager.slowest_gap, manager.gaps_measured = None, None, 0
    manager.policy = types.SimpleNamespace(connect_timeout=30.0, client_idle_deadline=lambda gap, count: 10.0)
    manager.com_manager = types.SimpleNamespace(retry_seconds=None)
    manager.announce_again_at = 123.0  # refused as a twin: announcing again then
    model = MyMessage.MSG_TYPE_S2C_SYNC_MODEL_TO_CLIENT
    for kind in (model, MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS):
        manager.receive_message(kind, Message(kind, 0, 2))
    assert handled == [] and manager.state is State.ANNOUNCING and manager.last_heard == 0.0
    manager.receive_message(MyMessage.MSG_TYPE_S2C_FINISH, Message(MyMessage.MSG_TYPE_S2C_FINISH, 0, 2))
    assert handled == [MyMessage.MSG_TYPE_S2C_FINISH]  # the run's end reaches it whoever it was for
    manager.announce_again_at = None  # taken back
    manager.receive_message(model, Message(model, 0, 2))
    assert handled[-1] == model and manager.state is State.LISTENING
