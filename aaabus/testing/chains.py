"""Scripted causal chains, for the theorem tests: one exact pattern of messages.

A :class:`Scribe` records the same vector-clock history as a
:class:`~aaabus.testing.workload.Gossiper` (so the independent checker judges it alike), but its
sends follow a script (:class:`Fire`) instead of a random walk.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaabus import AgentId, Notification
from aaabus.testing.workload import Gossiper, merge_and_tick


@dataclass
class Chain(Notification):
    """A recorded message; on delivery the receiver passes a new one along ``then``."""

    mid: str
    vc: dict[str, int]
    then: list[tuple[str, AgentId]]


@dataclass
class Fire(Notification):
    """Send, in this order, one :class:`Chain` per ``(label, id, then)``."""

    plan: list[tuple[str, AgentId, list[tuple[str, AgentId]]]]


class Scribe(Gossiper):
    """A :class:`Gossiper` (same recorded history, same checker) whose sends follow a script
    instead of a random walk: the theorem needs one exact pattern of messages."""

    def _chain(self, name: str, dest: AgentId, then: list[tuple[str, AgentId]]) -> None:
        mid, vc = self._record_send(name)
        self.send_to(dest, Chain(mid, vc, then))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Fire):
            self._tick()
            for name, dest, then in note.plan:
                self._chain(name, dest, then)
        elif isinstance(note, Chain):
            self.delivered.append(note.mid)
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            if note.then:
                name, dest = note.then[0]
                self._chain(name, dest, note.then[1:])
        else:
            super().react(sender, note)
