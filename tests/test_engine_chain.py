"""The chain: local messages that reactions send while the input queue is empty run in the same
group without being written to ``qin``, in ``qin``'s order; deeper sends are bounded by the group's
time (one in-process server, a real store on disk)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from aaabus import Agent, AgentId, Notification
from aaabus.core.journal import JournalQueue
from aaabus.core.store import PersistentQueue
from tests.support.harness import SingleServer
from tests.support.topics import agent_attr, wait_until


@dataclass
class Go(Notification):
    """Start a pattern: ``Fan`` sends ``first`` to ``via`` and ``second`` to ``last``."""

    via: AgentId
    last: AgentId


@dataclass
class Mark(Notification):
    """A labelled message; a :class:`Passer` passes it on to ``then`` (if any)."""

    label: str
    then: AgentId | None = None


class Fan(Agent):
    """On Go: one event sending m1 to ``via`` (which passes m3 on to ``last``), then m2 to
    ``last`` -- so m2's send happens before m3's, and ``last`` must receive m2 first."""

    def __init__(self) -> None:
        super().__init__("fan")

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Go):
            self.send_to(note.via, Mark("m1", then=note.last))
            self.send_to(note.last, Mark("m2"))
        else:
            super().react(sender, note)


class Passer(Agent):
    """Records each Mark; passes a Mark with ``then`` on as m3."""

    def __init__(self) -> None:
        super().__init__("passer")
        self.got: list[str] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Mark):
            self.got = [*self.got, note.label]
            if note.then is not None:
                self.send_to(note.then, Mark("m3"))
        else:
            super().react(sender, note)


@dataclass
class Tick(Notification):
    pass


@dataclass
class Halt(Notification):
    pass


class Looper(Agent):
    """Sends itself Tick after each Tick until Halt: a local chain with no end of its own."""

    def __init__(self) -> None:
        super().__init__("looper")
        self.ticks = 0
        self.halted = False

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Tick):
            self.ticks += 1
            if not self.halted:
                self.send_to(self.id, Tick())
        elif isinstance(note, Halt):
            self.halted = True
        else:
            super().react(sender, note)


@pytest.fixture
def qin_puts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every message put into any input queue (a spy on the real queues' put: the journal's of
    a log store, the ZODB one of the others)."""
    puts: list[object] = []
    for kind in (PersistentQueue, JournalQueue):
        real = kind.put

        def put(self: Any, item: Any, real: Any = real) -> int:
            puts.append(item)
            return int(real(self, item))

        monkeypatch.setattr(kind, "put", put)
    return puts


def test_a_local_message_keeps_qin_order_behind_a_message_sent_before_its_cause(
    single_server: SingleServer,
) -> None:
    server, _inbox, _cfg = single_server
    fan = server.deploy(Fan())
    via, last = server.deploy(Passer()), server.deploy(Passer())
    for _ in range(3):
        server.send(fan, Go(via, last))
    got = wait_until("all delivered", lambda: _full(agent_attr(server, last, "got"), 6))
    # m2 was sent (by Fan) before m3's cause reached `via`: first, every time (a depth-first
    # run of the chain would give m3 first).
    assert got == ["m2", "m3"] * 3


def _full(got: list[str], n: int) -> list[str] | None:
    return got if len(got) >= n else None


def test_sends_made_while_qin_is_empty_never_touch_qin(
    single_server: SingleServer, qin_puts: list[object]
) -> None:
    server, _inbox, _cfg = single_server
    fan = server.deploy(Fan())
    via, last = server.deploy(Passer()), server.deploy(Passer())
    wait_until("idle", lambda: server.status()["queues"]["input"] == 0 or None)
    before = len(qin_puts)
    server.send(fan, Go(via, last))
    wait_until("delivered", lambda: _full(agent_attr(server, last, "got"), 2))
    # Go is sent by an input (outside any reaction) and m1, m2 and m3 by reactions, all while
    # qin is empty: none of them is written to it (an input's send joins its group's
    # arrivals, as a message from a peer that arrives deliverable does).
    assert len(qin_puts) - before == 0


def test_an_agent_messaging_itself_forever_does_not_hold_the_group(
    single_server: SingleServer,
) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    looper = server.deploy(Looper())
    server.send(looper, Tick())
    commits = engine.stats.commits
    # Groups keep committing while the chain never ends by itself, and other work gets in.
    wait_until("several commits", lambda: engine.stats.commits >= commits + 5 or None)
    assert server.call(lambda: "served") == "served"
    server.send(looper, Halt())
    wait_until("halted", lambda: agent_attr(server, looper, "halted") or None)
    ticks = agent_attr(server, looper, "ticks")
    wait_until("idle", lambda: server.status()["queues"]["input"] == 0 or None)
    assert agent_attr(server, looper, "ticks") in (ticks, ticks + 1)  # the last Tick in flight
    assert ticks > 10
