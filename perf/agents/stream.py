"""One-way stream agents: a :class:`Producer` pours ``count`` notifications into a
:class:`Consumer`, which writes the end-to-end rate when the last one is in.

Timestamps use ``time.monotonic_ns`` (CLOCK_MONOTONIC, shared by every process of the machine), so
the consumer can compare its clock with the producer's start.

With a ``window`` (> 0), the stream is flow-controlled: the consumer returns a :class:`Credit`
every ``window // 2`` items and the producer never has more than ``window`` items unconsumed,
so a stream of any length holds a bounded backlog (the open-loop default pours as fast as the
producer's server can commit, and a slower consumer's backlog grows without bound).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aaabus import Agent, AgentCreateReply, AgentId, BootContext, Notification


@dataclass
class Item(Notification):
    seq: int
    payload: bytes = b""


@dataclass
class Pour(Notification):
    """Producer to itself: send the next burst."""

    started_ns: int


@dataclass
class Started(Notification):
    started_ns: int


@dataclass
class Credit(Notification):
    """Consumer to producer: items received so far (windowed streams only)."""

    received: int


class Consumer(Agent):
    def __init__(self, count: int, out: str, window: int = 0) -> None:
        super().__init__("consumer")
        self.count = count
        self.out = out
        self.window = window
        self.received = 0
        self.out_of_order = 0
        self.started_ns = 0
        self.producer: AgentId | None = None

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Started):
            self.started_ns = note.started_ns
            self.producer = sender
        elif isinstance(note, Item):
            if note.seq != self.received:
                self.out_of_order += 1
            self.received += 1
            if self.window and self.producer and self.received % max(1, self.window // 2) == 0:
                self.send_to(self.producer, Credit(self.received))
            if self.received == self.count:
                elapsed = (time.monotonic_ns() - self.started_ns) / 1e9
                result = {
                    "count": self.received,
                    "out_of_order": self.out_of_order,
                    "seconds": elapsed,
                    "msgs_per_s": self.received / elapsed,
                }
                path = Path(self.out)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(result))
                os.replace(tmp, path)
        else:
            super().react(sender, note)


class Producer(Agent):
    """Sends ``count`` items, ``burst`` per reaction, to a consumer it deploys on ``server``."""

    def __init__(
        self,
        server: int,
        count: int,
        out: str,
        burst: int = 200,
        payload: int = 0,
        window: int = 0,
    ) -> None:
        super().__init__("producer")
        self.server = server
        self.count = count
        self.burst = burst
        self.payload = payload
        self.out = out
        self.window = window
        self.sent = 0
        self.acked = 0
        #: Windowed: no Pour in flight, the window is full; the next Credit restarts pouring.
        self.stalled = False
        self.started_ns = 0

    def on_init(self, first_time: bool) -> None:
        if first_time:
            consumer = Consumer(self.count, self.out, self.window)
            self.consumer = consumer.deploy(self.server, reply=True)

    def _limit(self) -> int:
        """How far the next burst may go: the count, and with a window the consumer's credit."""
        end = min(self.count, self.sent + self.burst)
        return min(end, self.acked + self.window) if self.window else end

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, AgentCreateReply):
            started = time.monotonic_ns()
            self.send_to(self.consumer, Started(started))
            self.send_to(self.id, Pour(started))
        elif isinstance(note, Pour):
            payload = b"x" * self.payload
            end = self._limit()
            for seq in range(self.sent, end):
                self.send_to(self.consumer, Item(seq, payload))
            self.sent = end
            if self.sent < self.count:
                if self._limit() > self.sent:
                    self.send_to(self.id, note)
                else:
                    self.stalled = True
                    self.started_ns = note.started_ns
        elif isinstance(note, Credit):
            self.acked = max(self.acked, note.received)
            if self.stalled and self._limit() > self.sent:
                self.stalled = False
                self.send_to(self.id, Pour(self.started_ns))
        else:
            super().react(sender, note)


def stream_service(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service deploying a :class:`Producer` configured by ``args`` (JSON), once."""
    if first_time:
        Producer(**json.loads(args)).deploy()
