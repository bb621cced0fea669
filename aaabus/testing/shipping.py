"""A stream of bulky parcels, to fill a small disk: the disk-full tests' workload.

A :class:`Shipper` sends numbered :class:`Parcel` notifications to a :class:`Depot`, which counts
them (once each, in order) and writes its count to a file at the end; ``hoard`` keeps every
parcel so that the live data grows. Loaded by name from the config
(``<service class="aaabus.testing.shipping:shipping_setup" .../>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from BTrees.OOBTree import OOBTree
from persistent import Persistent

from aaabus import Agent, AgentId, BootContext, Notification


@dataclass
class Parcel(Notification):
    i: int
    pad: bytes


@dataclass
class Ship(Notification):
    pass


class Kept(Persistent):
    """One hoarded parcel's padding: a record of its own."""

    def __init__(self, pad: bytes) -> None:
        self.pad = pad


class Depot(Agent):
    """Counts parcels, checking they come once each and in order; writes ``done`` at ``n``.
    ``hoard``: keep every parcel (each its own record), so that the live data grows: a store
    that reclaims superseded records (the log store) fills its disk only that way."""

    def __init__(self, n: int, done: str, hoard: bool = False) -> None:
        super().__init__("depot")
        self.n = n
        self.done = done
        self.count = 0
        self.errors = 0
        self.kept = b""
        self.hoard: OOBTree | None = OOBTree() if hoard else None

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Parcel):
            if note.i == self.count + 1:
                self.count += 1
            else:
                self.errors += 1
            # Keeping the parcel's padding makes every commit on this server write its size
            # again (FileStorage appends a new revision of the agent): the disk fills.
            self.kept = note.pad
            if self.hoard is not None:
                self.hoard[note.i] = Kept(note.pad)
            if self.count == self.n:
                target = Path(self.done)
                tmp = target.with_suffix(".tmp")
                tmp.write_text(json.dumps({"count": self.count, "errors": self.errors}))
                tmp.replace(target)
        else:
            super().react(sender, note)


class Shipper(Agent):
    """Sends ``Parcel(1..n)`` of ``size`` bytes each to ``depot``, ``burst`` per reaction."""

    def __init__(self, depot: AgentId, n: int, size: int, burst: int = 4) -> None:
        super().__init__("shipper")
        self.depot = depot
        self.n = n
        self.size = size
        self.burst = burst
        self.sent = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Ship):
            for _ in range(self.burst):
                if self.sent < self.n:
                    self.sent += 1
                    self.send_to(self.depot, Parcel(self.sent, bytes(self.size)))
            if self.sent < self.n:
                self.send_to(self.id, Ship())
        else:
            super().react(sender, note)


def shipping_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service of the shipping server: a depot on ``depot_server`` and a shipper here."""
    if first_time:
        spec = json.loads(args)
        depot = Depot(spec["n"], spec["done"], spec.get("hoard", False)).deploy(
            spec["depot_server"]
        )
        shipper = Shipper(depot, spec["n"], spec["size"]).deploy()
        ctx.send(shipper, Ship())
