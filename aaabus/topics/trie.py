"""A trie of topic levels, stored in the server's store: what a topic representative matches with.

One :class:`TopicTrie` indexes keys that are topic filters or topic names, each with a value,
and answers both questions of a representative without scanning its keys:

* :meth:`TopicTrie.match`: the filters that select a topic name (a publication looks for its
  subscriptions). From the root, each level of the name follows at most three children of each
  node reached: the level itself, ``+`` and ``#`` (a ``#`` child ends there, matching the rest,
  nothing included: ``a/#`` selects ``a``);
* :meth:`TopicTrie.matching`: the topic names a filter selects (a new subscription looks for
  retained copies). An exact level follows one child, ``+`` every child, ``#`` the whole
  subtree: only the branches the filter allows are walked.

Both follow MQTT's ``$`` rule: a wildcard at the first level never selects a name whose first
level starts with ``$``. :func:`aaabus.model.topicnames.matches` is the reference they agree with
(tests/test_topic_trie.py checks it on random filters and names).

**Cost.** A lookup visits the nodes whose path matches the beginning of the topic (or filter):
its cost grows with the depth of the topic and with the entries that share such a prefix, not
with the number of keys elsewhere. The one step that depends on the size of the trie is finding
a level among the children of a node, a lookup in a BTree (logarithmic, in C).

**Why one persistent BTree per node.** A node is a :class:`TrieNode`, an ``OOBTree`` mapping
the level of each child to the child, plus key ``/`` (never a level: levels are what lies
between slashes) for the entry that ends at the node. Compared with the alternatives:

* one ``OOBTree`` for the whole trie, keyed by tuples of levels, holds fewer objects, but every
  step of a lookup is then a search among *all* the keys (cost growing with their number), and
  listing the children of a node for ``+`` scans the keys of its whole subtree;
* a node holding its children in a plain ``dict`` makes lookups cheap, but adding a child
  rewrites the node whole: a node with 10,000 children (``site/<i>``) would write a record of
  all of them at every new subscription.

With a BTree per node, a small node (most of them: up to 30 keys, an ``OOBTree``'s bucket) is
one record, and a wide one is split into buckets of which a change writes one. Adding a key of
depth ``d`` writes at most ``d`` new nodes and one bucket of the node where they hang; removing
it writes the node that loses its entry, or, when that leaves nodes empty, the bucket of the
first ancestor that stays (empty nodes are pruned, so the trie holds no dead branch). The
price is one persistent object per node, some 2 or 3 per key when keys share little more than
their first level (``site/<i>/+/temp``), in a connection cache of 100,000 objects
(``aaabus.core.store.CACHE_SIZE``): a lookup touches only the few nodes on its way, which the
cache keeps while they are used, and a branch nobody publishes on may be evicted at no cost
until a lookup walks it again.
"""

from __future__ import annotations

from typing import Any

from BTrees.OOBTree import OOBTree
from persistent import Persistent

__all__ = ["TopicTrie", "TrieNode"]

#: The key of a node's own entry: ``/`` separates levels, so no level is ``/``.
ENTRY = "/"

#: A key and its value, as the trie holds them.
Entry = tuple[str, Any]


class TrieNode(OOBTree):
    """A node: child level -> :class:`TrieNode`, and :data:`ENTRY` -> ``(key, value)`` when a
    key ends here. Stored by this name in the store's records: renaming it breaks stores."""


class TopicTrie(Persistent):
    """Topic filters or topic names (the keys), each with a value (see the module docstring).

    Keys are valid filters or names (:mod:`aaabus.model.topicnames`); the trie does not check
    them. A value stored here is part of the trie's records: a large one belongs elsewhere, the
    trie holding a persistent reference to it or nothing.
    """

    def __init__(self) -> None:
        self._root = TrieNode()

    def insert(self, key: str, value: Any = None) -> None:
        """Add ``key`` with ``value``, or replace the value of ``key``."""
        node = self._root
        for level in key.split("/"):
            child = node.get(level)
            if child is None:
                child = node[level] = TrieNode()
            node = child
        node[ENTRY] = (key, value)

    def remove(self, key: str) -> None:
        """Remove ``key`` and the nodes it leaves empty; :class:`KeyError` if absent."""
        levels = key.split("/")
        path = [self._root]
        for level in levels:
            child = path[-1].get(level)
            if child is None:
                raise KeyError(key)
            path.append(child)
        del path[-1][ENTRY]  # KeyError too: a prefix of another key is not a key
        for depth in range(len(levels), 0, -1):
            if path[depth]:
                break  # still holds an entry or a child, and so do its ancestors
            del path[depth - 1][levels[depth - 1]]

    def match(self, topic: str) -> list[Entry]:
        """The entries whose key, a filter, selects topic name ``topic`` (in no set order)."""
        found: list[Entry] = []
        nodes = [self._root]
        for depth, level in enumerate(topic.split("/")):
            wild = depth > 0 or not level.startswith("$")
            reached: list[TrieNode] = []
            for node in nodes:
                child = node.get(level)
                if child is not None:
                    reached.append(child)
                if wild:
                    child = node.get("+")
                    if child is not None:
                        reached.append(child)
                    child = node.get("#")
                    if child is not None:
                        found.append(child[ENTRY])
            if not reached:
                return found
            nodes = reached
        for node in nodes:
            entry = node.get(ENTRY)
            if entry is not None:
                found.append(entry)
            child = node.get("#")  # a/# selects a: # also stands for no level at all
            if child is not None:
                found.append(child[ENTRY])
        return found

    def matching(self, topic_filter: str) -> list[Entry]:
        """The entries whose key, a topic name, ``topic_filter`` selects (in no set order)."""
        found: list[Entry] = []
        nodes = [self._root]
        for depth, level in enumerate(topic_filter.split("/")):
            if level == "#":
                for node in nodes:
                    _subtree(node, found, hide_dollar=depth == 0)
                return found
            reached: list[TrieNode] = []
            for node in nodes:
                if level == "+":
                    reached.extend(
                        child
                        for name, child in node.items()
                        if name != ENTRY and not (depth == 0 and name.startswith("$"))
                    )
                else:
                    child = node.get(level)
                    if child is not None:
                        reached.append(child)
            if not reached:
                return found
            nodes = reached
        for node in nodes:
            entry = node.get(ENTRY)
            if entry is not None:
                found.append(entry)
        return found


def _subtree(top: TrieNode, found: list[Entry], *, hide_dollar: bool) -> None:
    """Append every entry at or below ``top``; ``hide_dollar``: ``top`` is the root and a
    leading ``#`` does not see the names whose first level starts with ``$``."""
    stack = [top]
    while stack:
        node = stack.pop()
        for name, child in node.items():
            if name == ENTRY:
                found.append(child)
            elif not (hide_dollar and node is top and name.startswith("$")):
                stack.append(child)
