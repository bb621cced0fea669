"""Topic benchmark agents: a :class:`Blaster` publishes, :class:`Sink` s subscribe and time.

Open loop (throughput): the blaster publishes ``burst`` publications per reaction until done.
Paced (latency): the blaster publishes one, and the next only once every sink has answered the
previous one with :class:`Next`; the latencies are then those of an idle bus.

Each publication carries ``time.monotonic_ns()`` of the reaction that published it
(CLOCK_MONOTONIC is shared by every process of the machine), so a sink measures the latency
from the publishing reaction to its own reaction, commits and hops included. A sink keeps its
latencies in a volatile list (``_v_``: a benchmark's samples need not survive a crash, and
storing them would add to what is measured) and writes its result file when the last
publication is in.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from aaabus import Agent, AgentId, Notification, Publication


@dataclass
class Go(Notification):
    """Harness to blaster: publish ``count`` publications, ``burst`` per reaction; with
    ``acks`` > 0, one at a time, each after ``acks`` :class:`Next` for the previous one."""

    count: int
    burst: int = 50
    payload: int = 0
    acks: int = 0


@dataclass
class Next(Notification):
    """Paced runs: a sink to the publisher, after each publication."""


@dataclass
class Pour(Notification):
    """Blaster to itself: the next burst."""


class Blaster(Agent):
    def __init__(self) -> None:
        super().__init__("blaster")
        self.left = 0
        self.seq = 0
        self.burst = 50
        self.pad = b""
        self.acks = 0
        self.waiting = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Go):
            self.left, self.burst, self.pad = note.count, note.burst, b"x" * note.payload
            self.acks = note.acks
            if self.acks:
                self._publish(1)
            else:
                self.send_to(self.id, Pour())
        elif isinstance(note, Pour):
            self._publish(self.burst)
            if self.left:
                self.send_to(self.id, Pour())
        elif isinstance(note, Next):
            self.waiting -= 1
            if not self.waiting and self.left:
                self._publish(1)
        else:
            super().react(sender, note)

    def _publish(self, most: int) -> None:
        for _ in range(min(most, self.left)):
            body = {"seq": self.seq, "t": time.monotonic_ns(), "pad": self.pad}
            self.publish(f"perf/{self.seq % 10}", body)
            self.seq += 1
            self.left -= 1
        self.waiting = self.acks


class Sink(Agent):
    subscriptions: ClassVar[tuple[str, ...]] = ("perf/#",)

    def __init__(self, count: int, out: str, ack: bool = False) -> None:
        super().__init__("sink")
        self.count = count
        self.out = out
        self.ack = ack
        self.received = 0
        self.out_of_order = 0
        self.first_ns = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if not isinstance(note, Publication):
            super().react(sender, note)
            return
        now = time.monotonic_ns()
        body: dict[str, Any] = note.payload
        if body["seq"] != self.received:
            self.out_of_order += 1
        if not self.received:
            self.first_ns = body["t"]
        self.received += 1
        latencies: list[int] | None = getattr(self, "_v_latencies", None)
        if latencies is None:
            latencies = []
            self._v_latencies = latencies
        latencies.append(now - body["t"])
        if self.ack:
            self.send_to(note.publisher, Next())
        if self.received == self.count:
            result = {
                "count": self.received,
                "out_of_order": self.out_of_order,
                "first_ns": self.first_ns,
                "last_ns": now,
                "latencies_ns": latencies,
            }
            path = Path(self.out)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, path)
