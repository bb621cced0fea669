"""Agents used by the tests. Importable by the server processes the tests start (cwd = repo)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aaabus import (
    Agent,
    AgentCreateReply,
    AgentId,
    BootContext,
    Notification,
)
from aaabus.testing.workload import write_json


@dataclass
class Inc(Notification):
    i: int


@dataclass
class Tick(Notification):
    pass


@dataclass
class Boom(Notification):
    """Makes a :class:`Faulty` change its state, send to ``peer`` three times, then raise."""

    peer: AgentId


@dataclass
class Poke(Notification):
    """Asks a :class:`Probe` to send ``note`` to ``to`` (so that replies come back to it)."""

    to: AgentId
    note: Any


@dataclass
class DeployThis(Notification):
    """Asks a :class:`Probe` to deploy ``agent`` on ``server`` with a creation reply."""

    agent: Any
    server: int


@dataclass
class Marker(Notification):
    label: str = ""


@dataclass
class Weird(Notification):
    pass


@dataclass
class Seen(Notification):
    """What a :class:`Probe` or :class:`Recorder` reports to the server (the test's listener)."""

    by: AgentId
    sender: AgentId
    note: Any = field(default=None)


class Probe(Agent):
    """The test's hand inside the bus: sends on request, reports everything it receives."""

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Poke):
            self.send_to(note.to, note.note)
        elif isinstance(note, DeployThis):
            note.agent.deploy(note.server, reply=True)
        else:
            self.send_to(AgentId.server_of(self.id.server), Seen(self.id, sender, note))


class Recorder(Probe):
    """Reports everything it receives (same as Probe; a separate name reads better in tests)."""


class Silent(Agent):
    """Handles nothing: the default react answers every user notification with an error."""


class Faulty(Agent):
    def __init__(self) -> None:
        super().__init__("faulty")
        self.value = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Boom):
            self.value = 99
            for i in range(3):
                self.send_to(note.peer, Marker(f"leaked-{i}"))
            raise ValueError("boom")
        super().react(sender, note)


class Counter(Agent):
    """Counts ``Inc(i)`` notifications, checking that they come in order, once each."""

    def __init__(self, expect: int = 0, done: str = "") -> None:
        super().__init__("counter")
        self.count = 0
        self.errors = 0
        self.expect = expect
        self.done = done
        self.inits = 0

    def on_init(self, first_time: bool) -> None:
        self.inits += 1

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Inc):
            if note.i == self.count + 1:
                self.count += 1
            else:
                self.errors += 1
            if self.done and self.count == self.expect:
                # A side effect outside the store: written again if this reaction is replayed
                # after a crash, which is harmless because it is idempotent.
                path = Path(self.done)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"count": self.count, "errors": self.errors}))
                os.replace(tmp, path)
        else:
            super().react(sender, note)


class Feeder(Agent):
    """Sends ``Inc(1..n)`` to ``target``, one per reaction, ticking itself along."""

    def __init__(self, target: AgentId, n: int) -> None:
        super().__init__("feeder")
        self.target = target
        self.n = n
        self.sent = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Tick):
            if self.sent < self.n:
                self.sent += 1
                self.send_to(self.target, Inc(self.sent))
                self.send_to(self.id, Tick())
        else:
            super().react(sender, note)


def durability_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service: on first boot, deploy a counter and a feeder of ``n`` increments."""
    if not first_time:
        return
    spec = json.loads(args)
    counter = Counter(expect=spec["n"], done=spec["done"]).deploy()
    feeder = Feeder(counter, spec["n"]).deploy()
    ctx.send(feeder, Tick())


def failing_service(ctx: BootContext, args: str, first_time: bool) -> None:
    raise RuntimeError("this service always fails")


# -- the report's figure 13: causal order across three servers ------------------------------------


@dataclass
class Label(Notification):
    label: str


class Witness(Agent):
    """A3: records the order in which labels arrive; writes it out when ``expect`` are in."""

    def __init__(self, out: str, expect: int = 2) -> None:
        super().__init__("witness")
        self.out = out
        self.expect = expect
        self.labels: list[str] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Label):
            self.labels = [*self.labels, note.label]  # reassigned: a plain list is not tracked
            if len(self.labels) == self.expect:
                write_json(self.out, self.labels)
        else:
            super().react(sender, note)


class Relay(Agent):
    """A2: on n2, sends n3 to A3."""

    def __init__(self, a3: AgentId) -> None:
        super().__init__("relay")
        self.a3 = a3

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Label) and note.label == "n2":
            self.send_to(self.a3, Label("n3"))
        else:
            super().react(sender, note)


class Origin(Agent):
    """A1: creates A3 and A2, and once both exist sends n1 to A3, then n2 to A2."""

    def __init__(self, a2_server: int, a3_server: int, out: str) -> None:
        super().__init__("origin")
        self.a2_server = a2_server
        self.a3_server = a3_server
        self.out = out
        self.created = 0

    def on_init(self, first_time: bool) -> None:
        if first_time:
            self.a3 = Witness(self.out).deploy(self.a3_server, reply=True)
            self.a2 = Relay(self.a3).deploy(self.a2_server, reply=True)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, AgentCreateReply):
            if not note.ok:
                raise RuntimeError(note.error)
            self.created += 1
            if self.created == 2:
                self.send_to(self.a3, Label("n1"))
                self.send_to(self.a2, Label("n2"))
        else:
            super().react(sender, note)


def fig13_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    if first_time:
        spec = json.loads(args)
        Origin(spec["a2"], spec["a3"], spec["out"]).deploy()


# -- atomicity: an on_init that sends, then raises -----------------------------------------------


class SendsThenFailsInit(Agent):
    """On creation, sends ``Marker("PHANTOM")`` to ``peer``, then raises: a rolled-back creation."""

    def __init__(self, peer: AgentId) -> None:
        super().__init__("sends-then-fails")
        self.peer = peer

    def on_init(self, first_time: bool) -> None:
        if first_time:
            self.send_to(self.peer, Marker("PHANTOM"))
            raise RuntimeError("on_init failed after sending")


@dataclass
class Go(Notification):
    """Asks a :class:`Deployer` to send ``before`` to its peer (if set), then deploy a
    :class:`SendsThenFailsInit` here, all in one reaction."""

    before: str = ""


class Deployer(Agent):
    """Drives the failing-creation scenarios; forwards every other :class:`Marker` to ``peer``."""

    def __init__(self, peer: AgentId) -> None:
        super().__init__("deployer")
        self.peer = peer

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Go):
            if note.before:
                self.send_to(self.peer, Marker(note.before))
            SendsThenFailsInit(self.peer).deploy(reply=True)
        elif isinstance(note, Marker):
            self.send_to(self.peer, note)
        elif isinstance(note, AgentCreateReply) and not note.ok:
            self.send_to(self.peer, Marker(f"create failed: {note.error}"))
        else:
            super().react(sender, note)


class InitSender(Agent):
    """Sends ``Marker("init")`` to ``peer`` from every on_init after the first; forwards
    markers to ``peer`` without changing its own state."""

    def __init__(self, peer: AgentId) -> None:
        super().__init__("init-sender")
        self.peer = peer

    def on_init(self, first_time: bool) -> None:
        if not first_time:
            self.send_to(self.peer, Marker("init"))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Marker):
            self.send_to(self.peer, note)
        else:
            super().react(sender, note)


class Leaving(Agent):
    """Says goodbye to ``peer`` from ``on_delete``, and refuses to go (raises) while ``refuse``;
    ``Marker("comply")`` clears the flag."""

    def __init__(self, peer: AgentId) -> None:
        super().__init__("leaving")
        self.peer = peer
        self.refuse = True

    def on_delete(self) -> None:
        self.send_to(self.peer, Marker("goodbye"))
        if self.refuse:
            raise RuntimeError("not leaving")

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Marker) and note.label == "comply":
            self.refuse = False
        else:
            super().react(sender, note)
