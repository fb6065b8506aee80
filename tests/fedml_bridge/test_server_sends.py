"""The FedML-facing cross-silo server carries out its sends without holding up its protocol: a
silo that takes TCP and never its model costs the others nothing, and what could not be delivered
comes back as an event at the next tick."""

import queue
import time
from types import SimpleNamespace

import pytest

from fedml_perfedavg.fedml_bridge.cross_silo.delivery import PeerUnreachable
from fedml_perfedavg.silo.server.events import Hello, Listening, ToSilo
from fedml_perfedavg.fedml_bridge.cross_silo.server_sends import ServerSends
from fedml_perfedavg.silo.server.phases import Phase
from fedml_perfedavg.fedml_bridge.cross_silo.server import PluginServerManager

from .test_server_protocol import hello, protocol, update

pytestmark = pytest.mark.fast


class StuckTransport:
    """Delivers to every rank at once except ``stuck``, which holds its send to the deadline (a
    process that was stopped: the kernel takes the TCP connection, nobody reads)."""

    def __init__(self, stuck):
        self.stuck = stuck
        self.delivery = self
        self.delivered = []
        self.refusals = SimpleNamespace(totals={})

    def encode_all(self, messages):
        return [(m.get_receiver_id(), b"bytes") for m in messages]

    def send_all(self, encoded, deadline, gone_if_refused=()):
        self.delivered += [r for r, _ in encoded if r != self.stuck]
        if any(r == self.stuck for r, _ in encoded):
            time.sleep(max(0.0, deadline - time.monotonic()))
            return {self.stuck: PeerUnreachable(f"rank {self.stuck} did not take a message by the deadline")}
        return {}


def test_server_mail_sends_in_the_background_and_reports_what_was_not_delivered():
    sends, reports = ServerSends(StuckTransport(stuck=2)), queue.Queue()
    started = time.monotonic()
    messages = [ToSilo(1, silo, 0) for silo in (1, 2)]
    sends.send(messages, started + 0.5, set(), reports.put)
    assert time.monotonic() - started < 0.2
    report = reports.get(timeout=5)
    assert list(report) == [2] and "did not take a message" in report[2]
    assert time.monotonic() - started >= 0.5
    sends.send(messages[:1], time.monotonic() + 0.5, set(), reports.put)
    time.sleep(0.2)
    assert reports.empty()  # delivered: nothing to report


class Driver:
    def __init__(self):
        self.lost = []

    def __getattr__(self, name):
        return lambda *args: None

    def record_lost_silos(self, round_idx, ranks, why):
        self.lost.append((round_idx, ranks, why))


def server_over(transport, timeout):
    """The server's FedML face over ``transport``, built without FedML's constructor."""
    server = object.__new__(PluginServerManager)
    server.protocol, _ = protocol(timeout=timeout)
    server.driver = Driver()
    server.sends = ServerSends(transport)
    server.com_manager = SimpleNamespace(
        conversations=SimpleNamespace(hold_seats=lambda seats: None), backlog=lambda: 0
    )
    server.args = SimpleNamespace(round_idx=0)
    server._late, server._arrived, server.is_initialized = queue.Queue(), 0.0, False
    return server


def test_a_silo_that_never_takes_its_model_does_not_hold_up_the_protocol():
    transport = StuckTransport(stuck=2)
    server = server_over(transport, timeout=1.5)
    server._handle(Listening(time.monotonic()))
    server._handle(Hello(time.monotonic(), 1, hello(1), "s1"))
    started = time.monotonic()
    server._handle(Hello(time.monotonic(), 2, hello(2), "s2"))  # training starts: the round's models go out
    assert time.monotonic() - started < 0.5  # not the round deadline
    assert server.protocol.phase is Phase.TRAINING and transport.delivered == [1]
    server._handle(update(1, 0, 1.0, now=time.monotonic()))  # the other silo is heard at once
    assert 1 in server.protocol.rounds.round.answered
    deadline = time.monotonic() + 10
    while not server.driver.lost:
        assert time.monotonic() < deadline
        server.on_idle()
        time.sleep(0.05)
    ((round_idx, ranks, why),) = server.driver.lost
    assert (round_idx, ranks) == (0, [2])


class SlowTransport(StuckTransport):
    """Takes ``seconds[rank]`` to deliver to a rank (0.05 s to the others), in the order delivered."""

    def __init__(self, seconds):
        super().__init__(stuck=None)
        self.seconds, self.told_run_over, self.order = seconds, (), []

    def send_all(self, messages, deadline, gone_if_refused=()):
        time.sleep(max(self.seconds.get(m.get_receiver_id(), 0.05) for m in messages))
        self.order += [m.get_receiver_id() for m in messages]
        return {}


def test_a_run_that_ends_right_after_a_refusal_delivers_the_refusal_before_its_own_end():
    """Seen once in a suite run: the server refused silo 4 at start and stopped the run; the
    refusal, a notice sent in the background, was cancelled by the server's own end, and silo 4,
    told nothing, waited past the test's 240 s. The end of a run now waits for the notices under way
    (each within its deadline), then tells the live silos."""
    from fedml_perfedavg.net import wire
    from fedml_perfedavg.silo.server.events import EndRun

    transport = SlowTransport({4: 0.6})
    sends = ServerSends(transport)
    refusal = ToSilo(wire.FINISH, 4, 0, reason="refused by the server: its data does not fit", refused=True)
    sends.notify([refusal], time.monotonic() + 2.0)
    sends.end_run(EndRun("round 2 cannot be run", (1, 2), (), (1, 2, 4), 1.0, 1.0, True), 0)
    assert transport.order == [4, 1, 2], transport.order  # the refusal reached silo 4 before the run's end
    assert sends.notices == []
