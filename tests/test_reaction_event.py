"""A reaction is one clock event: every message it sends is in the causal past of anything any
of its receivers sends afterwards, whatever the order of the sends inside the reaction."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from pathlib import Path

import pytest

from aaabus import Agent, AgentId, Notification
from aaabus.config.reader import load_config
from aaabus.core.clock import DomainClock, Verdict
from aaabus.errors import ClockError
from aaabus.node.inprocess import InProcessBus
from aaabus.node.status import server_status
from examples._bus import Gate, wait_for, write_bus
from tests.support.harness import TEST_TRUST


@pytest.mark.parametrize("stamps", ["delta", "full"])
def test_sibling_sent_first_is_in_the_past_of_what_the_other_receiver_sends(stamps: str) -> None:
    a, b, c = (DomainClock(3, i, stamps=stamps) for i in range(3))
    (_, to_b), (_, to_c) = a.prepare_sends([1, 2])  # B first, then C: one event
    assert b.receive(0, to_b) is Verdict.DELIVER
    b_to_c = b.prepare_send(2)
    assert c.check(1, b_to_c) is Verdict.WAIT  # A's message to C is known to B's send
    assert c.receive(0, to_c) is Verdict.DELIVER
    assert c.receive(1, b_to_c) is Verdict.DELIVER


@pytest.mark.parametrize("stamps", ["delta", "full"])
def test_two_messages_to_one_server_in_one_event_keep_their_order(stamps: str) -> None:
    a, b = DomainClock(2, 0, stamps=stamps), DomainClock(2, 1, stamps=stamps)
    (seq1, first), (seq2, second) = a.prepare_sends([1, 1])
    assert (seq1, seq2) == (1, 2)
    assert first == second  # one stamp for the event on this link; it counts both messages
    assert b.event_end(0, first) == 2
    assert b.receive(0, second, seq2) is Verdict.WAIT
    assert b.receive(0, first, seq1) is Verdict.DELIVER
    assert b.received_from(0) == 1  # the link entry counts what was delivered, not the event
    assert b.receive(0, second, seq2) is Verdict.DELIVER
    assert b.receive(0, first, seq1) is Verdict.DUPLICATE
    with pytest.raises(ClockError, match="between 1 and that count"):
        b.check(0, first, 3)
    # The next event's stamp still carries what the receiver needs, after a batch.
    ((seq3, third),) = a.prepare_sends([1])
    assert seq3 == 3 and b.receive(0, third) is Verdict.DELIVER


@dataclass
class Fan(Notification):
    targets: list[AgentId]


@dataclass
class Relay(Notification):
    to: AgentId


@dataclass
class Said(Notification):
    who: str


class Speaker(Agent):
    """On Fan: one reaction sends to each target in turn. On Said: tells its server's program,
    and a Relay target passes a Said on."""

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Fan):
            for target in note.targets:
                self.send_to(target, Said(self.name))
        elif isinstance(note, Relay):
            self.relay_to = note.to
        elif isinstance(note, Said):
            self.send_to(AgentId.server_of(self.id.server), note)
            relay = getattr(self, "relay_to", None)
            if relay is not None:
                self.send_to(relay, Said(self.name))
        else:
            super().react(sender, note)


def test_c_delivers_a_first_when_a_sent_to_b_before_c_in_one_reaction(tmp_path: Path) -> None:
    """A (server 0) sends to B (1) then to C (2) in one reaction; B passes it on to C. The link
    0 -> 2 is down until B's message waits at C: C must deliver A's message first."""
    gate = Gate()
    path = write_bus(
        tmp_path,
        [[0, 1, 2]],
        properties={"aaabus.trust": TEST_TRUST},
        server_properties={0: {"aaabus.dial.2": f"127.0.0.1:{gate.port}"}},
    )
    config = load_config(path)
    gate.target = ("127.0.0.1", config.servers[2].networks[0].port)
    try:
        with InProcessBus(config) as bus:
            seen: queue.Queue[str] = queue.Queue()
            bus[2].add_listener(
                lambda sender, note: seen.put(note.who if isinstance(note, Said) else "?")
            )
            ids = [bus[i].deploy(Speaker(name)) for i, name in enumerate("ABC")]
            bus[1].send(ids[1], Relay(ids[2]))
            bus[0].send(ids[0], Fan([ids[1], ids[2]]))  # B first, then C
            held = wait_for(
                lambda: server_status(bus[2])["queues"]["held_back"], 10, "B's message held at C"
            )
            assert held == 1
            assert seen.empty()
            gate.open()
            assert [seen.get(timeout=10), seen.get(timeout=10)] == ["A", "B"]
    finally:
        gate.close()


def test_an_oversized_notification_is_refused_when_sent_not_when_sealed(tmp_path: Path) -> None:
    properties = {"aaabus.trust": TEST_TRUST, "aaabus.max_frame": "2048"}
    path = write_bus(tmp_path, [[0, 1]], properties=properties)
    with InProcessBus(load_config(path)) as bus:
        seen: queue.Queue[str] = queue.Queue()
        bus[1].add_listener(lambda sender, note: seen.put(getattr(note, "who", "?")[:5]))
        far = bus[1].deploy(Speaker("far"))
        with pytest.raises(ValueError, match="over the bus limit of 2048"):
            bus[0].send(far, Said("x" * 3000))
        bus[0].send(far, Said("small"))  # the engine goes on; the refused one left nothing
        assert seen.get(timeout=10) == "small"
        assert server_status(bus[0])["queues"]["held_back"] == 0
