"""A silo stopped by a signal stops as a stopped silo, even where the interrupt landed in a
library's cleanup that raised an error of its own (torch's vmap nesting asserts when a
KeyboardInterrupt unwinds it: a Ctrl-C to launch-silo once printed that traceback)."""

import pytest

from fedml_perfedavg import stopping
from fedml_perfedavg.fedml_bridge.cross_silo import client


def _manager(monkeypatch, told):
    def failing(self, msg_type, msg_params):
        raise RuntimeError("layer.key() == TransformType::Vmap INTERNAL ASSERT FAILED")

    monkeypatch.setattr(client.ClientMasterManager, "receive_message", failing)
    monkeypatch.setattr(client, "tell_failure", lambda manager, err: told.append(err))
    return object.__new__(client.PluginClientMasterManager)  # the handler alone: no transport


def test_an_error_raised_while_the_silo_is_being_stopped_is_the_stop(monkeypatch):
    told = []
    manager = _manager(monkeypatch, told)
    monkeypatch.setattr(stopping.STOP_SIGNALLED, "_set", True)
    with pytest.raises(KeyboardInterrupt) as stop:
        manager.receive_message("model", {})
    assert isinstance(stop.value.__cause__, RuntimeError) and told == []  # not reported as the silo failing


def test_the_same_error_without_a_stop_is_a_failure_the_server_hears_of(monkeypatch):
    told = []
    manager = _manager(monkeypatch, told)
    monkeypatch.setattr(stopping.STOP_SIGNALLED, "_set", False)
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
        manager.receive_message("model", {})
    assert len(told) == 1 and isinstance(told[0], RuntimeError)
