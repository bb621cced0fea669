"""Agents of the structured workload (``python -m perf groups``): servers in groups that talk
mostly inside their group.

A :class:`Coordinator` on server 0 deploys one :class:`Talker` on every server, then tells each
talker who its group mates and the others are. Every talker runs a closed loop of ``count``
exchanges: it sends a :class:`Hello` to a peer drawn from its own group with probability
``inside`` (else from the other groups), the peer answers with an :class:`Answer`, and the next
hello leaves when the answer is in. So at most one hello per talker is in flight, every server
sends and receives, and the bus carries the traffic pattern without flooding.

Latency is one-way, per notification: each notification carries ``time.monotonic_ns()`` taken
when it was sent (CLOCK_MONOTONIC, shared by every process of the machine), and the talker that
started the exchange keeps both legs: the hello's (stamped by the peer on arrival and carried
back in the answer) and the answer's. The first ``warmup`` exchanges of each talker are not
kept. Kept timings live in volatile attributes (``_v_*``): persisting a growing list at every
commit would make the workload measure itself; if ZODB drops them (a ghosted agent after an
aborted group) the talker reports what it kept.

Each talker sends its timings to the coordinator in a :class:`Done`; when every talker is done
the coordinator writes the result file (``out``): legs in ns and the time window of the
measured part, for the hop traces.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from aaabus import Agent, AgentId, BootContext, Notification


@dataclass
class Plan(Notification):
    """Coordinator to talker: the peers to draw from and the loop's parameters."""

    mates: list[AgentId]
    others: list[AgentId]
    inside: float
    count: int
    warmup: int
    seed: int
    payload: int = 0
    #: False: this talker only answers (the load is set by how many talkers drive exchanges).
    active: bool = True


@dataclass
class Hello(Notification):
    seq: int
    sent_ns: int
    payload: bytes = b""


@dataclass
class Answer(Notification):
    seq: int
    hello_ns: int  # the hello's one-way time, measured by the peer on arrival
    sent_ns: int


@dataclass
class Done(Notification):
    server: int
    #: One-way times in ns of the measured exchanges: (hello, answer, inside the group?).
    legs: list[tuple[int, int, bool]] = field(default_factory=list)
    #: Wall-clock time (``time.time_ns``, the hop traces' clock) of the measured part.
    first_ns: int = 0
    last_ns: int = 0


class Talker(Agent):
    """One per server: runs the closed loop of exchanges and answers its peers' hellos."""

    def __init__(self) -> None:
        super().__init__("talker")
        self.plan: Plan | None = None
        self.exchanges = 0
        self.coordinator: AgentId | None = None
        self.mate_set: set[AgentId] = set()

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Plan):
            self.plan, self.coordinator = note, sender
            self.mate_set = set(note.mates)
            self._v_rng = random.Random(note.seed)
            self._v_legs: list[tuple[int, int, bool]] = []
            self._v_first = 0
            if note.active:
                self._hello()
        elif isinstance(note, Hello):
            now = time.monotonic_ns()
            self.send_to(sender, Answer(note.seq, now - note.sent_ns, now))
        elif isinstance(note, Answer):
            self._answered(sender, note)
        else:
            super().react(sender, note)

    def _hello(self) -> None:
        plan = self.plan
        assert plan is not None
        rng = self.__dict__.get("_v_rng") or random.Random(plan.seed + self.exchanges)
        self._v_rng = rng
        pool = plan.mates if (rng.random() < plan.inside or not plan.others) else plan.others
        peer = rng.choice(pool) if pool else self.id
        self.send_to(peer, Hello(self.exchanges, time.monotonic_ns(), b"x" * plan.payload))

    def _answered(self, sender: AgentId, note: Answer) -> None:
        plan = self.plan
        assert plan is not None and self.coordinator is not None
        now = time.monotonic_ns()
        legs = self.__dict__.setdefault("_v_legs", [])
        if self.exchanges >= plan.warmup:
            if not self.__dict__.get("_v_first"):
                self._v_first = time.time_ns()
            legs.append((note.hello_ns, now - note.sent_ns, sender in self.mate_set))
        self.exchanges += 1
        if self.exchanges < plan.count + plan.warmup:
            self._hello()
        else:
            last = time.time_ns()
            first = self.__dict__.get("_v_first") or last
            self.send_to(self.coordinator, Done(self.id.server, list(legs), first, last))


class Coordinator(Agent):
    """On server 0: deploys the talkers, hands out the plan, writes the result file."""

    def __init__(
        self,
        groups: dict[int, int],
        inside: float,
        count: int,
        warmup: int,
        out: str,
        seed: int = 0,
        payload: int = 0,
        active: list[int] | None = None,
    ) -> None:
        super().__init__("coordinator")
        self.groups = groups  # server id -> group number
        self.inside = inside
        self.count = count
        self.warmup = warmup
        self.out = out
        self.seed = seed
        self.payload = payload
        #: Servers whose talker drives exchanges (default: all).
        self.active = sorted(groups) if active is None else sorted(active)
        self.talkers: dict[int, AgentId] = {}
        self.done: dict[int, Done] = {}

    def on_init(self, first_time: bool) -> None:
        if first_time:
            # deploy() returns the id at once, and causal order delivers each plan after its
            # talker's creation: no need to wait for replies.
            for server in sorted(self.groups):
                self.talkers[server] = Talker().deploy(server)
            self._start()

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Done):
            self.done[note.server] = note
            if len(self.done) == len(self.active):
                self._write()
        else:
            super().react(sender, note)

    def _start(self) -> None:
        talkers = sorted(self.talkers.items())
        for server, talker in talkers:
            group = self.groups[server]
            mates = [t for s, t in talkers if s != server and self.groups[s] == group]
            others = [t for s, t in talkers if self.groups[s] != group]
            seed = self.seed + server
            plan = Plan(mates, others, self.inside, self.count, self.warmup, seed, self.payload)
            plan.active = server in self.active
            self.send_to(talker, plan)

    def _write(self) -> None:
        legs = [leg for done in self.done.values() for leg in done.legs]
        result = {
            "servers": len(self.groups),
            "active": len(self.active),
            "exchanges": len(legs),
            "legs_ns": legs,
            "window_ns": [
                min(d.first_ns for d in self.done.values()),
                max(d.last_ns for d in self.done.values()),
            ],
        }
        path = Path(self.out)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)


def groups_service(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service deploying the :class:`Coordinator` configured by ``args`` (JSON), once."""
    if first_time:
        spec = json.loads(args)
        spec["groups"] = {int(k): v for k, v in spec["groups"].items()}
        Coordinator(**spec).deploy()
