"""Agents of the fault workloads, shipped so that a bus's processes can load them.

The torture schedules (:mod:`aaabus.testing.torture`), the wire fuzzer
(:mod:`aaabus.testing.fuzz`) and the test suite run these agents inside real server processes,
which import them by name from the config
(``<service class="aaabus.testing.workload:bounce_setup" .../>``): they must be installed with
the package, not found in a checkout's ``tests/`` directory.

* :class:`Bouncer` and :class:`Echo` play ping-pong with an exact counter (a lost or duplicated
  bounce shows as an error count);
* :class:`Gossiper` sends and forwards gossip, recording its vector-clock history for the
  independent checker (:mod:`aaabus.testing.checker`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus import Agent, AgentId, BootContext, Notification, PersistentList


def merge_and_tick(mine: dict[str, int], theirs: dict[str, int], me: str) -> dict[str, int]:
    """A vector clock after receiving ``theirs``: entry-wise maximum, then ``me`` ticks once.

    Test agents record these for the independent checker (:mod:`aaabus.testing.checker`).
    """
    merged = {k: max(v, theirs.get(k, 0)) for k, v in mine.items()}
    for k, v in theirs.items():
        merged.setdefault(k, v)
    merged[me] = merged.get(me, 0) + 1
    return merged


def write_json(path: str, data: Any) -> None:
    target = Path(path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)


# -- ping-pong with an exact bounce counter --------------------------------------------------------


@dataclass
class Bounce(Notification):
    i: int


@dataclass
class More(Notification):
    """Asks a :class:`Bouncer` for ``n`` more bounces: a test goes on after some event (a
    restart, a move to new domains) with the state the bouncer kept through it."""

    n: int


class Echo(Agent):
    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Bounce):
            self.send_to(sender, note)
        else:
            super().react(sender, note)


class Bouncer(Agent):
    """Bounces ``Bounce(i)`` off an :class:`Echo` ``n`` times, checking every number.

    Writes ``{"count", "errors"}`` to ``done`` after the last bounce and, if ``every`` is set,
    after every ``every`` bounces too: that progress lets a test see real traffic go on *after*
    some event (a fuzzing run, a partition), not only that ``n`` bounces completed eventually.
    The file is written again if a reaction is replayed after a crash: idempotent, a hint only.
    """

    def __init__(self, echo_server: int, n: int, done: str, every: int = 0) -> None:
        super().__init__("bouncer")
        self.echo_server = echo_server
        self.n = n
        self.done = done
        self.every = every
        self.count = 0
        self.errors = 0

    def on_init(self, first_time: bool) -> None:
        if first_time:
            self.echo = Echo().deploy(self.echo_server)
            self.send_to(self.echo, Bounce(1))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Bounce):
            if note.i == self.count + 1:
                self.count += 1
            else:
                self.errors += 1
            if self.count < self.n:
                self.send_to(self.echo, Bounce(self.count + 1))
            if self.count >= self.n or (self.every and self.count % self.every == 0):
                write_json(self.done, {"count": self.count, "errors": self.errors})
        elif isinstance(note, More):
            self.n += note.n
            self.send_to(self.echo, Bounce(self.count + 1))
        else:
            super().react(sender, note)


def bounce_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    if first_time:
        spec = json.loads(args)
        Bouncer(spec["echo"], spec["n"], spec["done"], spec.get("every", 0)).deploy()


# -- gossip with vector clocks, for the independent causality checker ------------------------------


@dataclass
class Gossip(Notification):
    mid: str
    vc: dict[str, int]
    ttl: int


@dataclass
class Peers(Notification):
    peers: list[tuple[str, AgentId]]


@dataclass
class Kick(Notification):
    count: int
    ttl: int


class Gossiper(Agent):
    """Sends and forwards gossip, recording its own history for the checker.

    Keeps a vector clock over agent names (the checker's causal context): +1 once per reaction
    (a reaction is one event: its delivery and all its sends), merged with the message's on
    delivery; every send of a reaction carries the clock of that reaction. Every send (mid,
    destination, clock) and every delivery (mid) is appended to the agent's own stored history,
    in the same transaction as the reaction, so the history is exactly what the bus committed.
    Forwarding targets come from a counter-seeded generator, so a run is reproducible.
    """

    def __init__(self, label: str, seed: int) -> None:
        super().__init__(label)
        self.label = label
        self.seed = seed
        self.vc: dict[str, int] = {}
        self.peers: list[tuple[str, AgentId]] = []
        self.sent: PersistentList = PersistentList()
        self.delivered: PersistentList = PersistentList()
        self.n = 0

    def _send(self, ttl: int) -> None:
        import random

        rng = random.Random(f"{self.seed}:{self.n}")
        name, dest = self.peers[rng.randrange(len(self.peers))]
        mid, vc = self._record_send(name)
        self.send_to(dest, Gossip(mid, vc, ttl))

    def _tick(self) -> None:
        """Count a reaction that delivered nothing (a start order from outside) as an event."""
        vc = dict(self.vc)
        vc[self.label] = vc.get(self.label, 0) + 1
        self.vc = vc  # reassigned: a plain dict attribute is only saved when assigned

    def _record_send(self, dest_name: str) -> tuple[str, dict[str, int]]:
        """Record a send to ``dest_name`` of the current reaction; the message's id and clock.

        A reaction is one event (the bus stamps all its sends together), so its sends carry
        the clock the reaction ticked once, and no tick of their own.
        """
        vc = self.vc
        mid = f"{self.label}#{self.n}"
        self.n += 1
        self.sent.append((mid, dest_name, dict(vc)))
        return mid, dict(vc)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Peers):
            self.peers = [p for p in note.peers if p[0] != self.label]
        elif isinstance(note, Kick):
            self._tick()
            for _ in range(note.count):
                self._send(note.ttl)
        elif isinstance(note, Gossip):
            self.delivered.append(note.mid)
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            if note.ttl > 0:
                self._send(note.ttl - 1)
        else:
            super().react(sender, note)
