"""MQTT sessions in the server's store: what survives a device's disconnection and a restart.

A session (:class:`SessionRecord`, in the store root under ``mqtt_sessions``, keyed by client id)
is a mailbox agent (:mod:`aaabus.topics.mailbox`) that holds the device's backlog, subscribed
through the topic representative to the device's filters, plus the QoS state MQTT asks a server
to keep: the granted QoS of each filter, the packet ids of inbound QoS 2 publications awaiting
their PUBREL (a retransmitted PUBLISH with one of them is not published twice), and the backlog
numbers of outbound QoS 2 messages the device has PUBREC'd (resent as PUBREL, never as PUBLISH,
after a reconnection). It also records the user that created it and when its device left, for
the per-user bound and the expiry.

A clean session is written only if it subscribes (its mailbox is where the bus delivers), and is
deleted when its connection ends: a clean CONNECT alone commits nothing.

The mailbox pushes (:attr:`Mailbox.push` = :data:`PUSH_KEY`): each item it appends reaches the
listener's observer once durable, as ``(mailbox name, seq, item)``; the connection sends it at
once when its window allows, and takes the rest from the store (:meth:`MqttSessions.take_now`)
when it falls behind.

Retained publications cost every server a copy: :class:`RetainedLedger` counts, per user, the
retained topics and bytes published through this server (the bound of ``aaabus.mqtt.retained``
and ``aaabus.mqtt.retained_bytes``).

Threads: every method named ``*_now`` runs on the engine thread inside a batch of the server's
engine (:meth:`aaabus.core.engine.Engine.run_batch`), so a session has one writer and each change
is committed with what it sends. Refusals are return values, never exceptions (an exception
replays the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree, OOTreeSet
from persistent import Persistent

from aaabus.model.ids import TOPICS_STAMP, AgentId
from aaabus.model.notifications import AgentDeleteRequest, Notification
from aaabus.model.pubsub import Publication, Publish, Subscribe, Unsubscribe
from aaabus.topics.mailbox import Mailbox
from aaabus.topics.representative import TopicRepresentative

__all__ = [
    "PUSH_KEY",
    "Delivery",
    "MqttSessions",
    "RetainedLedger",
    "SessionRecord",
    "delivery_of",
    "packet_id",
    "payload_bytes",
]

_ROOT_KEY = "mqtt_sessions"
_RETAINED_KEY = "mqtt_retained"
#: The observer key of session mailboxes (:meth:`aaabus.core.engine.Engine.observe`).
PUSH_KEY = "mqtt"
#: The mailbox name of client id ``cid``'s session.
BOX_PREFIX = "mqtt:"


def packet_id(seq: int) -> int:
    """The MQTT packet id of backlog item ``seq``: fixed, so a resend after a restart carries
    the id of the first send (the device's QoS 2 state then recognises it)."""
    return (seq - 1) % 65535 + 1


def payload_bytes(payload: Any) -> bytes:
    """What a device receives of a bus payload: bytes as they are, text as UTF-8, ``None`` as
    nothing, anything else as the UTF-8 of its ``str()``."""
    if isinstance(payload, bytes | bytearray):
        return bytes(payload)
    if payload is None:
        return b""
    return (payload if isinstance(payload, str) else str(payload)).encode("utf-8")


class SessionRecord(Persistent):
    """One client id's session (see the module docstring)."""

    #: Class defaults for records stored before these attributes existed.
    user: str | None = None
    clean = False
    #: Wall-clock time its device disconnected (None: connected, or never seen since boot).
    left_at: float | None = None

    def __init__(self, client_id: str, box: AgentId, user: str | None, clean: bool) -> None:
        self.client_id = client_id
        self.box = box
        self.user = user
        self.clean = clean
        self.filters: OOBTree = OOBTree()  # filter -> granted QoS
        self.inbound: OOTreeSet = OOTreeSet()  # QoS 2 packet ids awaiting PUBREL
        self.released: LOBTree = LOBTree()  # backlog seq -> True: PUBREC'd by the device


class RetainedLedger(Persistent):
    """Retained topics published through this server, per user: ``topics[user][topic]`` is the
    payload size; ``sizes[user]`` the user's total bytes; ``count`` every user's topics."""

    def __init__(self) -> None:
        self.topics: OOBTree = OOBTree()
        self.sizes: OOBTree = OOBTree()
        self.count = 0

    def admit(
        self, user: str, topic: str, size: int, per_user: int, per_user_bytes: int, total: int
    ) -> str | None:
        """Record ``user`` retaining ``size`` bytes on ``topic`` (0: clearing it); the reason it
        is refused instead, or None."""
        mine = self.topics.get(user)
        old = mine.get(topic) if mine is not None else None
        if size == 0:
            if old is not None:
                del mine[topic]
                self.sizes[user] -= old
                self.count -= 1
            return None
        used = self.sizes.get(user, 0) - (old or 0)
        if old is None:
            if mine is not None and len(mine) >= per_user:
                return f"user {user!r} has {per_user} retained topics (aaabus.mqtt.retained)"
            if self.count >= total:
                return f"this server holds {total} retained topics (aaabus.mqtt.retained_total)"
        if used + size > per_user_bytes:
            return (
                f"user {user!r} would retain {used + size} bytes "
                f"(aaabus.mqtt.retained_bytes = {per_user_bytes})"
            )
        if mine is None:
            mine = self.topics[user] = OOBTree()
        if old is None:
            self.count += 1
        mine[topic] = size
        self.sizes[user] = used + size
        return None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One backlog item for a device. ``qos`` -1: nothing a device reads (a reply or an error
    report in the mailbox), counted as delivered. ``release``: send PUBREL, not the PUBLISH
    again. ``filters``: the subscription filters that selected it (the granted QoS is the
    connection's business)."""

    seq: int
    topic: str
    payload: bytes
    qos: int
    retained: bool
    release: bool
    filters: tuple[str, ...]


def delivery_of(seq: int, note: Notification, release: bool = False) -> Delivery:
    """The delivery of mailbox item ``seq``."""
    if isinstance(note, Publication):
        return Delivery(
            seq,
            note.topic,
            payload_bytes(note.payload),
            note.qos,
            note.retained,
            release,
            tuple(note.filters),
        )
    return Delivery(seq, "", b"", -1, False, False, ())


@dataclass(frozen=True, slots=True)
class Opened:
    """What a CONNECT finds: whether a session was there and its filters' granted QoS."""

    present: bool
    filters: dict[str, int]


class MqttSessions:
    """The sessions of one server. ``agents()`` is the store's agent table, ``root()`` its root
    and ``send(to, note)`` sends from ``#s.s.0``: all three engine thread only."""

    def __init__(
        self,
        server_id: int,
        backlog: int,
        agents: Callable[[], Any],
        root: Callable[[], Any],
        send: Callable[[AgentId, Notification], None],
    ) -> None:
        self.server_id = server_id
        self.backlog = backlog
        self._agents = agents
        self._root = root
        self._send = send

    def _table(self) -> OOBTree:
        root = self._root()
        table = root.get(_ROOT_KEY)
        if table is None:
            table = root[_ROOT_KEY] = OOBTree()
        return table

    def _ledger(self) -> RetainedLedger:
        root = self._root()
        ledger = root.get(_RETAINED_KEY)
        if not isinstance(ledger, RetainedLedger):
            ledger = root[_RETAINED_KEY] = RetainedLedger()
        return ledger

    def _to_rep(self, note: Notification) -> None:
        """Hand ``note`` to this server's topic representative, as ``#s.s.0``: by running its
        reaction here and now, inside the operation.

        Why not a message: one reaction and one queued record less per publication, on the
        path of every device's message. Why it is safe: the engine serialises everything, so
        the representative sees the note as if it arrived now; every MQTT operation takes this
        path, so a device's subscription still precedes its later publications; and a note that
        overtakes messages still queued for the representative (agents' publications, relays)
        cannot be causally after them: a device learns of a publication only once the
        representative has handled it. What the representative sends (to mailboxes, relays) is
        queued as usual, from ``#s.s.0``.
        """
        rep = self._agents().get((self.server_id, TOPICS_STAMP))
        if isinstance(rep, TopicRepresentative):
            rep.react(AgentId.server_of(self.server_id), note)
        else:  # not created yet (a store from before topics): it will react in its turn
            self._send(AgentId.topics_of(self.server_id), note)

    # -- engine thread -----------------------------------------------------------------------------

    def record_now(self, client_id: str) -> SessionRecord | None:
        record = self._table().get(client_id)
        return record if isinstance(record, SessionRecord) else None

    def index_now(self, now: float, expiry_s: float) -> dict[str, str | None]:
        """Every stored session's user, by client id, after dropping the sessions whose device
        left more than ``expiry_s`` ago and the clean sessions left by a crash (their
        connection is gone)."""
        out: dict[str, str | None] = {}
        for client_id, record in list(self._table().items()):
            if not isinstance(record, SessionRecord):
                continue
            if record.clean or (record.left_at is not None and now - record.left_at > expiry_s):
                self.drop_now(client_id)
            else:
                out[client_id] = record.user
                if record.left_at is None:
                    record.left_at = now  # its device was connected when the server stopped
        return out

    def expire_now(self, now: float, expiry_s: float, connected: set[str]) -> list[str]:
        """Drop the persistent sessions whose device left more than ``expiry_s`` ago."""
        gone: list[str] = []
        for client_id, record in list(self._table().items()):
            if (
                isinstance(record, SessionRecord)
                and client_id not in connected
                and record.left_at is not None
                and now - record.left_at > expiry_s
            ):
                self.drop_now(client_id)
                gone.append(client_id)
        return gone

    def open_now(self, client_id: str, clean: bool, user: str | None) -> Opened:
        """Start a connection's session. ``clean`` drops a session kept from before and
        creates nothing (a clean session is written at its first SUBSCRIBE); otherwise the
        session kept is resumed, or a new one is created."""
        record = self.record_now(client_id)
        if record is not None and (clean or record.clean):
            self.drop_now(client_id)
            record = None
        if clean:
            return Opened(False, {})
        if record is not None:
            record.left_at = None
            box = self._mailbox(record.box)
            if box is not None and box.push != PUSH_KEY:
                box.push = PUSH_KEY  # a session stored before mailboxes pushed
            return Opened(True, dict(record.filters.items()))
        self._create(client_id, user, clean=False)
        return Opened(False, {})

    def _create(self, client_id: str, user: str | None, clean: bool) -> SessionRecord:
        # Deployed here and now (not through the representative): the id is known at once, and
        # the creation request precedes, in this server's FIFO queue, every subscription sent
        # for it, so the mailbox exists before its first publication.
        box = Mailbox(BOX_PREFIX + client_id, None, self.backlog)
        box.push = PUSH_KEY
        box_id = box.deploy()
        record = self._table()[client_id] = SessionRecord(client_id, box_id, user, clean)
        return record

    def drop_now(self, client_id: str) -> None:
        """Delete a session: its subscriptions, its mailbox and its backlog."""
        record = self._table().pop(client_id, None)
        if not isinstance(record, SessionRecord):
            return
        for topic_filter in record.filters:
            self._to_rep(Unsubscribe(topic_filter, record.box))
        self._send(record.box, AgentDeleteRequest())

    def subscribe_now(
        self, client_id: str, user: str | None, clean: bool, filters: list[tuple[str, int]]
    ) -> None:
        record = self.record_now(client_id)
        if record is None:
            record = self._create(client_id, user, clean)
        for topic_filter, qos in filters:
            record.filters[topic_filter] = qos
            self._to_rep(Subscribe(topic_filter, record.box))

    def unsubscribe_now(self, client_id: str, filters: list[str]) -> None:
        record = self.record_now(client_id)
        if record is None:
            return
        for topic_filter in filters:
            if record.filters.pop(topic_filter, None) is not None:
                self._to_rep(Unsubscribe(topic_filter, record.box))

    def publish_now(
        self,
        client_id: str,
        topic: str,
        payload: bytes,
        retain: bool,
        qos: int,
        qos2_id: int | None = None,
    ) -> bool:
        """Publish on the bus at ``qos``; False (nothing published) for a QoS 2 retransmission
        (``qos2_id``: the packet id of an inbound QoS 2 PUBLISH of a persistent session)."""
        if qos2_id is not None:
            record = self.record_now(client_id)
            if record is not None:
                if qos2_id in record.inbound:
                    return False
                record.inbound.insert(qos2_id)
        # MQTT clears a retained value with an empty retained payload; the bus with None.
        value: bytes | None = None if retain and not payload else payload
        self._to_rep(Publish(topic, value, retain, qos, client_id))
        return True

    def retain_now(
        self, user: str, topic: str, size: int, per_user: int, per_user_bytes: int, total: int
    ) -> str | None:
        """Account a retained publication of ``user`` (see :class:`RetainedLedger`)."""
        return self._ledger().admit(user, topic, size, per_user, per_user_bytes, total)

    def release_now(self, client_id: str, qos2_id: int) -> None:
        """PUBREL: the inbound QoS 2 flow ``qos2_id`` is over."""
        record = self.record_now(client_id)
        if record is not None and qos2_id in record.inbound:
            record.inbound.remove(qos2_id)

    def received_now(self, client_id: str, seq: int) -> None:
        """PUBREC from the device for backlog item ``seq``: from now on it is resent as PUBREL."""
        record = self.record_now(client_id)
        if record is not None:
            record.released[seq] = True

    def ack_now(self, client_id: str, acked: int) -> None:
        """Forget backlog items up to ``acked``: the device has them."""
        record = self.record_now(client_id)
        if record is None:
            return
        box = self._mailbox(record.box)
        if box is not None:
            box.ack(acked)
        released = record.released
        while released and released.minKey() <= acked:
            del released[released.minKey()]

    def take_now(self, client_id: str, after: int, most: int) -> list[Delivery] | None:
        """Up to ``most`` backlog items above ``after``, oldest first (None: there is no
        session, or no mailbox yet). Reads only: a batch of takes commits nothing."""
        record = self.record_now(client_id)
        if record is None:
            return None
        box = self._mailbox(record.box)
        if box is None:
            return None  # not created yet (its creation is queued)
        released = record.released
        return [delivery_of(seq, note, seq in released) for seq, note in box.take(after, most)]

    def close_now(
        self,
        client_id: str,
        will: tuple[str, bytes, int, bool] | None,
        now: float,
    ) -> None:
        """A connection ended: publish its will (``(topic, payload, qos, retain)``), delete a
        clean session, note when a persistent one's device left."""
        if will is not None:
            self.publish_now(client_id, will[0], will[1], will[3], will[2])
        record = self.record_now(client_id)
        if record is None:
            return
        if record.clean:
            self.drop_now(client_id)
        else:
            record.left_at = now

    # -- helpers -----------------------------------------------------------------------------------

    def _mailbox(self, box_id: AgentId) -> Mailbox | None:
        box = self._agents().get((box_id.origin, box_id.stamp))
        return box if isinstance(box, Mailbox) else None
