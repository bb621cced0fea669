"""Topics over an in-process bus of real servers (TCP on 127.0.0.1, in-memory stores)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from aaabus import (
    Agent,
    AgentId,
    AgentServer,
    ExceptionNotification,
    Notification,
    Publication,
)
from aaabus.config.reader import load_config
from aaabus.config.scopes import Scope
from aaabus.errors import ConfigError
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.topicload import Do, TopicProbe
from tests.support.topics import (
    agent_attr,
    inprocess,
    layout_config,
    remote_filters,
    retained_topics,
    wait_interest,
    wait_until,
)

# Two domains joined by router 1: D0 = {0, 1}, D1 = {1, 2}.
LINE = [[0, 1], [1, 2]]


def received(bus: object, agent: AgentId) -> list[tuple[str, object, tuple[str, ...], bool]]:
    return agent_attr(bus[agent.server], agent, "received")  # type: ignore[index]


def test_each_subscription_gets_each_matching_publication_once_across_a_router(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, LINE) as bus:
        # Overlapping filters on one agent: one delivery naming both filters.
        both = bus[2].deploy(TopicProbe("both", ["site/+/temp", "site/#"]))
        temps = bus[1].deploy(TopicProbe("temps", ["site/+/temp"]))
        local = bus[0].deploy(TopicProbe("local", ["site/3/#"]))
        wait_interest(bus, {"site/+/temp": {1, 2}, "site/#": {2}, "site/3/#": {0}})
        publisher = bus[0].deploy(TopicProbe("pub"))
        for topic, payload in [("site/3/temp", 1), ("site/4/temp", 2), ("site/3/wind", 3)]:
            bus[0].send(publisher, Do("publish", topic, payload))
        wait_until("both got 3", lambda: len(received(bus, both)) >= 3)
        wait_until("local got 2", lambda: len(received(bus, local)) >= 2)
        assert received(bus, both) == [
            ("site/3/temp", 1, ("site/#", "site/+/temp"), False),
            ("site/4/temp", 2, ("site/#", "site/+/temp"), False),
            ("site/3/wind", 3, ("site/#",), False),
        ]
        assert received(bus, temps) == [
            ("site/3/temp", 1, ("site/+/temp",), False),
            ("site/4/temp", 2, ("site/+/temp",), False),
        ]
        assert received(bus, local) == [
            ("site/3/temp", 1, ("site/3/#",), False),
            ("site/3/wind", 3, ("site/3/#",), False),
        ]


def sent_remote(bus: object, sid: int) -> int:
    return int(bus[sid].status()["messages"]["sent_remote"])  # type: ignore[index]


def test_a_publication_crosses_each_link_once_whatever_the_number_of_subscribers(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, LINE) as bus:
        subscribers = [bus[2].deploy(TopicProbe(f"s{i}", ["news/#"])) for i in range(5)]
        wait_interest(bus, {"news/#": {2}})
        publisher = bus[0].deploy(TopicProbe("pub"))
        before = {sid: sent_remote(bus, sid) for sid in (0, 1, 2)}
        bus[0].send(publisher, Do("publish", "news/today", "x"))
        for sub in subscribers:
            wait_until("delivered", functools.partial(received, bus, sub))
        after = {sid: sent_remote(bus, sid) for sid in (0, 1, 2)}
        # s0 -> s1 once, s1 -> s2 once: five subscribers, one message per link.
        assert {sid: after[sid] - before[sid] for sid in after} == {0: 1, 1: 1, 2: 0}


def test_retained_publications_go_to_later_subscriptions_and_none_clears_them(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, LINE) as bus:
        publisher = bus[0].deploy(TopicProbe("pub"))
        bus[0].send(publisher, Do("publish", "cfg/mode", "eco", retain=True))
        bus[0].send(publisher, Do("publish", "cfg/level", 3, retain=True))
        bus[0].send(publisher, Do("publish", "cfg/level", None, retain=True))  # cleared
        bus[0].send(publisher, Do("publish", "cfg/fan", "on"))  # not retained
        bus[0].send(publisher, Do("publish", "end", "mark", retain=True))  # the last one
        wait_until(
            "retained copies reached s2",
            lambda: retained_topics(bus[2]) == ["cfg/mode", "end"],
        )
        late = bus[2].deploy(TopicProbe("late", ["cfg/+"]))
        wait_until("late got the retained one", lambda: received(bus, late))
        assert received(bus, late) == [("cfg/mode", "eco", ("cfg/+",), True)]


class Declared(TopicProbe):
    """Subscribed by its class: the subscription is sent with the creation request."""

    subscriptions: ClassVar[tuple[str, ...]] = ("alarm/#",)


def test_subscriptions_declared_by_the_class_start_with_the_deploy(tmp_path: Path) -> None:
    with inprocess(tmp_path, LINE) as bus:
        publisher = bus[2].deploy(TopicProbe("pub"))
        declared = bus[2].deploy(Declared("declared"))
        # Published through the same server right after the deploy: already subscribed.
        bus[2].send(publisher, Do("publish", "alarm/fire", "!"))
        wait_until("declared got it", lambda: received(bus, declared))
        assert received(bus, declared) == [("alarm/fire", "!", ("alarm/#",), False)]


def test_unsubscribing_the_last_subscriber_withdraws_the_interest_everywhere(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, LINE) as bus:
        sub = bus[2].deploy(TopicProbe("sub", ["x/#"]))
        wait_interest(bus, {"x/#": {2}})
        bus[2].send(sub, Do("unsubscribe", "x/#"))
        wait_interest(bus, {})
        assert bus[2].status()["topics"]["filters"] == 0
        assert remote_filters(bus[0]) == {}


class Catcher(Agent):
    """Deploys a probe told to subscribe with a bad filter; keeps the error report."""

    def __init__(self) -> None:
        super().__init__("catcher")
        self.errors: list[str] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, ExceptionNotification):
            self.errors = [*self.errors, f"{note.error_type}: {note.error_message}"]
        elif isinstance(note, Do):
            self.send_to(AgentId.parse(str(note.payload)), Do("subscribe", note.topic))
        else:
            super().react(sender, note)


def test_a_bad_filter_fails_the_reaction_with_a_one_line_topic_error(tmp_path: Path) -> None:
    with inprocess(tmp_path, [[0]]) as bus:
        probe = bus[0].deploy(TopicProbe("probe"))
        catcher = bus[0].deploy(Catcher())
        bus[0].send(catcher, Do("forward", "a/#/b", str(probe)))
        errors = wait_until("error reported", lambda: agent_attr(bus[0], catcher, "errors"))
        assert errors == [
            "TopicError: topic filter 'a/#/b': # must be the last level (e.g. site/#)"
        ]
        assert bus[0].status()["topics"]["filters"] == 0


def test_a_mailbox_keeps_the_newest_items_at_its_limit_and_counts_the_dropped(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, [[0]], {"aaabus.topics.backlog": "3"}) as bus:
        desk = bus[0].mailboxes
        assert desk.open("slow", "m/#", None, Scope.OPERATE) is False
        # The same name and filter: resumed.
        assert desk.open("slow", "m/#", None, Scope.OPERATE) is True
        publisher = bus[0].deploy(TopicProbe("pub"))
        for i in range(5):
            bus[0].send(publisher, Do("publish", "m/x", i))
        answer = wait_until(
            "five went through the mailbox",
            lambda: (a := desk.fetch("slow", 0, 10, 0.0, Scope.OPERATE))["dropped"] == 2 and a,
        )
        assert [seq for seq, _body in answer["items"]] == [3, 4, 5]
        # Acknowledging 4 leaves 5; nothing above 5 yet.
        assert [seq for seq, _ in desk.fetch("slow", 4, 10, 0.0, Scope.OPERATE)["items"]] == [5]
        assert desk.fetch("slow", 5, 10, 0.0, Scope.OPERATE)["items"] == []


def test_a_waiting_fetch_is_woken_by_the_next_publication(tmp_path: Path) -> None:
    with inprocess(tmp_path, [[0]]) as bus:
        desk = bus[0].mailboxes
        desk.open("waiter", "w", None, Scope.OPERATE)
        publisher = bus[0].deploy(TopicProbe("pub"))
        answers: list[dict[str, object]] = []
        waiter = threading.Thread(
            target=lambda: answers.append(desk.fetch("waiter", 0, 10, 10.0, Scope.OPERATE)),
            name="test-fetch",
        )
        started = time.monotonic()
        waiter.start()
        bus[0].send(publisher, Do("publish", "w", "wake up"))
        waiter.join(15)
        assert answers and len(answers[0]["items"]) == 1  # type: ignore[arg-type]
        assert time.monotonic() - started < 9, "the fetch waited for its deadline: no wake-up"


def test_subscriptions_survive_restarts_and_reach_a_server_added_later(tmp_path: Path) -> None:
    stores = tmp_path / "stores"
    with InProcessBus(
        layout_config(tmp_path, [[0, 1]]), store_kind="file", storage_root=stores
    ) as bus:
        sub = bus[1].deploy(TopicProbe("sub", ["a/#"]))
        wait_interest(bus, {"a/#": {1}})
    # A new domain {1, 2}: server 2 is new, server 1 becomes its router; same stores.
    config = layout_config(tmp_path, [[0, 1], [1, 2]])
    with InProcessBus(config, store_kind="file", storage_root=stores) as bus:
        assert bus[0].status()["topics"]["remote_subscriptions"] == 1  # kept in s0's store
        # s1's representative got the new routes at boot and told the newcomer its filter.
        wait_interest(bus, {"a/#": {1}})
        publisher = bus[2].deploy(TopicProbe("pub"))
        bus[2].send(publisher, Do("publish", "a/b", "from the new server"))
        wait_until("delivered", functools.partial(received, bus, sub))
        assert received(bus, sub) == [("a/b", "from the new server", ("a/#",), False)]


def test_a_stopping_server_releases_the_fetches_waiting_on_its_mailboxes(tmp_path: Path) -> None:
    with inprocess(tmp_path, [[0]]) as bus:
        desk = bus[0].mailboxes
        desk.open("idle", "nothing/comes", None, Scope.OPERATE)
        answers: list[dict[str, object]] = []
        waiter = threading.Thread(
            target=lambda: answers.append(desk.fetch("idle", 0, 10, 10.0, Scope.OPERATE)),
            name="test-fetch",
        )
        started = time.monotonic()
        waiter.start()
        desk.set_stopping(True)  # what AgentServer.stop() does first
        waiter.join(15)
        assert answers and answers[0]["items"] == []
        assert time.monotonic() - started < 9, "the waiting fetch was not released"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ("{oops", "args is not JSON"),
        ('{"retain": {"a/#": 1}}', "topic name 'a/#' contains a wildcard"),
        ('{"mailboxes": {"ops": "a/#/b"}}', "# must be the last level"),
        ('{"subscribe": []}', 'with "retain" and/or "mailboxes"'),
    ],
)
def test_a_bad_topic_declaration_stops_the_boot_with_one_line(
    tmp_path: Path, make_config: Callable[..., Path], args: str, says: str
) -> None:
    service = f"<service class=\"aaabus.topics.declare:declare\" args='{args}'/>"
    server = AgentServer(load_config(make_config(extra={0: service})), 0, storage=tmp_path / "s0")
    with pytest.raises(ConfigError) as caught:
        server.start()
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert server.store is None  # nothing left open


@dataclass
class Burst(Notification):
    """Make a :class:`Burster` publish ``count`` publications on ``topic`` in one reaction; with
    ``own``, subscribe to ``topic`` first, in the same reaction."""

    topic: str
    count: int
    own: bool = False


class Burster(Agent):
    """Publishes bursts; records what it receives, with the sender of each publication."""

    def __init__(self) -> None:
        super().__init__("burster")
        self.got: list[tuple[str, object]] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Burst):
            if note.own:
                self.subscribe(note.topic)
            for k in range(note.count):
                self.publish(note.topic, k)
        elif isinstance(note, Publication):
            self.got = [*self.got, (str(sender), note.payload)]
        else:
            super().react(sender, note)


def test_a_burst_of_publications_crosses_each_link_as_one_message(tmp_path: Path) -> None:
    with inprocess(tmp_path, LINE) as bus:
        far = bus[2].deploy(TopicProbe("far", ["burst/#"]))
        near = bus[1].deploy(TopicProbe("near", ["burst/#"]))
        wait_interest(bus, {"burst/#": {1, 2}})
        publisher = bus[0].deploy(Burster())
        before = {sid: sent_remote(bus, sid) for sid in (0, 1, 2)}
        bus[0].send(publisher, Burst("burst/x", 20))
        for sub in (far, near):
            wait_until("all 20", functools.partial(_at_least, bus, sub, 20))
        after = {sid: sent_remote(bus, sid) for sid in (0, 1, 2)}
        # Twenty publications of one reaction: one message s0 -> s1 and one s1 -> s2.
        assert {sid: after[sid] - before[sid] for sid in after} == {0: 1, 1: 1, 2: 0}
        for sub in (far, near):
            assert [payload for _, payload, _, _ in received(bus, sub)] == list(range(20))


def test_a_subscription_made_in_a_reaction_gets_that_reactions_publications(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, [[0]]) as bus:
        publisher = bus[0].deploy(Burster())
        # Subscribe, then publish, in one reaction: the representative handles both there and
        # then, in that order, so the subscription is in force for the publications after it.
        bus[0].send(publisher, Burst("own/t", 3, own=True))
        got = wait_until("own publications", lambda: _three(agent_attr(bus[0], publisher, "got")))
        rep = str(AgentId.topics_of(0))
        assert got == [(rep, 0), (rep, 1), (rep, 2)]  # sent by the representative, in order
        assert bus[0].status()["topics"]["filters"] == 1


def _at_least(bus: InProcessBus, sub: AgentId, n: int) -> bool | None:
    return len(received(bus, sub)) >= n or None


def _three(got: list[tuple[str, object]]) -> list[tuple[str, object]] | None:
    return got if len(got) >= 3 else None


@dataclass
class SubscribeThenFail(Notification):
    """Make a :class:`Burster` subscribe to ``topic``, publish on it, then raise."""

    topic: str


class Fickle(Burster):
    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, SubscribeThenFail):
            self.subscribe(note.topic)
            self.publish(note.topic, "lost")
            raise RuntimeError("rolled back, subscription included")
        super().react(sender, note)


def test_what_the_representative_matched_follows_subscriptions_and_their_rollbacks(
    tmp_path: Path,
) -> None:
    with inprocess(tmp_path, [[0]]) as bus:
        fickle = bus[0].deploy(Fickle())
        publisher = bus[0].deploy(Burster())
        # Matched (and remembered) while the subscription existed, then rolled back with it.
        bus[0].send(fickle, SubscribeThenFail("m/t"))
        bus[0].send(publisher, Burst("m/t", 1))
        late = bus[0].deploy(TopicProbe("late", ["m/t"]))  # a new subscription: matched anew
        bus[0].send(publisher, Burst("m/t", 2))
        got = wait_until("late got 2", lambda: _full(received(bus, late), 2))
        assert [payload for _, payload, _, _ in got] == [0, 1]
        assert agent_attr(bus[0], fickle, "got") == []
        assert bus[0].status()["topics"]["filters"] == 1


def _full(got: list[Any], n: int) -> list[Any] | None:
    return got if len(got) >= n else None


class Mutator(TopicProbe):
    """Records a copy of each publication's payload (a list) as received, then changes the
    payload in place."""

    def __init__(self, label: str, filters: Sequence[str] = ()) -> None:
        super().__init__(label, filters)
        self.seen: list[list[str]] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Publication):
            self.seen = [*self.seen, list(note.payload)]
            note.payload.append("changed by " + self.name)
        super().react(sender, note)


def test_a_subscriber_that_changes_its_payload_changes_nobody_elses(tmp_path: Path) -> None:
    with inprocess(tmp_path, [[0, 1]]) as bus:
        first = bus[1].deploy(Mutator("first", ["p/#"]))
        second = bus[1].deploy(Mutator("second", ["p/#"]))
        alone = bus[1].deploy(Mutator("alone", ["q/#"]))
        wait_interest(bus, {"p/#": {1}, "q/#": {1}})
        publisher = bus[0].deploy(TopicProbe("pub"))
        bus[0].send(publisher, Do("publish", "p/t", ["x"]))  # two subscribers on s1
        bus[0].send(publisher, Do("publish", "q/t", ["y"], retain=True))  # one, and retained
        for sub in (first, second, alone):
            wait_until("delivered", functools.partial(_at_least, bus, sub, 1))
        late = bus[1].deploy(TopicProbe("late", ["q/#"]))
        wait_until("retained copy", functools.partial(_at_least, bus, late, 1))
        assert agent_attr(bus[1], first, "seen") == [["x"]]
        assert agent_attr(bus[1], second, "seen") == [["x"]]
        assert agent_attr(bus[1], alone, "seen") == [["y"]]
        # The one subscriber of a relayed publication got the object itself (handed over): it
        # changed it, but the retained copy kept by the representative is intact.
        assert received(bus, late) == [("q/t", ["y"], ("q/#",), True)]


@dataclass
class PublishThenChange(Notification):
    """Make a :class:`Changer` publish ``payload`` on ``topic``, then change it in place."""

    topic: str
    payload: list[str]


class Changer(Agent):
    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, PublishThenChange):
            self.publish(note.topic, note.payload)
            note.payload.append("changed after publishing")
        else:
            super().react(sender, note)


def test_a_publisher_that_changes_its_payload_after_publishing_changes_no_delivery(
    tmp_path: Path,
) -> None:
    # One subscriber on the publisher's own server: a payload the publisher may still change
    # (a list) is never handed over as an object; bytes, which nobody can change, are.
    with inprocess(tmp_path, [[0, 1]]) as bus:
        sub = bus[0].deploy(TopicProbe("sub", ["c/#"]))
        wait_interest(bus, {"c/#": {0}})
        publisher = bus[0].deploy(Changer("changer"))
        bus[0].send(publisher, PublishThenChange("c/t", ["x"]))
        wait_until("delivered", functools.partial(_at_least, bus, sub, 1))
        assert received(bus, sub) == [("c/t", ["x"], ("c/#",), False)]


@dataclass
class PublishThenFail(Notification):
    """Make a :class:`Regretful` publish ``payload`` on ``topic``, then raise."""

    topic: str
    payload: object


class Regretful(Burster):
    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, PublishThenFail):
            self.publish(note.topic, note.payload)
            raise RuntimeError("rolled back, its relay included")
        super().react(sender, note)


def test_a_relay_gathered_by_a_reaction_that_fails_never_leaves(tmp_path: Path) -> None:
    with inprocess(tmp_path, LINE) as bus:
        far = bus[2].deploy(TopicProbe("far", ["r/#"]))
        wait_interest(bus, {"r/#": {2}})
        publisher = bus[0].deploy(Regretful())
        bus[0].send(publisher, PublishThenFail("r/t", "never"))
        bus[0].send(publisher, Burst("r/t", 1))
        got = wait_until("the good one", lambda: _full(received(bus, far), 1))
        assert [payload for _, payload, _, _ in got] == [0]
