"""MQTT shared subscriptions (``$share/{group}/{filter}``): each message to one member of a group.

A **group** is a group name and a filter on one server: its members are the sessions of that
server's listener that subscribed ``$share/{group}/{filter}`` (MQTT 5.0 §4.8.2; accepted from
3.1.1 devices too, as Mosquitto does). The same group name on two servers is two groups, each
receiving every message (written down in docs/mqtt.md as a limitation).

How a message reaches one member. The groups of a server are one **system handler**,
``#s.s.4`` (:data:`~aaabus.model.ids.SHARES_STAMP`, run by the engine inside the reaction:
:meth:`aaabus.core.engine.Engine.handle`), subscribed through the server's topic representative
to each group's filter. Each :class:`~aaabus.model.pubsub.Publication` it receives is handed,
in that same reaction, to one member: appended to the member's session mailbox
(:mod:`aaabus.topics.mailbox`) with the group's ``$share/...`` as its filter (the member's
granted QoS applies), so the member's own delivery sends it with its own packet ids, exactly
once. The choice is **sticky per publisher** (the publishing device's client id,
``Publication.origin``; an agent's id for an agent): a publisher's messages go to the same member
while that member is connected, and a new publisher goes to the connected member with the
fewest publishers. So a member receives each publisher's messages in their order, even when
another member dies. A member that is not connected receives nothing; with no member
connected, the group keeps the messages (up to ``aaabus.topics.backlog``, oldest dropped) until
one connects.

Why a system handler rather than an agent per group: a deployed agent exists only once its
creation request has been processed, while a member's connection must join, leave and hand
back within its own engine operation (below). The handler's state is in the store root
(:class:`SharedTable`), there at once, and the handler is always there to receive.

When a member's connection **ends**, in the engine operation of its end
(:meth:`aaabus.mqtt.sessions.MqttSessions.close_now`): the group items in its mailbox that
it has not finished and has not PUBREC'd are withdrawn from the mailbox (its delivery skips the
gap) and handed again, in order, to the other members (their publishers reassigned). What it
PUBREC'd stays with it: at QoS 2 it owns the message (a client such as paho delivers on PUBREL,
which the listener sends only once the PUBREC is committed). So a QoS 2 message never reaches
two members; a QoS 1 message may (at least once, as MQTT allows). A member that unsubscribes
keeps what it was already handed (MQTT lets the server finish those deliveries) and gets
nothing more. At boot, every member is disconnected (its connection died with the server) and
its unfinished items are handed back the same way, computed from the store.

Threads: everything here runs on the engine thread, inside a reaction of ``#s.s.4`` or an MQTT
engine operation (:class:`~aaabus.mqtt.sessions.MqttSessions`); the state is the store's.
Nothing raises on a device's input: :func:`share_of` raises :class:`TopicError` for a malformed
shared filter, which the listener answers with its SUBACK code.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree, OOTreeSet
from persistent import Persistent

from aaabus.errors import TopicError
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication, Subscribe, Unsubscribe
from aaabus.model.topicnames import check_filter
from aaabus.topics.mailbox import Mailbox

__all__ = [
    "SHARE_PREFIX",
    "Group",
    "Member",
    "ShareWake",
    "SharedGroups",
    "SharedTable",
    "share_of",
]

log = logging.getLogger("aaabus.mqtt")

#: How a shared subscription's filter starts.
SHARE_PREFIX = "$share/"
#: The upper end of the keys that start with SHARE_PREFIX (for a range of a BTree of filters).
_SHARE_END = SHARE_PREFIX + "\U0010ffff"
_ROOT_KEY = "mqtt_shared"


def share_of(topic_filter: str) -> tuple[str, str] | None:
    """``(group, filter)`` of a shared subscription's filter ``$share/{group}/{filter}``; None
    for any other filter. Raises :class:`TopicError` (one line) for a malformed one: an empty
    group name, or one with ``+`` or ``#``, no filter, or an invalid filter."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None
    parts = topic_filter.split("/", 2)
    if len(parts) < 3 or not parts[1] or "+" in parts[1] or "#" in parts[1] or not parts[2]:
        raise TopicError(
            f"shared subscription {topic_filter[:60]!r}: write $share/GROUP/FILTER, GROUP not "
            "empty and without + or #"
        )
    return parts[1], check_filter(parts[2])


def shares_in(filters: OOBTree) -> list[str]:
    """The shared subscriptions among a session's ``filters`` (an OOBTree keyed by filter)."""
    return list(filters.keys(min=SHARE_PREFIX, max=_SHARE_END))


def publisher_of(note: Publication) -> str:
    """What a group keeps the order of: the publishing device (every device of a server
    publishes as the server's ``#s.s.0``, so its client id), or the publishing agent."""
    return f"device {note.origin}" if note.origin else f"agent {note.publisher}"


@dataclass
class ShareWake(Notification):
    """From the server to its ``#s.s.4``: hand what group ``share`` keeps to its members.

    Sent when a member joins whose mailbox is being created (a clean session's first
    SUBSCRIBE): queued after the creation request, it arrives once the mailbox exists."""

    share: str


class Member(Persistent):
    """One session in a group: its mailbox, whether its device is connected, the publishers
    assigned to it, and the group items in its mailbox (seq -> publisher) that it may not have
    finished."""

    def __init__(self, box: AgentId) -> None:
        self.box = box
        self.connected = True
        self.publishers: OOTreeSet = OOTreeSet()
        self.load = 0  # len(publishers), kept: len() of a tree set walks it
        self.handed: LOBTree = LOBTree()


class Group(Persistent):
    """One group (see the module docstring)."""

    def __init__(self, share: str, topic_filter: str) -> None:
        self.share = share
        self.topic_filter = topic_filter
        self.members: OOBTree = OOBTree()  # client id -> Member
        self.owners: OOBTree = OOBTree()  # publisher -> (client id, assignment stamp)
        self.assigned: LOBTree = LOBTree()  # assignment stamp -> publisher, oldest first
        self.next_stamp = 1
        self.waiting: LOBTree = LOBTree()  # n -> Publication, while no member can take it
        self.next_n = 1
        # The sizes of ``assigned`` and ``waiting``, kept: len() of a tree walks it.
        self.owned = 0
        self.kept = 0
        self.dropped = 0


class SharedTable(Persistent):
    """The groups of a server, in its store root: ``groups`` by ``$share/...`` filter, and
    ``by_filter``: the groups of each filter the handler is subscribed to."""

    def __init__(self) -> None:
        self.groups: OOBTree = OOBTree()
        self.by_filter: OOBTree = OOBTree()


class SharedGroups:
    """The shared subscriptions of server ``server_id`` (engine thread only; see the module
    docstring). ``agents()`` and ``root()`` are the store's agent table and root, ``send(to,
    note)`` sends from ``#s.s.0``, ``to_rep(note)`` hands a note to the topic representative
    inside the current operation; ``limit``: the most messages a group keeps while no member
    can take them, and the most publishers it remembers."""

    def __init__(
        self,
        server_id: int,
        limit: int,
        handler: AgentId,
        agents: Callable[[], Any],
        root: Callable[[], Any],
        send: Callable[[AgentId, Notification], None],
        to_rep: Callable[[Notification], object],
    ) -> None:
        self.server_id = server_id
        self.limit = limit
        self.handler = handler
        self._agents = agents
        self._root = root
        self._send = send
        self._to_rep = to_rep

    def _table(self) -> SharedTable:
        root = self._root()
        table = root.get(_ROOT_KEY)
        if not isinstance(table, SharedTable):
            table = root[_ROOT_KEY] = SharedTable()
        return table

    # -- the handler #s.s.4 (a reaction) -----------------------------------------------------------

    def react(self, sender: AgentId, note: Any) -> None:
        """A notification to ``#s.s.4``: a publication for the groups of its filters, or a
        :class:`ShareWake`. Anything else is logged and dropped (nothing else is sent here)."""
        table = self._table()
        if isinstance(note, Publication):
            if note.retained:
                return  # MQTT 5.0 §4.8.2: no retained messages for a shared subscription
            for topic_filter in note.filters:
                for share in table.by_filter.get(topic_filter, ()):
                    group = table.groups.get(share)
                    if group is not None:
                        self._hand(group, dataclasses.replace(note, filters=(share,)))
        elif isinstance(note, ShareWake):
            group = table.groups.get(note.share)
            if group is not None:
                self._flush(group)
        else:
            log.info(
                "server %s: MQTT shared subscriptions got %r from %s", self.server_id, note, sender
            )

    # -- the sessions' operations (engine thread, in an MQTT operation) ----------------------------

    def join_now(self, client_id: str, box: AgentId, share: str) -> None:
        """Session ``client_id`` (mailbox ``box``, its device connected) subscribed ``share``
        (a valid ``$share/...`` filter); creates the group at its first member."""
        table = self._table()
        group = table.groups.get(share)
        if group is None:
            parsed = share_of(share)
            assert parsed is not None
            topic_filter = parsed[1]
            group = table.groups[share] = Group(share, topic_filter)
            shares = table.by_filter.get(topic_filter)
            if shares is None:
                shares = table.by_filter[topic_filter] = OOTreeSet()
                # No retained copies: MQTT 5.0 sends none to a shared subscription.
                self._to_rep(Subscribe(topic_filter, self.handler, False))
            shares.insert(share)
        member = group.members.get(client_id)
        if member is None:
            member = group.members[client_id] = Member(box)
        else:
            member.connected = True
            member.box = box
        if self._mailbox(box) is None:
            # Being created: hand the waiting items once it is (the wake-up is queued after
            # the creation request).
            self._send(self.handler, ShareWake(share))
        else:
            self._flush(group)

    def leave_now(self, client_id: str, share: str) -> None:
        """Session ``client_id`` unsubscribed ``share``, or is deleted. What it was handed
        stays in its mailbox; it gets nothing more. The group ends with its last member (what
        it keeps for its members is dropped with it)."""
        table = self._table()
        group = table.groups.get(share)
        if group is None:
            return
        member = group.members.pop(client_id, None)
        if member is not None:
            self._unassign_all(group, member)
        if group.members:
            return
        del table.groups[share]
        if group.waiting:
            log.info(
                "server %s: MQTT shared subscription %r ended with its last member; %d "
                "messages kept for it are dropped",
                self.server_id,
                share,
                group.kept,
            )
        shares = table.by_filter.get(group.topic_filter)
        if shares is not None and share in shares:
            shares.remove(share)
            if not shares:
                del table.by_filter[group.topic_filter]
                self._to_rep(Unsubscribe(group.topic_filter, self.handler))

    def connect_now(self, client_id: str, shares: Iterable[str]) -> None:
        """The device of session ``client_id``, a member of ``shares``, connected again: the
        groups hand it what they keep, and new publishers."""
        groups = self._table().groups
        for share in shares:
            group = groups.get(share)
            member = group.members.get(client_id) if group is not None else None
            if member is not None:
                member.connected = True
                self._flush(group)

    def disconnect_now(
        self,
        client_id: str,
        shares: Iterable[str],
        finished: Collection[int],
        released: Collection[int],
    ) -> None:
        """The connection of session ``client_id`` ended: in each group of ``shares``, its
        publishers go to other members, and the group items of its mailbox that it has not
        finished (``finished``: the seqs it did beyond its acknowledged prefix, already
        forgotten by the mailbox) and not PUBREC'd (``released``) are withdrawn and handed
        again, in order."""
        groups = self._table().groups
        for share in shares:
            group = groups.get(share)
            member = group.members.get(client_id) if group is not None else None
            if member is None:
                continue
            member.connected = False
            self._unassign_all(group, member)
            box = self._mailbox(member.box)
            back: list[Notification] = []
            if box is not None:
                for seq in list(member.handed.keys()):
                    if seq in finished or seq in released:
                        continue
                    note = box.withdraw(seq)
                    if note is not None:
                        back.append(note)
            member.handed.clear()
            for note in back:
                if isinstance(note, Publication):
                    self._hand(group, note)

    def boot_now(self, released_of: Callable[[str], Collection[int] | None]) -> None:
        """At boot: every member's connection died with the server (or the server stopped);
        disconnect them, their unfinished items computed from the store (what their mailbox
        still holds, less what they PUBREC'd: ``released_of(client_id)``, None for a session
        that no longer exists, which leaves its groups)."""
        for share, group in list(self._table().groups.items()):
            for client_id, member in list(group.members.items()):
                released = released_of(client_id)
                if released is None:
                    self.leave_now(client_id, share)
                elif member.connected:
                    self.disconnect_now(client_id, (share,), (), released)

    # -- handing out -------------------------------------------------------------------------------

    def _hand(self, group: Group, note: Publication) -> None:
        """Give ``note`` to one member, after what the group kept (so each publisher's order
        holds), or keep it."""
        if group.waiting:
            self._flush(group)
        if group.waiting or not self._give(group, note):
            self._keep(group, note)

    def _flush(self, group: Group) -> None:
        """Give what the group keeps, in order, while a member can take it."""
        waiting = group.waiting
        while waiting:
            n = waiting.minKey()
            if not self._give(group, waiting[n]):
                return
            del waiting[n]
            group.kept -= 1

    def _keep(self, group: Group, note: Publication) -> None:
        group.waiting[group.next_n] = note
        group.next_n += 1
        group.kept += 1
        if group.kept > self.limit:
            del group.waiting[group.waiting.minKey()]
            group.kept -= 1
            group.dropped += 1
            if group.dropped == 1 or group.dropped % 1000 == 0:  # said now and then, not each
                log.warning(
                    "server %s: MQTT shared subscription %r has no member connected and keeps "
                    "%d messages (aaabus.topics.backlog): %d oldest dropped so far",
                    self.server_id,
                    group.share,
                    self.limit,
                    group.dropped,
                )

    def _give(self, group: Group, note: Publication) -> bool:
        """Append ``note`` to the mailbox of its publisher's member, or of the connected
        member with the fewest publishers (which the publisher is assigned to); False if no
        member can take it."""
        key = publisher_of(note)
        owner = group.owners.get(key)
        if owner is not None:
            member = group.members.get(owner[0])
            box = self._mailbox(member.box) if member is not None and member.connected else None
            if box is not None:
                self._append(member, box, note, key)
                return True
            self._unassign(group, key)
        best: tuple[Member, Mailbox, str] | None = None
        for client_id, candidate in group.members.items():
            if not candidate.connected or (best is not None and candidate.load >= best[0].load):
                continue
            box = self._mailbox(candidate.box)
            if box is not None:
                best = (candidate, box, client_id)
        if best is None:
            return False
        member, box, client_id = best
        self._assign(group, key, member, client_id)
        self._append(member, box, note, key)
        return True

    def _append(self, member: Member, box: Mailbox, note: Publication, key: str) -> None:
        handed = member.handed
        # Forget what the member's mailbox no longer holds (acknowledged, or dropped).
        first = box.oldest()
        while handed and handed.minKey() < first:
            del handed[handed.minKey()]
        seq = box.next_seq
        box.append(note)
        if box.forward is None:  # kept here (a roaming session's anchor forwards it on)
            handed[seq] = key

    # -- publishers --------------------------------------------------------------------------------

    def _assign(self, group: Group, key: str, member: Member, client_id: str) -> None:
        stamp = group.next_stamp
        group.next_stamp += 1
        group.owners[key] = (client_id, stamp)
        group.assigned[stamp] = key
        group.owned += 1
        member.publishers.insert(key)
        member.load += 1
        # Bounded: a group that saw more publishers than it may remember forgets the oldest
        # assignment (that publisher's next message may then go to another member).
        while group.owned > self.limit:
            self._unassign(group, group.assigned[group.assigned.minKey()])

    def _unassign(self, group: Group, key: str) -> None:
        owner = group.owners.pop(key, None)
        if owner is None:
            return
        client_id, stamp = owner
        group.assigned.pop(stamp, None)
        group.owned -= 1
        member = group.members.get(client_id)
        if member is not None and key in member.publishers:
            member.publishers.remove(key)
            member.load -= 1

    def _unassign_all(self, group: Group, member: Member) -> None:
        for key in list(member.publishers):
            self._unassign(group, key)

    def _mailbox(self, box_id: AgentId) -> Mailbox | None:
        box = self._agents().get((box_id.origin, box_id.stamp))
        return box if isinstance(box, Mailbox) else None
