"""Scenarios for the failpoint walk: small scripted workloads whose history the checker judges.

An :class:`Actor` records every send (message id, destination, vector clock) and every delivery
in its own stored state, in the transaction of the reaction, so the recorded history is exactly
what the bus committed: a send rolled back with its reaction leaves no record, and the checker
then demands that it is never delivered either (no phantom). Messages carry a *plan*, a list of
commands the receiver executes, so one scenario is one initial notification.

Commands (tuples):

* ``("send", label, plan)``: send a recorded message to ``label`` carrying ``plan``;
* ``("burst", label, n, plan)``: the same ``n`` times in one reaction;
* ``("seq", plan, plan, ...)``: run several commands in turn;
* ``("fail", label)``: send a recorded message to ``label``, change state, then raise;
* ``("delete", label)``: ask ``label`` to delete itself, then send it a recorded message
  (which must come back as ``UnknownAgent``);
* ``("deploy", server, label, plan)``: deploy a new actor ``label`` on ``server``; its
  ``on_init`` sends a recorded message back carrying ``plan``.

System notifications an actor receives are kept as short strings in :attr:`Actor.notes`.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from aaabus import (
    Agent,
    AgentCreateReply,
    AgentDeleteAck,
    AgentDeleteRequest,
    AgentId,
    AgentServer,
    ExceptionNotification,
    Notification,
    PersistentList,
    PersistentMapping,
    UnknownAgent,
)
from aaabus.errors import FailpointError
from aaabus.testing.checker import Report, Send, check
from aaabus.testing.workload import merge_and_tick

Plan = tuple[Any, ...]

#: Counts every send attempt in this process (see Actor._send).
_ATTEMPTS = itertools.count()


@dataclass
class Step(Notification):
    mid: str
    vc: dict[str, int]
    plan: Plan


@dataclass
class Directory(Notification):
    ids: dict[str, AgentId]


class Actor(Agent):
    """A scripted agent recording its history for the checker (see the module docstring)."""

    def __init__(self, label: str, ids: dict[str, AgentId] | None = None, plan: Plan = ()) -> None:
        super().__init__(label)
        self.label = label
        self.ids: PersistentMapping = PersistentMapping(ids or {})
        self.vc: dict[str, int] = {}
        self.n = 0
        self.state = 0
        self.sent: PersistentList = PersistentList()
        self.delivered: PersistentList = PersistentList()
        self.notes: PersistentList = PersistentList()
        self.plan = plan

    def on_init(self, first_time: bool) -> None:
        # Volatile: gone whenever a rollback resets the agent, so a react() that finds it
        # missing shows an engine that forgot to run on_init again.
        self._v_ready = True
        if first_time and self.plan:
            # A child: report back to whoever deployed it, carrying its plan.
            plan, self.plan = self.plan, ()
            self._run(plan)

    def _send(self, label: str, plan: Plan) -> None:
        vc = dict(self.vc)
        vc[self.label] = vc.get(self.label, 0) + 1
        self.vc = vc
        # The attempt number makes the message of a rolled-back attempt differ from the one
        # its replay sends: a phantom then shows as a message no committed send recorded.
        mid = f"{self.label}#{self.n}~{next(_ATTEMPTS)}"
        self.n += 1
        self.sent.append((mid, label, dict(vc)))
        self.send_to(self.ids[label], Step(mid, dict(vc), plan))

    def _run(self, plan: Plan) -> None:
        if not plan:
            return
        command, *args = plan
        if command == "send":
            self._send(args[0], tuple(args[1]))
        elif command == "seq":
            for part in args:
                self._run(tuple(part))
        elif command == "burst":
            for _ in range(args[1]):
                self._send(args[0], tuple(args[2]))
        elif command == "fail":
            self._send(args[0], ())
            self.state += 1
            raise RuntimeError(f"{self.label} fails on purpose")
        elif command == "delete":
            self.send_to(self.ids[args[0]], AgentDeleteRequest())
            self._send(args[0], ())
        elif command == "deploy":
            server, label, child_plan = args
            me = self.label
            child = Actor(label, {me: self.id}, ("send", me, tuple(child_plan)))
            self.ids[label] = child.deploy(server, reply=True)
        else:
            raise ValueError(f"unknown command {command!r}")

    def react(self, sender: AgentId, note: Notification) -> None:
        if not getattr(self, "_v_ready", False):
            raise RuntimeError(f"{self.label}: on_init did not run before this reaction")
        if isinstance(note, Directory):
            self.ids.update(note.ids)
        elif isinstance(note, Step):
            self.delivered.append(note.mid)
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            self._run(note.plan)
        elif isinstance(note, AgentCreateReply):
            self.notes.append(f"created {note.ok}")
        elif isinstance(note, AgentDeleteAck):
            self.notes.append("delete-ack")
        elif isinstance(note, UnknownAgent):
            self.notes.append(f"unknown {getattr(note.notification, 'mid', '?')}")
        elif isinstance(note, ExceptionNotification):
            self.notes.append(f"exception {getattr(note.notification, 'mid', '?')}")
        else:
            super().react(sender, note)


@dataclass
class History:
    sent: list[tuple[str, str, dict[str, int]]]
    delivered: list[str]
    notes: list[str]
    state: int


@dataclass(frozen=True)
class Scenario:
    """A named workload: actors to deploy (label -> server) and the first plan, run by
    ``start`` (one of the actors) when it receives an empty message from the server."""

    name: str
    actors: dict[str, int]
    start: str
    plan: Plan
    slow_link: bool = False


def scenarios(home: int, peer: int, router: int, far: int) -> list[Scenario]:
    """The walk's scenarios on a bus where ``home``, ``peer`` and ``router`` share a domain and
    ``far`` is only reached through ``router``. The ``holdback`` scenario expects the link from
    ``home`` to ``router`` to be slow, so that a message overtakes one it causally follows."""
    back = ("send", "x", ())
    return [
        Scenario(
            "local", {"x": home, "y": home}, "x", ("send", "y", ("send", "x", ("send", "y", ())))
        ),
        Scenario(
            "remote", {"x": home, "y": peer}, "x", ("send", "y", ("send", "x", ("send", "y", ())))
        ),
        Scenario("router", {"x": home, "y": far}, "x", ("send", "y", back)),
        Scenario("deploy", {"x": home}, "x", ("deploy", far, "kid", ("send", "kid", ()))),
        Scenario("delete", {"x": home, "y": peer}, "x", ("delete", "y")),
        # y's failed reaction had staged a frame for z on another server: the rollback must
        # not keep the channel from sending the exception report to x.
        Scenario(
            "exception", {"x": home, "y": peer, "z": router}, "x", ("send", "y", ("fail", "z"))
        ),
        Scenario(
            "group", {"x": home, "y": peer, "z": peer}, "x", ("burst", "y", 6, ("send", "z", back))
        ),
        Scenario(
            "holdback",
            {"x": home, "y": peer, "z": router},
            "x",
            ("seq", ("send", "z", ()), ("send", "y", ("send", "z", ()))),
            slow_link=True,
        ),
    ]


def start_step(scenario: Scenario, prefix: str) -> Step:
    """The notification that starts ``scenario`` for the actors labelled with ``prefix``."""

    def relabel(plan: Any) -> Any:
        if isinstance(plan, tuple):
            return tuple(relabel(p) for p in plan)
        if isinstance(plan, str) and (plan in scenario.actors or plan == "kid"):
            return f"{prefix}{plan}"
        return plan

    return Step(f"{prefix}start", {}, relabel(scenario.plan))


class Run:
    """One scenario on a running bus: deploy its actors (labels made unique by ``prefix``),
    start it, wait until the bus is idle, then read what every actor recorded."""

    def __init__(self, servers: dict[int, AgentServer], scenario: Scenario, prefix: str) -> None:
        self.servers = servers
        self.scenario = scenario
        self.prefix = prefix

    def label(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def setup(self) -> None:
        """Deploy the actors and tell each of them every id; returns once the bus is idle."""
        ids = {
            self.label(name): self.servers[sid].deploy(Actor(self.label(name)))
            for name, sid in self.scenario.actors.items()
        }
        for aid in ids.values():
            self.servers[aid.server].send(aid, Directory(ids))
        self.first = ids[self.label(self.scenario.start)]
        wait_idle(self.servers)

    def kick(self) -> None:
        """Start the scenario: its first actor gets the plan (a call retried once if a
        failpoint made it fail: a call that raises did nothing, as a client knows)."""
        start = start_step(self.scenario, self.prefix)
        server = self.servers[self.first.server]
        try:
            server.send(self.first, start)
        except FailpointError:
            server.send(self.first, start)

    def histories(self) -> dict[str, History]:
        """label -> what the actor of this run recorded, for every actor still alive."""
        out: dict[str, History] = {}
        for server in self.servers.values():

            def read(s: AgentServer = server) -> list[tuple[str, History]]:
                assert s.store is not None
                return [
                    (a.label, History(list(a.sent), list(a.delivered), list(a.notes), a.state))
                    for a in s.store.agents.values()
                    if isinstance(a, Actor) and a.label.startswith(self.prefix)
                ]

            out.update(server.call(read))
        return out

    def report(self, histories: dict[str, History]) -> Report:
        """The checker's verdict on this run's history."""
        # A message to an actor that no longer exists (deleted) is not delivered by design: it
        # comes back as UnknownAgent; nor is one whose reaction raised: its reaction was rolled
        # back (delivery record included) and an ExceptionNotification came back. Senders note
        # both.
        bounced = {
            note.split(" ", 1)[1]
            for h in histories.values()
            for note in h.notes
            if note.startswith(("unknown ", "exception "))
        }
        sends = [
            Send(mid, label, dest, vc)
            for label, h in histories.items()
            for mid, dest, vc in h.sent
            if mid not in bounced
        ]
        start = f"{self.prefix}start"
        deliveries = {
            label: [mid for mid in h.delivered if mid != start] for label, h in histories.items()
        }
        return check(sends, deliveries)

    def outcome(self, histories: dict[str, History]) -> dict[str, Any]:
        """What the run did, without this run's prefix nor attempt numbers: comparable between
        runs."""

        def plain(text: str) -> str:
            return re.sub(r"~\d+", "", text.replace(self.prefix, ""))

        return {
            plain(label): (
                sorted(plain(m) for m in h.delivered),
                sorted(plain(m) for m, _, _ in h.sent),
                sorted(plain(note) for note in h.notes),
                h.state,
            )
            for label, h in histories.items()
        }


def bus_counts(servers: dict[int, AgentServer]) -> tuple[int, int, int]:
    """(sent, delivered, pending): committed sends and deliveries summed over the bus, and how
    many messages still sit in its queues (input, held back, outgoing)."""
    sent = delivered = pending = 0
    for server in servers.values():

        def read(s: AgentServer = server) -> tuple[int, int, int]:
            assert s.engine is not None and s.channel is not None and s.store is not None
            depths = s.channel.depths()
            waiting = len(s.store.qin) + depths["held_back"] + sum(depths["outgoing"].values())
            return s.engine.stats.sent, s.engine.stats.reactions, waiting

        a, b, c = server.call(read)
        sent, delivered, pending = sent + a, delivered + b, pending + c
    return sent, delivered, pending


def wait_idle(servers: dict[int, AgentServer], timeout: float = 20.0) -> tuple[int, int]:
    """Wait until every committed send is delivered and every queue is empty; (sent, delivered).

    Raises AssertionError at the deadline, with the last counts: a lost message shows as a
    sum that never balances, a stuck one as a queue that never empties.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        sent, delivered, pending = bus_counts(servers)
        if sent == delivered and pending == 0:
            # Twice in a row: a message could be between two servers' snapshots.
            again = bus_counts(servers)
            if again == (sent, delivered, pending):
                return sent, delivered
        if time.monotonic() > deadline:
            raise AssertionError(
                f"bus not idle after {timeout}s: {sent} sent, {delivered} delivered, "
                f"{pending} queued"
            )
        pause.wait(0.02)  # the traffic runs on the engine threads: poll their counters
