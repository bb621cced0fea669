"""The agent of ``python -m perf failover``'s ping-pong: it lives on the server whose primary is
killed, and answers each :class:`Ping` by publishing a pong that a device on another server
reads.

Its vector clock is part of its persistent state: a reaction the new primary replays (the old
one died before the commit was durable) computes the same clock again, so a replayed pong has
the same message id and a second copy of it is a duplicate, while two pongs of one ping (the
ping delivered twice) have two different ids, each naming the ping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aaabus import Agent, AgentId, Notification
from aaabus.testing.workload import merge_and_tick


@dataclass
class Ping(Notification):
    """Ping ``mid``, sent by the pinger at an event whose vector clock is ``vc``."""

    mid: str
    vc: dict[str, int] = field(default_factory=dict)


class Ponger(Agent):
    """Publishes on ``topic``, for every :class:`Ping`, a JSON pong: its own message id, the
    ping's, and its clock after delivering the ping (one event per reaction)."""

    def __init__(self, label: str, topic: str) -> None:
        super().__init__(label)
        self.topic = topic
        self.vc: dict[str, int] = {}

    def react(self, sender: AgentId, note: Notification) -> None:
        if not isinstance(note, Ping):
            super().react(sender, note)
            return
        self.vc = merge_and_tick(self.vc, note.vc, self.name)
        pong = {
            "mid": f"{self.name}-{self.vc[self.name]}",
            "from": self.name,
            "vc": self.vc,
            "ping": note.mid,
        }
        self.publish(self.topic, json.dumps(pong, sort_keys=True))
