"""MQTT sessions in the server's store: what survives a device's disconnection and a restart.

A session (:class:`SessionRecord`, in the store root under ``mqtt_sessions``, keyed by client id)
is a mailbox agent (:mod:`aaabus.topics.mailbox`) that holds the device's backlog, subscribed
through the topic representative to the device's filters, plus the QoS state MQTT asks a server
to keep: the granted QoS of each filter, the packet ids of inbound QoS 2 publications awaiting
their PUBREL (a retransmitted PUBLISH with one of them is not published twice), and the backlog
numbers of outbound QoS 2 messages the device has PUBREC'd (resent as PUBREL, never as PUBLISH,
after a reconnection). On a log store those two sets are kept with the mailbox's backlog as side
records of the journal (:class:`~aaabus.topics.mailbox.FlowMarks`): a QoS 2 step then commits no
ZODB object. The record's own trees keep what came before the mailbox existed or with a move,
and a store's of an earlier version; reads take both. It also records the user that created it,
when its device left and, for MQTT 5.0, its own expiry interval, for the per-user bound and the
expiry.

A clean session (3.1.1; in 5.0 a session with expiry 0) is written only if it subscribes (its
mailbox is where the bus delivers), and is deleted when its connection ends: a clean CONNECT
alone commits nothing.

The mailbox pushes (:attr:`Mailbox.push` = :data:`PUSH_KEY`): each item it appends reaches the
listener's observer once durable, as ``(mailbox name, seq, item)``; the connection sends it at
once when its window allows, and takes the rest from the store (:meth:`MqttSessions.take_now`)
when it falls behind.

Retained publications cost every server a copy: :class:`RetainedLedger` counts, per user, the
retained topics and bytes published through this server (the bound of ``aaabus.mqtt.retained``
and ``aaabus.mqtt.retained_bytes``). It is kept by :meth:`MqttSessions.publish_now`, the one
door of every MQTT publication (a device's PUBLISH, its will, the bridge's messages from its
broker), so no path retains unaccounted. Devices without a user name count as one user
(:data:`ANONYMOUS`), the bridge as another (:data:`BRIDGE`).

Threads: every method named ``*_now`` runs on the engine thread inside a batch of the server's
engine (:meth:`aaabus.core.engine.Engine.run_batch`), so a session has one writer and each change
is committed with what it sends. Refusals are return values, never exceptions (an exception
replays the whole batch).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree, OOTreeSet
from persistent import Persistent

from aaabus.errors import SessionLeft
from aaabus.model.ids import AgentId
from aaabus.model.notifications import AgentDeleteRequest, Notification
from aaabus.model.pubsub import MessageProps, Publication, Publish, Subscribe, Unsubscribe
from aaabus.mqtt.messages import RETAIN_HANDLING, RETAIN_IF_NEW, kept, message_props
from aaabus.mqtt.shared import SHARE_PREFIX, SharedGroups, shares_in
from aaabus.topics.mailbox import FlowMarks, Mailbox

__all__ = [
    "ANONYMOUS",
    "BRIDGE",
    "PUSH_KEY",
    "Delivery",
    "MqttSessions",
    "RetainedBounds",
    "RetainedLedger",
    "SessionRecord",
    "Will",
    "accounted",
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
#: Who the per-user bounds (retained topics and bytes, persistent sessions) count a device
#: without a user name as: one user for all of them. And who they count the bridge's messages
#: from its broker as. U+0000 is in no MQTT user name (the codec refuses it): no device is them.
ANONYMOUS = "\0anonymous"
BRIDGE = "\0bridge"


def accounted(user: str | None) -> str:
    """The name the per-user bounds count ``user`` under (None: :data:`ANONYMOUS`)."""
    return ANONYMOUS if user is None else user


def shown(user: str) -> str:
    """``user`` (an :func:`accounted` name) as a log line says it."""
    if user == ANONYMOUS:
        return "the anonymous devices"
    if user == BRIDGE:
        return "the bridge"
    return f"user {user!r}"


#: A device's will as its CONNECT gave it: (topic, payload, QoS, retain, its 5.0 message
#: properties as the codec decoded them, or None).
Will = tuple[str, bytes, int, bool, dict[int, Any] | None]


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

    #: Wall-clock time its device disconnected (None: connected, or never seen since boot).
    left_at: float | None = None
    #: Seconds the session outlives its device (MQTT 5.0's Session Expiry Interval, capped by
    #: ``aaabus.mqtt.session_expiry_s``); None: the server's ``session_expiry_s`` (3.1.1).
    expiry: int | None = None
    #: MQTT 5.0 subscription options of the filters that have any: filter -> (option bits
    #: no-local 0x04 / retain-as-published 0x08, subscription identifier or 0); None: none yet
    #: (created at the first, so that a 3.1.1 session never writes one).
    options: OOBTree | None = None
    #: The server whose mailbox holds the subscriptions of a roaming session
    #: (:mod:`aaabus.mqtt.roaming`); None: a session that never roams (roaming off).
    anchor: int | None = None
    #: The server this record is being given to (a roaming move, :mod:`aaabus.mqtt.roaming`):
    #: a copy kept until that server has committed its own, no longer the live session here
    #: (:meth:`MqttSessions.record_now` does not see it). None: the live session.
    leaving: int | None = None

    def __init__(self, client_id: str, box: AgentId, user: str | None, clean: bool) -> None:
        self.client_id = client_id
        self.box = box
        self.user = user
        self.clean = clean
        self.filters: OOBTree = OOBTree()  # filter -> granted QoS
        # Where the mailbox's backlog cannot keep them (MqttSessions._marks):
        self.inbound: OOTreeSet = OOTreeSet()  # QoS 2 packet ids awaiting PUBREL
        self.released: LOBTree = LOBTree()  # backlog seq -> True: PUBREC'd by the device

    def state(self) -> dict[str, Any]:
        """Everything the record holds but its client id and mailbox, as data, to move it to
        another server (:class:`~aaabus.mqtt.roamnotes.SessionMoved`): every attribute set on
        it, so an attribute added later travels too (plain values, tuples and BTrees of them;
        anything else is refused when the move is sent)."""
        return {
            name: value
            for name, value in cast(dict[str, Any], self.__getstate__()).items()
            if not name.startswith("_") and name not in _NOT_STATE
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take ``state`` (from :meth:`state` on another server); what it lacks keeps its
        class default."""
        for name, value in state.items():
            if not name.startswith("_") and name not in _NOT_STATE:
                setattr(self, name, value)


#: What a record's state leaves out: the mailbox is the server's own, the id is the key, and
#: a move in progress is the giver's.
_NOT_STATE = frozenset({"client_id", "box", "leaving"})


@dataclass(frozen=True, slots=True)
class RetainedBounds:
    """``aaabus.mqtt.retained``, ``retained_bytes`` and ``retained_total`` (docs/config.md)."""

    per_user: int = 1000
    per_user_bytes: int = 4194304
    total: int = 100000


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
                return f"{shown(user)}: {per_user} retained topics already (aaabus.mqtt.retained)"
            if self.count >= total:
                return f"this server holds {total} retained topics (aaabus.mqtt.retained_total)"
        if used + size > per_user_bytes:
            return (
                f"{shown(user)} would retain {used + size} bytes "
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
    connection's business). ``origin``, ``retain`` and ``props``: those of the
    :class:`Publication` (the publishing device, the RETAIN flag it was published with, its
    MQTT 5.0 properties), for the subscription options and properties of 5.0."""

    seq: int
    topic: str
    payload: bytes
    qos: int
    retained: bool
    release: bool
    filters: tuple[str, ...]
    origin: str = ""
    retain: bool = False
    props: MessageProps | None = None


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
            note.origin,
            note.retain,
            note.props,
        )
    return Delivery(seq, "", b"", -1, False, False, ())


@dataclass(frozen=True, slots=True)
class Opened:
    """What a CONNECT finds: whether a session was there, its filters' granted QoS and the
    5.0 options of those that have any (see :attr:`SessionRecord.options`)."""

    present: bool
    filters: dict[str, int]
    options: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Roaming: the session is on its way from another server; CONNACK waits for it.
    awaited: bool = False
    #: Roaming: no session for this CONNECT (:data:`~aaabus.mqtt.roaming.BUSY`: the id's
    #: session is moving to or from this server; ``NOT_AUTHORIZED``: another user's).
    refused: str | None = None


def _expired(record: SessionRecord, now: float, expiry_s: float | None = None) -> bool:
    """Whether ``record``'s device left more than its expiry ago: its own (5.0), capped by
    ``expiry_s``, the server's (None: its own only)."""
    if record.left_at is None:
        return False
    limit = record.expiry if expiry_s is None else min(record.expiry or expiry_s, expiry_s)
    return limit is not None and now - record.left_at > limit


class RoamingHooks(Protocol):
    """What the sessions call of :class:`aaabus.mqtt.roaming.Roaming` (engine thread)."""

    def claim_now(self, cid: str, user: str | None) -> Opened: ...
    def refusal_now(self, cid: str, user: str | None, ends: bool) -> str | None: ...
    def subscriptions_here(self, record: SessionRecord, note: Subscribe | Unsubscribe) -> bool: ...
    def dropped_now(self, record: SessionRecord) -> None: ...
    def anchored_now(self, most: int) -> list[dict[str, Any]]: ...


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
        retained: RetainedBounds | None = None,
        *,
        fold_to_rep: Callable[[Notification], object],
    ) -> None:
        self.server_id = server_id
        self.backlog = backlog
        #: The bounds :meth:`publish_now` keeps retained publications within.
        self.retained = retained or RetainedBounds()
        self._agents = agents
        self._root = root
        self._send = send
        self._fold_to_rep = fold_to_rep
        #: The moves of roaming sessions (aaabus.mqtt.roaming), set by the server; None: off.
        self.roaming: RoamingHooks | None = None
        #: The shared subscriptions ($share/...) of this server's sessions; their handler
        #: ``#s.s.4`` is :meth:`SharedGroups.react` (registered by the server).
        self.shared = SharedGroups(
            server_id, backlog, AgentId.shares_of(server_id), agents, root, send, self._to_rep
        )

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

    def _to_rep(self, note: Notification) -> bool:
        """Hand ``note`` to this server's topic representative, as ``#s.s.0``: by running its
        reaction here and now, inside the operation, as the engine folds an agent's
        publication (``fold_to_rep``: :meth:`aaabus.core.engine.Engine.fold_now`).

        Why not a message: one reaction and one queued record less per publication, on the
        path of every device's message. Why it is safe: the engine serialises everything, so
        the representative sees the note as if it arrived now; every MQTT operation takes this
        path, so a device's subscription still precedes its later publications; and a note that
        overtakes messages still queued for the representative (agents' publications, relays)
        cannot be causally after them: a device learns of a publication only once the
        representative has handled it. What the representative sends (to mailboxes, relays) is
        queued as usual, from the representative itself.

        Returns, for a :class:`Publish`, whether a subscriber matched it (what routing found;
        True when the representative is not there yet to say: the note was sent to it).
        """
        return self._fold_to_rep(note) is not False

    # -- engine thread -----------------------------------------------------------------------------

    def record_now(self, client_id: str) -> SessionRecord | None:
        """The live session of ``client_id`` here (not a copy on its way to another server)."""
        record = self._table().get(client_id)
        return record if isinstance(record, SessionRecord) and record.leaving is None else None

    def index_now(self, now: float, expiry_s: float) -> dict[str, str | None]:
        """Every stored session's user, by client id, after dropping the sessions whose device
        left more than ``expiry_s`` ago and the clean sessions left by a crash (their
        connection is gone)."""
        out: dict[str, str | None] = {}
        self.shared.boot_now(self._released_of)  # their connections are gone
        for client_id, record in list(self._table().items()):
            if not isinstance(record, SessionRecord) or record.leaving is not None:
                continue  # a copy being given: its receiver's word deletes it
            if record.clean or _expired(record, now, expiry_s):
                self.drop_now(client_id)
            else:
                out[client_id] = record.user
                if record.left_at is None:
                    record.left_at = now  # its device was connected when the server stopped
        return out

    def expire_now(self, now: float, expiry_s: float, connected: set[str]) -> list[str]:
        """Drop the persistent sessions whose device left more than their expiry ago (their
        own, :attr:`SessionRecord.expiry`, or ``expiry_s``)."""
        gone: list[str] = []
        for client_id, record in list(self._table().items()):
            if (
                isinstance(record, SessionRecord)
                and record.leaving is None
                and client_id not in connected
                and _expired(record, now, expiry_s)
            ):
                self.drop_now(client_id)
                gone.append(client_id)
        return gone

    def open_now(
        self,
        client_id: str,
        clean: bool,
        user: str | None,
        expiry: int | None = None,
        now: float | None = None,
    ) -> Opened:
        """Start a connection's session. ``clean`` drops a session kept from before (3.1.1's
        Clean Session, 5.0's Clean Start). ``expiry``: 5.0's Session Expiry Interval, already
        capped (0: the session ends with the connection; None: 3.1.1, where ``clean`` says
        that too). A session that ends with its connection is not created here (it is written
        at its first SUBSCRIBE); otherwise the session kept is resumed, or a new one created.
        ``now``: wall-clock time, to drop first a 5.0 session past its own expiry that the
        listener's sweep has not reached yet."""
        record = self.record_now(client_id)
        if record is not None and (
            clean or record.clean or (now is not None and record.expiry and _expired(record, now))
        ):
            self.drop_now(client_id)
            record = None
        ends = clean if expiry is None else expiry == 0
        if record is None and self.roaming is not None:
            # Roaming: a session of the id on its way here or from here is not this
            # CONNECT's to end or create (docs/mqtt.md, "Sessions that follow a device").
            refusal = self.roaming.refusal_now(client_id, user, ends)
            if refusal is not None:
                return Opened(False, {}, refused=refusal)
        if record is None and ends:
            return Opened(False, {})
        if record is not None:
            record.left_at = None
            if record.clean != ends:
                record.clean = ends  # 5.0: resumed by a connection with expiry 0
            if record.expiry != (expiry or None):
                record.expiry = expiry or None
            box = self._mailbox(record.box)
            if box is not None and box.push != PUSH_KEY:
                box.push = PUSH_KEY  # a session stored before mailboxes pushed
            options = dict(record.options.items()) if record.options else {}
            self.shared.connect_now(client_id, shares_in(record.filters))
            return Opened(True, dict(record.filters.items()), options)
        if self.roaming is not None:
            # Roaming: the session may live on another server; it is asked for, and CONNACK
            # waits for it or for the directory's word that it is new (created then).
            return self.roaming.claim_now(client_id, user)
        record = self._create(client_id, user, clean=False)
        if expiry:
            record.expiry = expiry
        return Opened(False, {})

    def expiry_now(self, client_id: str, expiry: int) -> None:
        """5.0's DISCONNECT changed the session's expiry (already capped; 0: it ends now, with
        its connection, which :meth:`close_now` then does)."""
        record = self.record_now(client_id)
        if record is not None:
            record.expiry = expiry or None
            record.clean = expiry == 0

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
        if record.anchor is not None and self.roaming is not None:
            self.roaming.dropped_now(record)  # its anchor's subscriptions end there
            if record.anchor != self.server_id:
                self._send(record.box, AgentDeleteRequest())
                return
        for topic_filter in record.filters:
            if topic_filter.startswith(SHARE_PREFIX):
                self.shared.leave_now(client_id, topic_filter)
                continue
            self._to_rep(Unsubscribe(topic_filter, record.box))
        self._send(record.box, AgentDeleteRequest())

    def subscribe_now(
        self,
        client_id: str,
        user: str | None,
        clean: bool,
        filters: list[tuple[str, int]],
        options: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Subscribe the session to ``filters`` (filter, granted QoS), each replacing a
        subscription to the same filter. ``options``: MQTT 5.0's options byte and subscription
        identifier of those that have any (:func:`~aaabus.mqtt.messages.subscription_options`);
        its retain handling decides whether the retained copies are sent (0: always, 1: if
        the subscription is new, 2: never)."""
        record = self.record_now(client_id)
        if record is None:
            if self.roaming is not None and (
                not clean or self.roaming.refusal_now(client_id, user, True) is not None
            ):
                # From its connection here, once its session has moved; or a clean one that
                # its session, arriving or leaving, has taken over.
                raise SessionLeft(client_id)
            record = self._create(client_id, user, clean)
        for topic_filter, qos in filters:
            new = topic_filter not in record.filters
            record.filters[topic_filter] = qos
            send_retained = True
            if options or record.options:
                send_retained = self._options(record, topic_filter, new, options)
            if topic_filter.startswith(SHARE_PREFIX):  # its group hands it messages
                self.shared.join_now(client_id, record.box, topic_filter)
                continue
            self._to_box_rep(record, Subscribe(topic_filter, record.box, send_retained))

    def unsubscribe_now(self, client_id: str, filters: list[str]) -> None:
        record = self.record_now(client_id)
        if record is None:
            return
        for topic_filter in filters:
            if record.filters.pop(topic_filter, None) is not None:
                if record.options:
                    record.options.pop(topic_filter, None)
                if topic_filter.startswith(SHARE_PREFIX):
                    self.shared.leave_now(client_id, topic_filter)
                    continue
                self._to_box_rep(record, Unsubscribe(topic_filter, record.box))

    def publish_now(
        self,
        client_id: str,
        topic: str,
        payload: bytes,
        retain: bool,
        qos: int,
        qos2_id: int | None = None,
        props: MessageProps | None = None,
        *,
        user: str,
    ) -> bool | str:
        """Publish on the bus at ``qos``, with MQTT 5.0 properties ``props``, for ``user`` (an
        :func:`accounted` name). Returns whether a subscriber matched (as routing found it: a
        5.0 PUBACK says 0x10 when none did); True, nothing published, for a QoS 2
        retransmission (``qos2_id``: the packet id of an inbound QoS 2 PUBLISH of a persistent
        session), whose first PUBREC said it; the reason, a line, when a retained publication
        is over ``user``'s or the server's bounds (:class:`RetainedLedger`; nothing published,
        the packet id not kept)."""
        record = None
        marks: FlowMarks | None = None
        if qos2_id is not None:
            record = self.record_now(client_id)
            if record is not None:
                marks = self._marks(record, moving=True)
                if qos2_id in record.inbound or (marks is not None and marks.has_inbound(qos2_id)):
                    return True
            elif self.roaming is not None:
                raise SessionLeft(client_id)
        if retain:
            bounds = self.retained
            refusal = self._ledger().admit(
                user, topic, len(payload), bounds.per_user, bounds.per_user_bytes, bounds.total
            )
            if refusal is not None:
                return refusal
        if record is not None and qos2_id is not None:
            if marks is not None:
                marks.add_inbound(qos2_id)  # a side record of the commit, no ZODB object
            else:
                record.inbound.insert(qos2_id)
        # MQTT clears a retained value with an empty retained payload; the bus with None.
        value: bytes | None = None if retain and not payload else payload
        return self._to_rep(Publish(topic, value, retain, qos=qos, origin=client_id, props=props))

    def release_now(self, client_id: str, qos2_id: int) -> None:
        """PUBREL: the inbound QoS 2 flow ``qos2_id`` is over."""
        record = self.record_now(client_id)
        if record is None:
            if self.roaming is not None:
                raise SessionLeft(client_id)
        elif qos2_id in record.inbound:  # kept there: before the box could, or moved in
            record.inbound.remove(qos2_id)
        else:
            marks = self._marks(record, moving=False)
            if marks is not None:
                marks.remove_inbound(qos2_id)

    def received_now(self, client_id: str, seq: int) -> None:
        """PUBREC from the device for backlog item ``seq``: from now on it is resent as PUBREL."""
        record = self.record_now(client_id)
        if record is not None:
            marks = self._marks(record, moving=True)
            if marks is not None:
                marks.release(seq)  # a side record of the commit, no ZODB object
            else:
                record.released[seq] = True
        elif self.roaming is not None:
            raise SessionLeft(client_id)  # no PUBREL from here: the new holder releases it

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
        released = self._released(record)
        return [delivery_of(seq, note, seq in released) for seq, note in box.take(after, most)]

    def will_now(self, client_id: str, will: Will, now: float, user: str) -> bool | str:
        """Publish ``client_id``'s will for ``user`` (an :func:`accounted` name; a retained will
        is bounded as any retained publication): when its connection ends (:meth:`close_now`),
        or later with a 5.0 Will Delay Interval. Its 5.0 message properties go with it as a
        PUBLISH's do, its Message Expiry Interval counted from ``now`` (``time.time()``), when
        it goes. What :meth:`publish_now` answers."""
        topic, payload, qos, retain, properties = will
        props = message_props(properties, now) if properties else None
        return self.publish_now(client_id, topic, payload, retain, qos, None, props, user=user)

    def close_now(
        self,
        client_id: str,
        will: Will | None,
        now: float,
        finished: tuple[int, Collection[int]] | None = None,
        *,
        user: str,
    ) -> str | None:
        """A connection ended: publish its will (:data:`Will`, for ``user``), delete a clean
        session, note when a persistent one's device left. ``finished``: what the device
        finished of its backlog (the acknowledged prefix, the seqs finished beyond it), from
        which its shared subscriptions' groups take back what it had not. The reason the will
        was refused (:meth:`publish_now`), or None."""
        refusal = None
        if will is not None:
            published = self.will_now(client_id, will, now, user)
            refusal = published if isinstance(published, str) else None
        record = self.record_now(client_id)
        if record is None:
            return refusal
        shares = shares_in(record.filters)
        if shares:  # unknown ``finished``: what the store holds unacknowledged is unfinished
            if finished is not None:
                self.ack_now(client_id, finished[0])
            done = finished[1] if finished is not None else ()
            self.shared.disconnect_now(client_id, shares, done, self._released(record))
        if record.clean:
            self.drop_now(client_id)
        else:
            record.left_at = now
        return refusal

    # -- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _options(
        record: SessionRecord,
        topic_filter: str,
        new: bool,
        options: dict[str, tuple[int, int]] | None,
    ) -> bool:
        """Keep the 5.0 options of ``topic_filter``'s new subscription in ``record`` (those of
        the one it replaces go); whether its retained copies are sent (retain handling)."""
        keep = kept(options, topic_filter)
        if keep != (0, 0):
            if record.options is None:
                record.options = OOBTree()
            record.options[topic_filter] = keep
        elif record.options:
            record.options.pop(topic_filter, None)
        handling = options.get(topic_filter, (0, 0))[0] & RETAIN_HANDLING if options else 0
        return handling == 0 or (handling == RETAIN_IF_NEW and new)

    def _to_box_rep(self, record: SessionRecord, note: Subscribe | Unsubscribe) -> None:
        """(Un)subscribe ``record``'s mailbox: through this server's representative, or, for
        a roaming session held here and anchored elsewhere, at its anchor."""
        roaming = self.roaming
        if record.anchor is None or roaming is None or roaming.subscriptions_here(record, note):
            self._to_rep(note)

    def _released_of(self, client_id: str) -> Collection[int] | None:
        """The seqs session ``client_id``'s device PUBREC'd (None: no such session)."""
        record = self.record_now(client_id)
        return self._released(record) if record is not None else None

    # The QoS 2 state: kept with the backlog in the journal where the store can (log stores:
    # its changes then write no ZODB object), else in the record's trees. A session may have
    # some in both (a flow begun before its mailbox existed, state moved in from another
    # server, a store of an earlier version): reads take both, removals look in both.

    def _marks(self, record: SessionRecord, *, moving: bool) -> FlowMarks | None:
        box = self._mailbox(record.box)
        return box.marks(moving=moving) if box is not None else None

    def _released(self, record: SessionRecord) -> Collection[int]:
        """The seqs ``record``'s device PUBREC'd."""
        marks = self._marks(record, moving=False)
        if marks is None or not marks.released:
            return record.released
        if not record.released:
            return marks.released
        return {*record.released, *marks.released}

    def state_of(self, record: SessionRecord) -> dict[str, Any]:
        """``record``'s :meth:`SessionRecord.state` with the QoS 2 state its backlog keeps:
        what a roaming move carries to the next server."""
        state = record.state()
        marks = self._marks(record, moving=False)
        if marks is not None:
            state["inbound"] = OOTreeSet([*record.inbound, *marks.inbound_ids()])
            released = LOBTree(dict.fromkeys(marks.released, True))
            released.update(record.released)
            state["released"] = released
        return state

    def _mailbox(self, box_id: AgentId) -> Mailbox | None:
        box = self._agents().get((box_id.origin, box_id.stamp))
        return box if isinstance(box, Mailbox) else None
