"""Agents of the topic workloads, shipped so that a bus's processes can load them by name.

* :class:`TopicProbe` publishes, subscribes and unsubscribes on command and records every
  :class:`~aaabus.Publication` it receives (tests of matching, retained and durable delivery);
* :class:`CausalPeer` publishes on random topics, subscribes to its filters and republishes some
  of what it receives, recording its vector-clock history for the independent checker
  (:mod:`aaabus.testing.checker`) as :func:`check_topics` expects it.

Histories are appended in the reaction's own transaction: they are exactly what the bus
committed, replays included.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aaabus import Agent, AgentId, Notification, PersistentList
from aaabus.model.pubsub import Publication
from aaabus.model.topicnames import matches
from aaabus.testing.checker import Report, Send, check
from aaabus.testing.workload import merge_and_tick


@dataclass
class Do(Notification):
    """Ask a :class:`TopicProbe` to publish (``payload`` on ``topic``), or to (un)subscribe."""

    action: str  # "publish", "subscribe", "unsubscribe" or "report"
    topic: str
    payload: Any = None
    retain: bool = False


@dataclass
class Received(Notification):
    """A :class:`TopicProbe`'s answer to ``Do("report", "")``: what it received so far."""

    items: list[tuple[str, Any, tuple[str, ...], bool]]


class TopicProbe(Agent):
    """Subscribes to ``filters`` at creation; records ``(topic, payload, filters, retained)``
    and sends the records back on ``Do("report", "")`` (a request/reply)."""

    def __init__(self, label: str, filters: Sequence[str] = ()) -> None:
        super().__init__(label)
        self.filters = tuple(filters)
        self.received: PersistentList = PersistentList()

    def on_init(self, first_time: bool) -> None:
        if first_time:
            for topic_filter in self.filters:
                self.subscribe(topic_filter)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Publication):
            self.received.append((note.topic, note.payload, note.filters, note.retained))
        elif isinstance(note, Do):
            if note.action == "publish":
                self.publish(note.topic, note.payload, retain=note.retain)
            elif note.action == "subscribe":
                self.subscribe(note.topic)
            elif note.action == "report":
                self.send_to(sender, Received(list(self.received)))
            else:
                self.unsubscribe(note.topic)
        else:
            super().react(sender, note)


#: Topics the causal workloads publish on, and filters their peers draw theirs from: every
#: level of wildcard, overlapping (``#``, ``t/#`` and ``t/+`` all match ``t/a``), so that one
#: subscriber often matches one publication through several of its filters.
TOPICS = ("t/a", "t/b", "u/c", "u/d/e", "v")
FILTERS = ("t/#", "t/+", "+/c", "u/#", "#", "u/d/+", "t/a", "v")

#: One peer's record: label, filters, publications ``(mid, topic, vc)``, deliveries (mids).
History = tuple[str, tuple[str, ...], list[tuple[str, str, dict[str, int]]], list[str]]


@dataclass
class Tell(Notification):
    """Ask a :class:`CausalPeer` for its history (it answers :class:`Told`): how a test reads
    the peers of server processes, with :meth:`aaabus.Client.request`."""


@dataclass
class Told(Notification):
    history: History


@dataclass
class Start(Notification):
    """Ask a :class:`CausalPeer` to publish ``count`` publications carrying ``ttl``."""

    count: int
    ttl: int


class CausalPeer(Agent):
    """A publisher and subscriber of a causal workload (see the module docstring).

    The vector clock is the checker's: +1 for each publication (one event, whoever receives it)
    and each delivery, merged with the publication's on delivery. A delivered publication with
    ``ttl > 0`` is republished, on a topic drawn from ``topics``, with probability ``echo`` —
    the causal chains across publishers, topics and servers that the contract is about.
    """

    def __init__(
        self, label: str, seed: int, filters: Sequence[str], topics: Sequence[str], echo: float
    ) -> None:
        super().__init__(label)
        self.label = label
        self.seed = seed
        self.filters = tuple(filters)
        self.topics = tuple(topics)
        self.echo = echo
        self.vc: dict[str, int] = {}
        self.n = 0
        self.starts = 0  # Start orders handled: a harness sending them counts them too
        self.published: PersistentList = PersistentList()  # (mid, topic, vc)
        self.delivered: PersistentList = PersistentList()  # mid, in delivery order

    def on_init(self, first_time: bool) -> None:
        if first_time:
            for topic_filter in self.filters:
                self.subscribe(topic_filter)

    def _rng(self) -> random.Random:
        # Seeded by the agent's own counter: a replayed reaction draws the same numbers.
        return random.Random(f"{self.seed}:{self.label}:{self.n}:{len(self.delivered)}")

    def _publish(self, ttl: int, rng: random.Random) -> None:
        vc = dict(self.vc)
        vc[self.label] = vc.get(self.label, 0) + 1
        self.vc = vc
        mid = f"{self.label}#{self.n}"
        self.n += 1
        topic = self.topics[rng.randrange(len(self.topics))]
        self.published.append((mid, topic, dict(vc)))
        self.publish(topic, {"mid": mid, "vc": dict(vc), "ttl": ttl})

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Start):
            self.starts += 1
            rng = self._rng()
            for _ in range(note.count):
                self._publish(note.ttl, rng)
        elif isinstance(note, Publication):
            body = note.payload
            self.delivered.append(body["mid"])
            self.vc = merge_and_tick(self.vc, body["vc"], self.label)
            rng = self._rng()
            if body["ttl"] > 0 and rng.random() < self.echo:
                self._publish(body["ttl"] - 1, rng)
        elif isinstance(note, Tell):
            self.send_to(sender, Told(history_of(self)))
        else:
            super().react(sender, note)


def history_of(peer: CausalPeer) -> History:
    """What :func:`check_topics` needs of one peer (read it on the peer's engine thread)."""
    return (
        peer.label,
        peer.filters,
        [(mid, topic, dict(vc)) for mid, topic, vc in peer.published],
        list(peer.delivered),
    )


def expected_deliveries(histories: Iterable[History]) -> int:
    """How many deliveries the published publications owe to the subscribers."""
    peers = list(histories)
    return sum(
        1
        for _label, filters, _p, _d in peers
        for _o, _f, published, _dd in peers
        for _mid, topic, _vc in published
        if any(matches(f, topic) for f in filters)
    )


def check_topics(histories: Iterable[History]) -> dict[str, Report]:
    """Judge a topic history with the independent checker, one subscriber at a time.

    For subscriber S, each publication whose topic matches one of S's filters is a message from
    its publisher to S carrying the publisher's clock at the publication; the checker then finds
    lost and duplicated deliveries (exactly once per subscriber) and causal violations (S
    delivered p2 before p1 although p1 happened before p2). Checking subscribers one by one lets
    one publication be a single event (one clock tick) however many subscribers receive it, which
    is what the contract says; the checker wants each of a sender's messages to tick its clock.
    Returns the reports that are not ok, by subscriber.
    """
    peers = list(histories)
    bad: dict[str, Report] = {}
    for label, filters, _published, delivered in peers:
        sends = [
            Send(mid, publisher, label, vc)
            for publisher, _f, published, _d in peers
            for mid, topic, vc in published
            if any(matches(f, topic) for f in filters)
        ]
        report = check(sends, {label: delivered})
        if not report.ok:
            bad[label] = report
    return bad
