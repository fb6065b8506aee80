"""A data owner's silo's record survives a restart (progress.pt), and a restarted silo answers
nothing meant for its earlier process. Its rules themselves are tests/silo/test_rules.py's."""

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


def test_a_restarted_silo_answers_nothing_meant_for_its_earlier_process_until_it_is_taken_back(monkeypatch):
    """Refused as a twin (its killed process still holds the seat), a silo started again may get the
    model the server sent that process; it must neither train on it (its user's data, its DP
    budget) nor take it as the server's answer, which stopped its announcements (5025f72)."""
    import types

    from fedml.core.distributed.communication.message import Message
    from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
    from fedml.cross_silo.client.message_define import MyMessage

    from fedml_perfedavg.fedml_bridge.cross_silo.client import PluginClientMasterManager, State

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


def test_an_organization_that_comes_back_after_the_run_finished_ends_as_finished_not_stopped():
    """Issue 76: an organization that came back after the run finished exited 3 ("stopped early");
    told the run finished, it ends as the run did. Told the run ended early, it keeps the reason."""
    import types

    from fedml_perfedavg.fedml_bridge.cross_silo import wire
    from fedml_perfedavg.fedml_bridge.cross_silo.client import PluginClientMasterManager, State

    for told, ended_early in ((wire.RUN_FINISHED, None), ("the server stopped: too few silos", "too few")):
        manager = object.__new__(PluginClientMasterManager)
        manager.rank, manager.client_real_id, manager.state = 2, 2, State.ANNOUNCING
        manager.setup = types.SimpleNamespace(hello={})
        manager.outcome = SiloOutcome(1)
        refusal = wire.Rejected(told, wire.RUN_OVER, counted=False).words()
        manager.com_manager = types.SimpleNamespace(send_message=lambda message, deadline=None, r=refusal: r)
        manager.finish = lambda: None
        manager._announce(10.0)
        assert manager.state is State.DONE
        assert (manager.outcome.ended_early or None) == (None if ended_early is None else told), told
