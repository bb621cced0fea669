"""The topic representative: one agent per server (``#s.s.2``) that makes topics out of messages.

What it holds (all in the server's store, so it survives restarts):

* ``local``: filter -> the agents of this server subscribed to it (durable subscriptions);
* ``remote``: filter -> the other servers with at least one subscriber to it, learned from
  their :class:`~aaabus.topics.messages.InterestChange` announcements;
* ``retained``: topic -> its retained publication (every representative keeps a copy);
* ``mailboxes``: name -> (the mailbox agent of a client subscription or request
  (:mod:`aaabus.topics.mailbox`), its filter, the scope that opened it, whether it is a named
  subscription; two items in a store written before mailboxes had owners);
* ``routes``: next hop towards every other server (the configuration's route table, set by the
  server at boot);
* ``local_trie``, ``remote_trie``, ``retained_trie``: the same three tables as tries of topic
  levels (:mod:`aaabus.topics.trie`), so that a publication finds its subscriptions, and a
  subscription its retained copies, at a cost that grows with the topic's depth and not with the
  number of filters or topics held. The tables stay the source of truth (``aaabus status``
  counts them); each reaction changes a table and its trie together. A representative from a
  store written before the tries existed had them built by a store upgrade
  (:mod:`aaabus.core.upgrades`).

How a publication travels: the publisher's reaction sends :class:`~aaabus.model.pubsub.Publish`
to its own server's representative, which the server has the engine fold (``Engine.fold``): the
representative reacts there and then, inside the publishing reaction. It delivers the
publication to the local subscribers whose filters match, and relays it once per next hop that
leads to an interested server (every server, for a retained publication): the relays of one
event to one hop are gathered into one message (:class:`~aaabus.topics.messages.Relays`, or a
lone :class:`~aaabus.topics.messages.Relay`). Each representative on the way delivers locally
if it is a target and relays the rest the same way. Routes are the
unique paths of the servers–domains tree, so a publication crosses each link at most once and
every subscriber gets it from one path. Interest announcements travel the same way (to every
server), so they reach each representative in the order they were made.

Runs on the engine thread like any agent: each reaction is atomic (the subscription tables,
retained copies and every send change together or not at all). A malformed filter or a
subscriber of another server raises :class:`~aaabus.errors.TopicError`; the reaction is rolled
back and the sender receives an :class:`~aaabus.ExceptionNotification`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from operator import itemgetter

from BTrees.OOBTree import OOBTree, OOTreeSet

from aaabus.errors import TopicError
from aaabus.model.agent import Agent
from aaabus.model.context import current_context
from aaabus.model.ids import AgentId
from aaabus.model.notifications import AgentDeleteRequest, Notification, UnknownAgent
from aaabus.model.pubsub import Publication, Publish, Subscribe, Unsubscribe
from aaabus.model.topicnames import check_filter, check_topic
from aaabus.topics.mailbox import Mailbox
from aaabus.topics.messages import (
    Carried,
    CloseMailbox,
    InterestChange,
    OpenMailbox,
    Relay,
    Relays,
    TopicRoutes,
    one_message,
)
from aaabus.topics.trie import TopicTrie

__all__ = ["TopicRepresentative"]

log = logging.getLogger("aaabus.topics")


class TopicRepresentative(Agent):
    """The topic representative of one server (see the module docstring).

    ``routes``: next hop towards every other server; ``backlog``: the limit given to the
    mailboxes it creates (property ``aaabus.topics.backlog``).
    """

    #: What publications on recent topics were owed (see _matching): memory only, never stored.
    _v_matching: dict[str, Matching] | None = None

    def __init__(self, routes: Mapping[int, int], backlog: int) -> None:
        super().__init__("topics")
        # A plain dict, always replaced whole (never changed in place): the store sees it.
        self.routes: dict[int, int] = dict(routes)
        self.backlog = backlog
        self.local: OOBTree = OOBTree()
        self.of_subscriber: OOBTree = OOBTree()
        self.remote: OOBTree = OOBTree()
        self.retained: OOBTree = OOBTree()
        self.mailboxes: OOBTree = OOBTree()
        self.index_tables()

    @property
    def server(self) -> int:
        return self.id.server

    def index_tables(self) -> None:
        """Make the tries of the tables (at creation, and by the store upgrade that gives them
        to a representative stored before they existed).

        The tries of ``local`` and ``remote`` hold, as values, the very sets of the tables (one
        record shared, a subscriber joining an existing filter changes the set alone); that of
        ``retained`` holds no value, the copy being kept once, in the table: updating a
        retained topic, the common case, leaves the trie alone.
        """
        self.local_trie = _trie_of(self.local.items())
        self.remote_trie = _trie_of(self.remote.items())
        self.retained_trie = _trie_of((topic, None) for topic in self.retained)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Publish):
            self._publish(sender, note)
        elif isinstance(note, Relays):
            for targets, relayed in note.relays():
                self._take(targets, relayed)
        elif isinstance(note, Relay):
            self._take(note.targets, note.item)
        elif isinstance(note, Subscribe):
            self._subscribe(
                note.subscriber or sender, check_filter(note.topic_filter), note.send_retained
            )
        elif isinstance(note, Unsubscribe):
            self._unsubscribe(note.subscriber or sender, check_filter(note.topic_filter))
        elif isinstance(note, UnknownAgent) and note.target in self.of_subscriber:
            # A subscriber was deleted: its subscriptions go with it.
            for topic_filter in list(self.of_subscriber[note.target]):
                self._unsubscribe(note.target, topic_filter)
        elif isinstance(note, TopicRoutes):
            self._set_routes(note.routes)
        elif isinstance(note, OpenMailbox):
            self._open_mailbox(note)
        elif isinstance(note, CloseMailbox):
            entry = self.mailboxes.pop(note.name, None)
            if entry is not None:
                self.send_to(entry[0], AgentDeleteRequest())
        else:
            super().react(sender, note)

    def figures(self) -> dict[str, int]:
        """What ``aaabus status`` shows of topics on this server (engine thread)."""
        return {
            "filters": len(self.local),
            "subscribers": len(self.of_subscriber),
            "remote_filters": len(self.remote),
            "remote_servers": len({s for where in self.remote.values() for s in where}),
            "remote_subscriptions": sum(len(where) for where in self.remote.values()),
            "retained": len(self.retained),
            "mailboxes": len(self.mailboxes),
        }

    # -- publications ------------------------------------------------------------------------------

    def folded(self, sender: AgentId, note: Notification) -> bool:
        """``note`` handed over inside the reaction or operation that sends it (the server
        folds notes to its representative: :meth:`aaabus.core.engine.Engine.fold`): as
        :meth:`react`; returns, for a :class:`Publish`, whether a subscriber matched (see
        :meth:`publish_from`), else True."""
        if isinstance(note, Publish):
            return self.publish_from(sender, note)
        self.react(sender, note)
        return True

    def publish_from(self, sender: AgentId, note: Publish) -> bool:
        """``sender`` publishes ``note`` (engine thread, in the reaction that handles it): to
        this server's subscribers, towards the servers with a matching subscription (every
        server for a retained one, which they all keep). Returns whether any subscriber
        matched, here or at a server this one knows of: what routing found anyway (an MQTT 5.0
        PUBACK says 0x10 when none did)."""
        return self._publish(sender, note)

    def _publish(self, sender: AgentId, note: Publish) -> bool:
        item = Carried(
            check_topic(note.topic),
            note.payload,
            sender,
            note.retain,
            qos=note.qos,
            origin=note.origin,
            props=note.props,
        )
        self._handle(item)
        deliveries, hops = self._matching(item.topic)  # the topic's, kept: no second walk
        if item.retain:
            self._relay(self.routes, item)
        else:
            self._send_relays(hops, item)
        return bool(deliveries or hops)

    def _take(self, targets: tuple[int, ...], item: Carried | InterestChange) -> None:
        """A relay from a neighbour: handle its item if this server is a target, pass it on."""
        if self.server in targets:
            self._handle(item, fresh=True)
            if len(targets) == 1:
                return  # the usual case: this server was the only target
        self._relay(targets, item)

    def _handle(self, item: Carried | InterestChange, fresh: bool = False) -> None:
        """Apply ``item`` here: record an interest change, or deliver a publication locally.

        ``fresh``: the item was decoded from a relay for this reaction alone, so a publication
        that one subscriber gets and no retained copy keeps can be handed over as it is
        (``hand_over``: not encoded again and decoded by the subscriber)."""
        if isinstance(item, InterestChange):
            self._record_interest(item)
            return
        if item.retain:
            if item.payload is None:
                if self.retained.pop(item.topic, None) is not None:
                    self.retained_trie.remove(item.topic)
            else:
                if item.topic not in self.retained:
                    self.retained_trie.insert(item.topic)
                self.retained[item.topic] = item
        deliveries = self._matching(item.topic)[0]
        if not deliveries:
            return
        ctx = current_context("publishing")
        for filters, subscribers in deliveries:
            note = Publication(
                item.topic,
                item.payload,
                item.publisher,
                filters,
                qos=item.qos,
                origin=item.origin,
                props=item.props,
                retain=item.retain,
            )
            if (
                not item.retain
                and len(subscribers) == 1
                and len(deliveries) == 1
                and (fresh or isinstance(item.payload, _UNSHARED))
            ):
                # Nobody else holds any part of it: decoded for this reaction alone, or built
                # here of values nobody can change (a device's publication: bytes, and frozen
                # properties). Handed over, it is neither encoded nor decoded on its way to its
                # one subscriber, most often the session mailbox of a device on this server.
                ctx.hand_over(subscribers[0], note)
            else:
                ctx.send_all(subscribers, note)  # one Publication, encoded once, for all

    def _matching(self, topic: str) -> Matching:
        """Who gets a publication on ``topic``: this server's subscribers, grouped by the filters
        of theirs that match (in filter order, as a subscriber's ``Publication.filters``
        always came; groups in the order of their first subscriber), and the other servers
        with a matching subscription, by next hop.

        Kept in memory per topic (``_v_matching``), since most publications go to topics
        published before: the tries are walked once per topic, not per publication. Every
        change of a table that matching reads clears it (:meth:`_changed`), which also bumps
        the stored ``version``: a transaction that changed a table is then one that changed
        this object, so if it rolls back ZODB resets the object, and the memory of what it
        matched goes with it.
        """
        cache = self._v_matching
        if cache is None:
            cache = {}
            self._v_matching = cache
        found = cache.get(topic)
        if found is not None:
            return found
        chosen: dict[AgentId, list[str]] = {}
        for topic_filter, subscribers in sorted(self.local_trie.match(topic), key=_key):
            for subscriber in subscribers:
                chosen.setdefault(subscriber, []).append(topic_filter)
        groups: dict[tuple[str, ...], list[AgentId]] = {}
        for subscriber in sorted(chosen):
            groups.setdefault(tuple(chosen[subscriber]), []).append(subscriber)
        servers: set[int] = set()
        for _, where in self.remote_trie.match(topic):
            servers.update(where)
        if len(cache) >= MATCHING_CACHED:
            cache.clear()
        found = cache[topic] = (
            tuple((filters, tuple(subs)) for filters, subs in groups.items()),
            self._hops(servers),
        )
        return found

    def _changed(self) -> None:
        """A table that matching reads changed: forget what was matched (see :meth:`_matching`)."""
        self.version = getattr(self, "version", 0) + 1
        self._v_matching = None

    def _relay(self, targets: Iterable[int], item: Carried | InterestChange) -> None:
        """Send ``item`` towards ``targets`` (minus this server): one Relay per next hop, and
        the Relays of one event to one hop gathered into one message (:class:`Relays`)."""
        self._send_relays(self._hops(targets), item)

    def _hops(self, targets: Iterable[int]) -> Hops:
        """``targets`` (minus this server) by the next hop towards them, hops in order."""
        me = self.server
        by_hop: dict[int, list[int]] = {}
        for target in sorted(set(targets)):
            hop = self.routes.get(target)
            if target != me and hop is not None:  # None: no longer in the configuration
                by_hop.setdefault(hop, []).append(target)
        return tuple((AgentId.topics_of(hop), tuple(by_hop[hop])) for hop in sorted(by_hop))

    def _send_relays(self, hops: Hops, item: Carried | InterestChange) -> None:
        if not hops:
            return
        gather = current_context("relaying").gather
        for rep, targets in hops:
            gather(rep, (targets, item), one_message)

    # -- subscriptions -----------------------------------------------------------------------------

    def _subscribe(
        self, subscriber: AgentId, topic_filter: str, send_retained: bool = True
    ) -> None:
        if subscriber.server != self.server:
            raise TopicError(
                f"{subscriber} lives on server {subscriber.server}: subscribe through the topic "
                f"representative of its own server, not server {self.server}'s"
            )
        subscribers = self.local.get(topic_filter)
        if subscribers is None:
            subscribers = self.local[topic_filter] = OOTreeSet()
            self.local_trie.insert(topic_filter, subscribers)
            self._announce((topic_filter,), add=True)
        if subscribers.insert(subscriber):
            self._changed()
        filters = self.of_subscriber.get(subscriber)
        if filters is None:
            filters = self.of_subscriber[subscriber] = OOTreeSet()
        filters.insert(topic_filter)
        if not send_retained:
            return
        for topic, _ in sorted(self.retained_trie.matching(topic_filter), key=_key):
            item = self.retained[topic]
            note = Publication(
                topic,
                item.payload,
                item.publisher,
                (topic_filter,),
                True,
                True,
                qos=item.qos,
                origin=item.origin,
                props=item.props,  # a copy stored before Carried had them: the class default
            )
            self.send_to(subscriber, note)

    def _unsubscribe(self, subscriber: AgentId, topic_filter: str) -> None:
        subscribers = self.local.get(topic_filter)
        if subscribers is None or subscriber not in subscribers:
            return
        subscribers.remove(subscriber)
        self._changed()
        if not subscribers:
            del self.local[topic_filter]
            self.local_trie.remove(topic_filter)
            self._announce((topic_filter,), add=False)
        filters = self.of_subscriber[subscriber]
        filters.remove(topic_filter)
        if not filters:
            del self.of_subscriber[subscriber]

    def _announce(self, filters: tuple[str, ...], *, add: bool) -> None:
        """Tell every other representative that this server gained or lost ``filters``."""
        self._relay(self.routes, InterestChange(self.server, filters, add))

    def _record_interest(self, change: InterestChange) -> None:
        self._changed()
        for topic_filter in change.filters:
            where = self.remote.get(topic_filter)
            if change.add:
                if where is None:
                    where = self.remote[topic_filter] = OOTreeSet()
                    self.remote_trie.insert(topic_filter, where)
                where.insert(change.origin)
            elif where is not None and change.origin in where:
                where.remove(change.origin)
                if not where:
                    del self.remote[topic_filter]
                    self.remote_trie.remove(topic_filter)

    def _set_routes(self, routes: Mapping[int, int]) -> None:
        """The configuration changed: forget servers that left, tell newcomers our filters."""
        old = set(self.routes)
        self.routes = dict(routes)
        self._changed()
        for gone in old - set(routes):
            self._record_interest(InterestChange(gone, tuple(self.remote.keys()), add=False))
        newcomers = set(routes) - old
        if newcomers and self.local:
            self._relay(newcomers, InterestChange(self.server, tuple(self.local.keys()), True))

    # -- mailboxes of outside consumers ------------------------------------------------------------

    def _open_mailbox(self, note: OpenMailbox) -> None:
        entry = self.mailboxes.get(note.name)
        if entry is not None:
            if entry[1] != note.topic_filter:
                # Only the admin port sends this, and it checks first: a race of two clients.
                log.warning(
                    "server %s: mailbox %r already exists with filter %r, not %r",
                    self.server,
                    note.name,
                    entry[1],
                    note.topic_filter,
                )
            return
        mailbox = Mailbox(note.name, note.topic_filter, self.backlog, note.first)
        mailbox_id = mailbox.deploy()
        self.mailboxes[note.name] = (mailbox_id, note.topic_filter, note.owner, note.durable)
        if note.topic_filter is not None:
            # Subscribed here and now, not by the mailbox once created: every publication this
            # representative handles after the request is the subscription's (its deliveries
            # reach the mailbox after the creation request, which went first).
            self._subscribe(mailbox_id, check_filter(note.topic_filter))


#: Sorts (key, value) entries of a trie by key.
_key = itemgetter(0)

#: Servers a relay goes to, by next hop: (the hop's representative, the targets behind it).
Hops = tuple[tuple[AgentId, tuple[int, ...]], ...]

#: What a publication on one topic is owed here: groups of this server's subscribers (by the
#: filters that match), and the other servers interested (see TopicRepresentative._matching).
#: Payloads that a publication and the one who published it can share without either seeing
#: the other change it (MessageProps, the other shared part, is frozen).
_UNSHARED = (bytes, str, int, float, bool, type(None))

Matching = tuple[tuple[tuple[tuple[str, ...], tuple[AgentId, ...]], ...], Hops]

#: Topics whose matching a representative keeps in memory; past that, it starts again empty
#: (a bus publishing on ever new topics pays the tries, as before, and no more memory).
MATCHING_CACHED = 4096


def _trie_of(entries: Iterable[tuple[str, object]]) -> TopicTrie:
    """A new trie of ``entries`` (key, value)."""
    trie = TopicTrie()
    for key, value in entries:
        trie.insert(key, value)
    return trie
