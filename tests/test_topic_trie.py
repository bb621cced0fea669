"""The topic trie (aaabus.topics.trie) and the representative that matches with it.

The trie must select exactly what ``aaabus.model.topicnames.matches`` selects, both ways, keep no
empty branch, survive a store reopen, and a representative must route through it (including one
from a store written before the tries, which has none).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.config.trust import TrustPolicy
from aaabus.core import upgrades
from aaabus.core.store import open_store
from aaabus.model.context import running
from aaabus.model.ids import TOPICS_STAMP, AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication, Publish, Subscribe, Unsubscribe
from aaabus.model.topicnames import matches
from aaabus.testing.context import RecordingContext
from aaabus.topics.messages import InterestChange, Relay
from aaabus.topics.representative import TopicRepresentative
from aaabus.topics.trie import ENTRY, TopicTrie, TrieNode

LEVELS = ["a", "b", "", "$s", "cc"]
topics = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4).map("/".join).filter(bool)


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"


def nodes(trie: TopicTrie) -> int:
    """The nodes of ``trie`` below its root (an empty trie has none)."""
    stack: list[TrieNode] = [trie._root]
    count = 0
    while stack:
        node = stack.pop()
        children = [child for level, child in node.items() if level != ENTRY]
        count += len(children)
        stack.extend(children)
    return count


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(keys=st.lists(filters(), max_size=12, unique=True), topic=topics)
def test_match_finds_exactly_the_filters_that_select_the_topic(keys: list[str], topic: str) -> None:
    trie = TopicTrie()
    for i, key in enumerate(keys):
        trie.insert(key, i)
    found = trie.match(topic)
    assert sorted(found) == sorted((k, i) for i, k in enumerate(keys) if matches(k, topic))
    assert len(found) == len({key for key, _ in found})  # each filter once


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(keys=st.lists(topics, max_size=12, unique=True), topic_filter=filters())
def test_matching_finds_exactly_the_topics_the_filter_selects(
    keys: list[str], topic_filter: str
) -> None:
    trie = TopicTrie()
    for key in keys:
        trie.insert(key)
    found = trie.matching(topic_filter)
    assert sorted(found) == sorted((k, None) for k in keys if matches(topic_filter, k))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(keys=st.lists(filters(), min_size=1, max_size=10, unique=True), data=st.data())
def test_removing_keys_prunes_their_branches_and_keeps_the_others(
    keys: list[str], data: st.DataObject
) -> None:
    trie = TopicTrie()
    for key in keys:
        trie.insert(key)
    gone = data.draw(st.lists(st.sampled_from(keys), unique=True))
    for key in gone:
        trie.remove(key)
    kept = [key for key in keys if key not in gone]
    rebuilt = TopicTrie()
    for key in kept:
        rebuilt.insert(key)
    assert nodes(trie) == nodes(rebuilt)  # no node left over by a removal
    for key in keys:  # a filter selects the topic spelt like itself when it has no wildcard
        topic = key.replace("+", "x").replace("/#", "").replace("#", "x")
        assert sorted(trie.match(topic)) == sorted(rebuilt.match(topic))


def test_insert_replace_remove_and_prune_by_hand() -> None:
    trie = TopicTrie()
    trie.insert("a/b/c", 1)
    trie.insert("a/b", 2)
    assert nodes(trie) == 3
    trie.insert("a/b", 3)  # replaced, not added
    assert trie.match("a/b") == [("a/b", 3)] and nodes(trie) == 3
    trie.remove("a/b/c")  # c pruned, a/b kept: it holds an entry
    assert nodes(trie) == 2 and trie.match("a/b/c") == []
    with pytest.raises(KeyError):
        trie.remove("a")  # a prefix of a key is not a key
    with pytest.raises(KeyError):
        trie.remove("a/b/c")
    trie.remove("a/b")
    assert nodes(trie) == 0 and not trie._root


@pytest.mark.parametrize(
    ("topic_filter", "topic", "selected"),
    [
        ("a/#", "a", True),  # the parent level
        ("a/#", "a/b/c", True),
        ("a/+/#", "a", False),
        ("a/+/#", "a/b", True),
        ("#", "$sys/up", False),
        ("+/up", "$sys/up", False),
        ("+", "$sys", False),
        ("$sys/#", "$sys/up", True),
        ("$sys/+", "$sys/up", True),
        ("a/+", "a/$b", True),  # only the first level is hidden
        ("#", "a", True),
    ],
)
def test_hash_parent_level_and_dollar_topics_both_ways(
    topic_filter: str, topic: str, selected: bool
) -> None:
    filters_ = TopicTrie()
    filters_.insert(topic_filter, "v")
    names = TopicTrie()
    names.insert(topic)
    assert filters_.match(topic) == ([(topic_filter, "v")] if selected else [])
    assert names.matching(topic_filter) == ([(topic, None)] if selected else [])
    assert matches(topic_filter, topic) is selected


def test_a_trie_survives_a_file_store_reopen_and_its_records_pass_the_trust_policy(
    tmp_path: Path,
) -> None:
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        trie = TopicTrie()
        for i in range(100):  # the wide node site/ splits into buckets
            trie.insert(f"site/{i}/+/temp", i)
        trie.insert("site/#", "all")
        store.conn.root()["trie"] = trie
        store.commit()
        trie.remove("site/7/+/temp")
        store.commit()
    finally:
        store.close()
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        trie = store.conn.root()["trie"]
        assert sorted(trie.match("site/3/x/temp")) == [("site/#", "all"), ("site/3/+/temp", 3)]
        assert trie.match("site/7/x/temp") == [("site/#", "all")]
        assert nodes(trie) == 1 + 99 * 3 + 1
    finally:
        store.close()


def representative() -> TopicRepresentative:
    """A representative of server 0 whose only neighbour, server 1, is its route to 1."""
    rep = TopicRepresentative({1: 1}, backlog=10)
    rep._aaabus_id = AgentId.topics_of(0)
    return rep


def react(rep: TopicRepresentative, sender: AgentId, note: Notification) -> RecordingContext:
    ctx = RecordingContext(AgentId.topics_of(0))
    with running(ctx):
        rep.react(sender, note)
    return ctx


def agent(i: int) -> AgentId:
    return AgentId(0, 0, 1000 + i)


SOMEONE = AgentId(0, 0, 999)
FILTER_SHAPES = ("site/{i}/+/temp", "site/{i}/#", "fleet/{i}/status")


def deliveries(ctx: RecordingContext) -> dict[AgentId, tuple[str, ...]]:
    return {to: note.filters for to, note in ctx.sent if isinstance(note, Publication)}


def relayed_to(ctx: RecordingContext) -> list[tuple[int, ...]]:
    return [note.targets for _, note in ctx.sent if isinstance(note, Relay)]


def test_a_representative_with_10000_filters_routes_to_exactly_the_right_subscribers() -> None:
    rep = representative()
    subscribed = {agent(i): [FILTER_SHAPES[i % 3].format(i=i)] for i in range(10_000)}
    subscribed[agent(1)].append("site/+/+/temp")
    subscribed[agent(2)].append("#")
    for subscriber, filters_ in subscribed.items():
        for topic_filter in filters_:
            react(rep, subscriber, Subscribe(topic_filter))
    interest = InterestChange(1, ("site/4/#", "fleet/+/status"), add=True)
    react(rep, AgentId.topics_of(1), Relay((0,), interest))
    for topic in ["site/4/a/temp", "fleet/2/status", "site/9/x/temp", "site/10000/a/temp", "$s/4"]:
        expected = {
            subscriber: tuple(sorted(f for f in filters_ if matches(f, topic)))
            for subscriber, filters_ in subscribed.items()
            if any(matches(f, topic) for f in filters_)
        }
        ctx = react(rep, SOMEONE, Publish(topic, 0))
        assert deliveries(ctx) == expected, topic
        assert relayed_to(ctx) == ([(1,)] if topic in ("site/4/a/temp", "fleet/2/status") else [])
    assert deliveries(react(rep, SOMEONE, Publish("site/4/a/temp", 0))) == {
        agent(1): ("site/+/+/temp",),
        agent(2): ("#",),
        agent(4): ("site/4/#",),
    }
    react(rep, agent(4), Unsubscribe("site/4/#"))
    assert deliveries(react(rep, SOMEONE, Publish("site/4/b/temp", 0))) == {
        agent(1): ("site/+/+/temp",),
        agent(2): ("#",),
    }


def test_a_representative_from_a_store_without_tries_builds_them_and_routes(
    tmp_path: Path,
) -> None:
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        rep = store.agents[(0, TOPICS_STAMP)] = representative()
        react(rep, agent(1), Subscribe("site/+/temp"))
        react(rep, agent(2), Subscribe("site/#"))
        react(rep, SOMEONE, Publish("cfg/mode", "eco", retain=True))
        interest = InterestChange(1, ("site/3/temp",), add=True)
        react(rep, AgentId.topics_of(1), Relay((0,), interest))
        del rep.local_trie, rep.remote_trie, rep.retained_trie  # what an older store holds
        del store.conn.root()[upgrades.SCHEMA_KEY]  # and it ran no upgrade step
        store.commit()
    finally:
        store.close()
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        rep = store.agents[(0, TOPICS_STAMP)]
        assert isinstance(rep.local_trie, TopicTrie)  # built by the boot's upgrade
        ctx = react(rep, SOMEONE, Publish("site/3/temp", 1))
        assert deliveries(ctx) == {agent(1): ("site/+/temp",), agent(2): ("site/#",)}
        assert relayed_to(ctx) == [(1,)]
        store.commit()
    finally:
        store.close()
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        rep = store.agents[(0, TOPICS_STAMP)]
        assert isinstance(rep.local_trie, TopicTrie)  # stored
        ctx = react(rep, agent(3), Subscribe("cfg/+"))
        copies = [(to, n.topic, n.retained) for to, n in ctx.sent if isinstance(n, Publication)]
        assert copies == [(agent(3), "cfg/mode", True)]
        # The tries are kept up to date from then on, removals included.
        react(rep, agent(1), Unsubscribe("site/+/temp"))
        assert deliveries(react(rep, SOMEONE, Publish("site/3/temp", 2))) == {agent(2): ("site/#",)}
        react(rep, SOMEONE, Publish("cfg/mode", None, retain=True))
        assert deliveries(react(rep, agent(4), Subscribe("cfg/#"))) == {}
        react(rep, AgentId.topics_of(1), Relay((0,), InterestChange(1, ("site/3/temp",), False)))
        assert relayed_to(react(rep, SOMEONE, Publish("site/3/temp", 3))) == []
    finally:
        store.close()
