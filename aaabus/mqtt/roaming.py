"""Roaming MQTT sessions: a device's persistent session follows it to any server of the bus
(property ``aaabus.mqtt.roaming``; docs/mqtt.md, "Sessions that follow a device").

Three roles, each a table in the store root of the server that plays it:

* **the directory** (one server, ``aaabus.mqtt.directory``): client id -> (anchor, user);
* **the anchor** (the server where the session was created): its mailbox stays there,
  subscribed to the device's filters, and forwards what it receives (:attr:`Mailbox.forward
  <aaabus.topics.mailbox.Mailbox.forward>`) to the **holder**, the server that holds the session
  now (record + backlog). Every publication for the device passes through the anchor, in the
  anchor's causal delivery order, and the anchor -> holder channel is FIFO: what the device
  receives is in causal order whichever server it is connected to. (Moving the subscriptions
  instead would let a publication made meanwhile at a third server miss both, or reach both.)
* **the holder**: the session's :class:`~aaabus.mqtt.sessions.SessionRecord` and a mailbox
  that the handler appends the forwarded items to.

The exchange is a handful of notifications between the handlers ``#s.s.3`` of the servers
(:mod:`aaabus.mqtt.roamnotes`): a persistent CONNECT of an id this server does not hold sends
:class:`Claim` to the directory; the directory creates the entry (:class:`Created`), refuses
another user (:class:`Refused`), or asks the anchor to move the session (:class:`Roam`); the
anchor refuses a session already moving or moved too often (``busy``) or has the holder give
it (:class:`Handover`); the giver sends the whole session (:class:`SessionMoved`: record state and
backlog with its numbers), closes its device's connection as a takeover and keeps a copy that is
no longer live (:attr:`SessionRecord.leaving <aaabus.mqtt.sessions.SessionRecord.leaving>`);
the new holder restores it, appends what the anchor forwarded meanwhile, and tells the giver
(:class:`Taken`: the copy is deleted only now) and the anchor (:class:`Settled`, which accepts
the next move only then, charged to the session's move budget). A session is never live on two
servers: giving it and restoring it are each one reaction, the move in between is one message,
and the giver's copy is deleted only once the receiver has committed its own.

Threads: :meth:`Roaming.react` runs on the engine thread as the reaction of ``#s.s.3``
(:meth:`aaabus.core.engine.Engine.handle`), in its transaction: what it changes and sends is
committed together, and if it raises it is rolled back and its sender told. What the listener
must learn (a session arrived, was refused, left) goes to it through the engine's observer
:data:`ROAM_KEY` once durable. The ``*_now`` methods run in the listener's batches (engine
thread, as ``#s.s.0``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from BTrees.OOBTree import OOBTree
from persistent import Persistent
from persistent.list import PersistentList

from aaabus.model.context import current_context
from aaabus.model.ids import AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentDeleteAck,
    AgentDeleteRequest,
    ExceptionNotification,
    Notification,
    UnknownAgent,
)
from aaabus.model.pubsub import Publication, Subscribe, Unsubscribe
from aaabus.mqtt.roamnotes import (
    MOVE_COST,
    AnchorSubscribe,
    AnchorUnsubscribe,
    Claim,
    Created,
    Drop,
    Handover,
    MovedItems,
    Refused,
    Restored,
    Roam,
    SessionMoved,
    Settled,
    Taken,
    Unregister,
)
from aaabus.mqtt.sessions import (
    BOX_PREFIX,
    PUSH_KEY,
    MqttSessions,
    Opened,
    SessionRecord,
)
from aaabus.mqtt.shared import shares_in
from aaabus.topics.mailbox import Mailbox
from aaabus.topics.messages import Forwarded
from aaabus.wire.codec import encode_note

__all__ = [
    "AWAITED",
    "BUSY",
    "MOVED_TOO_OFTEN",
    "NOT_AUTHORIZED",
    "ROAM_KEY",
    "AnchorRecord",
    "Roaming",
]

log = logging.getLogger("aaabus.mqtt")

#: The observer key of what the listener learns from the handler: ``("ready", cid, user,
#: present)``, ``("refused", cid, reason)``, ``("gone", cid)``.
ROAM_KEY = "mqtt-roam"
#: What :meth:`MqttSessions.open_now` returns when the session was asked for: CONNACK waits.
AWAITED = Opened(False, {}, awaited=True)
#: Reasons of :class:`Refused`.
BUSY = "busy"
NOT_AUTHORIZED = "not authorized"
#: Busy too (CONNACK 0x89), said apart in the listener's refusal log: the session's move budget
#: is spent (:class:`AnchorRecord`).
MOVED_TOO_OFTEN = "busy: moved too often (aaabus.mqtt.roam_bytes_s)"

_DIRECTORY = "mqtt_directory"  # cid -> (anchor server, user)
_ANCHORS = "mqtt_anchors"  # cid -> AnchorRecord
_PENDING = "mqtt_roam_pending"  # cid -> Pending


class AnchorRecord(Persistent):
    """At the anchor: the session's mailbox (subscribed to ``filters``), the server holding the
    session, whether a move is under way (from :class:`Roam` to :class:`Settled`) and the
    session's move budget."""

    #: Bytes the session may still move (None: a full budget), as of :attr:`budget_at`: each
    #: move costs its backlog's bytes plus :data:`~aaabus.mqtt.roamnotes.MOVE_COST`; the
    #: budget refills at ``aaabus.mqtt.roam_bytes_s`` up to ``aaabus.mqtt.roam_burst``, and a
    #: move is refused (:data:`MOVED_TOO_OFTEN`, busy) while it is not above 0.
    budget: float | None = None
    budget_at = 0.0

    def __init__(self, box: AgentId, user: str | None, holder: int) -> None:
        self.box = box
        self.user = user
        self.holder = holder
        self.moving = False
        self.filters: OOBTree = OOBTree()  # filter -> True


class Pending(Persistent):
    """At a server that asked for a session: who asked, and what the anchor forwarded before
    the session itself arrived (appended after its backlog)."""

    #: The session once it arrived, until its mailbox exists (see Roaming._restored).
    record: SessionRecord | None = None
    #: The parts of its backlog that came ahead of it (MovedItems), in order.
    moved: PersistentList | None = None
    #: The handler of the server that gave it (told :class:`Taken` once it is restored) and
    #: the bytes its backlog weighed (the anchor charges them to the session's move budget).
    giver: AgentId | None = None
    size = 0

    def __init__(self, user: str | None) -> None:
        self.user = user
        self.held: PersistentList = PersistentList()


class Roaming:
    """The roaming side of ``sessions`` (see the module docstring); ``directory``: the server
    id of the directory."""

    def __init__(
        self,
        sessions: MqttSessions,
        directory: int,
        max_frame: int = 16 << 20,
        move_rate: float = 65536.0,
        move_burst: float = float(1 << 20),
    ) -> None:
        self.sessions = sessions
        self.server_id = sessions.server_id
        self.directory = directory
        #: Bytes of backlog items per moving message: well under ``aaabus.max_frame``.
        self.frame_budget = max(1024, max_frame // 4)
        #: The move budget of the sessions anchored here (see :class:`AnchorRecord`): bytes per
        #: second (``aaabus.mqtt.roam_bytes_s``) and at most (``aaabus.mqtt.roam_burst``).
        self.move_rate = move_rate
        self.move_burst = move_burst
        sessions.roaming = self
        self._handlers: dict[type, Callable[[AgentId, Any], None]] = {
            Claim: self._claim,
            Unregister: self._unregister,
            Roam: self._roam,
            Handover: self._handover,
            SessionMoved: self._moved,
            MovedItems: self._moved_items,
            Created: self._created,
            Refused: self._refused,
            Settled: self._settled,
            Restored: self._restored,
            Taken: self._taken,
            Forwarded: self._forwarded,
            AnchorSubscribe: self._anchor_subscribe,
            AnchorUnsubscribe: self._anchor_unsubscribe,
            Drop: self._drop,
        }

    # -- tables --------------------------------------------------------------------------------

    def _table(self, key: str) -> OOBTree:
        root = self.sessions._root()
        table = root.get(key)
        if table is None:
            table = root[key] = OOBTree()
        return table

    def _to(self, server: int, note: Notification) -> None:
        self.sessions._send(AgentId.sessions_of(server), note)

    def _tell(self, value: tuple[Any, ...]) -> None:
        current_context("a roaming session's move").notify(ROAM_KEY, value)

    def anchored_now(self, most: int) -> list[dict[str, Any]]:
        """The sessions anchored here, at most ``most`` in client id order: each with the
        server that holds it now and whether it is moving (engine thread; read-only)."""
        # Not _table(): a status read must not create the table (and write to the store).
        table = self.sessions._root().get(_ANCHORS)
        listed: list[dict[str, Any]] = []
        for cid, entry in () if table is None else table.items():
            if len(listed) >= most:
                break
            listed.append(
                {
                    "client": cid,
                    "anchor": self.server_id,
                    "holder": entry.holder,
                    "moving": entry.moving,
                }
            )
        return listed

    # -- from MqttSessions (engine thread, in an operation or a reaction) -------------------------

    def claim_now(self, cid: str, user: str | None) -> Opened:
        """A persistent CONNECT of ``cid``, which this server does not hold: ask the directory
        (once: a claim already under way is waited for); CONNACK waits (:data:`AWAITED`)."""
        pending = self._table(_PENDING)
        if cid not in pending:
            pending[cid] = Pending(user)
            self._to(self.directory, Claim(cid, user, self.server_id))
        return AWAITED

    def refusal_now(self, cid: str, user: str | None, ends: bool) -> str | None:
        """Why a CONNECT of ``user`` that finds no live session of ``cid`` here gets none
        (None: it may go on). The id's session is on its way here (a claim pending) or from
        here (a copy leaving): another user's CONNECT is not authorized; one whose session
        ends with its connection (``ends``) is refused busy, for it would make a second,
        clean session of the id here that the arriving one would collide with, or, if it took
        the arriving one over, discard it without the anchor's knowledge. The device retries;
        once the session has arrived, its clean start ends it deliberately, at its holder,
        the anchor told (:meth:`dropped_now`). A persistent CONNECT waits for the claim
        under way."""
        pending = self._table(_PENDING).get(cid)
        if pending is not None:
            if pending.user != user:
                return NOT_AUTHORIZED
            return BUSY if ends else None
        leaving = self.sessions._table().get(cid)
        if isinstance(leaving, SessionRecord) and leaving.leaving is not None:
            return BUSY if leaving.user == user else NOT_AUTHORIZED
        return None

    def subscriptions_here(self, record: SessionRecord, note: Subscribe | Unsubscribe) -> bool:
        """Whether ``note`` (for ``record``'s mailbox) goes to this server's representative:
        the anchor's subscriptions are the session's; a holder elsewhere asks the anchor."""
        cid, anchor = record.client_id, record.anchor
        if anchor is None or anchor == self.server_id:
            entry = self._table(_ANCHORS).get(cid)
            if entry is not None:
                if isinstance(note, Subscribe):
                    entry.filters[note.topic_filter] = True
                else:
                    entry.filters.pop(note.topic_filter, None)
            return True
        if isinstance(note, Subscribe):
            send_retained = getattr(note, "send_retained", True)
            self._to(anchor, AnchorSubscribe(cid, [(note.topic_filter, send_retained)]))
        else:
            self._to(anchor, AnchorUnsubscribe(cid, [note.topic_filter]))
        return False

    def dropped_now(self, record: SessionRecord) -> None:
        """``record``'s session ended here (clean start, expiry): the anchor forgets it and
        tells the directory (here, or through :class:`Drop`)."""
        if record.anchor is None:
            return
        if record.anchor == self.server_id:
            self._table(_ANCHORS).pop(record.client_id, None)
            self._to(self.directory, Unregister(record.client_id, self.server_id))
        else:
            self._to(record.anchor, Drop(record.client_id))

    # -- the handler #s.s.3 (engine thread, as a reaction) ----------------------------------------

    def react(self, sender: AgentId, note: Any) -> None:
        """Handle one notification to ``#s.s.3`` (see :meth:`Engine.handle
        <aaabus.core.engine.Engine.handle>`). Raises ``TypeError`` for one it does not know."""
        handler = self._handlers.get(type(note))
        if handler is not None:
            handler(sender, note)
        elif isinstance(note, AgentDeleteAck | AgentCreateReply):
            pass  # a mailbox this handler deleted or created
        elif isinstance(note, ExceptionNotification | UnknownAgent):
            log.warning("server %s: session handler got %r from %s", self.server_id, note, sender)
        else:
            raise TypeError(f"the sessions handler does not handle {type(note).__name__}")

    # The directory.

    def _claim(self, _sender: AgentId, note: Claim) -> None:
        directory = self._table(_DIRECTORY)
        entry = directory.get(note.cid)
        if entry is None:
            directory[note.cid] = (note.to, note.user)
            self._to(note.to, Created(note.cid, note.user))
        elif entry[1] != note.user:
            self._to(note.to, Refused(note.cid, NOT_AUTHORIZED))
        else:
            self._to(entry[0], Roam(note.cid, note.to))

    def _unregister(self, _sender: AgentId, note: Unregister) -> None:
        directory = self._table(_DIRECTORY)
        entry = directory.get(note.cid)
        if entry is not None and entry[0] == note.anchor:
            del directory[note.cid]

    # The anchor.

    def _roam(self, _sender: AgentId, note: Roam) -> None:
        entry = self._table(_ANCHORS).get(note.cid)
        # Unknown here: its Drop went by and the directory has not heard yet. Moving: one move
        # at a time. Held by the asker already: its Drop is on its way. The device retries.
        if entry is None or entry.moving or entry.holder == note.to:
            self._to(note.to, Refused(note.cid, BUSY))
            return
        if self._refill(entry) <= 0:
            self._to(note.to, Refused(note.cid, MOVED_TOO_OFTEN))
            return
        if entry.holder == self.server_id:
            if not self._give(note.cid, note.to):
                self._to(note.to, Refused(note.cid, BUSY))
                return
        else:
            self._to(entry.holder, Handover(note.cid, note.to))
        entry.holder = note.to
        entry.moving = True
        box = self.sessions._mailbox(entry.box)
        if box is not None:
            # From now on, to the new holder (to this server's handler if the session comes
            # back here: held until it has arrived, like anywhere else).
            box.forward = AgentId.sessions_of(note.to)

    def _settled(self, _sender: AgentId, note: Settled) -> None:
        entry = self._table(_ANCHORS).get(note.cid)
        if entry is not None:
            entry.moving = False
            entry.budget = self._refill(entry) - (note.size + MOVE_COST)

    def _refill(self, entry: AnchorRecord) -> float:
        """``entry``'s move budget, refilled up to now: a move may start while it is above 0.
        A move is charged once it has settled (:meth:`_settled`), its size known then: one
        move may overdraw the budget, and the next waits until it is paid back."""
        now = time.time()
        budget = self.move_burst if entry.budget is None else entry.budget
        elapsed = max(0.0, now - entry.budget_at)
        entry.budget = min(self.move_burst, budget + elapsed * self.move_rate)
        entry.budget_at = now
        return entry.budget

    def _anchor_subscribe(self, _sender: AgentId, note: AnchorSubscribe) -> None:
        entry = self._table(_ANCHORS).get(note.cid)
        if entry is None:
            return  # dropped meanwhile
        rep = AgentId.topics_of(self.server_id)
        for topic_filter, send_retained in note.filters:
            entry.filters[topic_filter] = True
            self.sessions._send(rep, Subscribe(topic_filter, entry.box, send_retained))

    def _anchor_unsubscribe(self, _sender: AgentId, note: AnchorUnsubscribe) -> None:
        entry = self._table(_ANCHORS).get(note.cid)
        if entry is None:
            return
        rep = AgentId.topics_of(self.server_id)
        for topic_filter in note.filters:
            if entry.filters.pop(topic_filter, None) is not None:
                self.sessions._send(rep, Unsubscribe(topic_filter, entry.box))

    def _drop(self, _sender: AgentId, note: Drop) -> None:
        entry = self._table(_ANCHORS).pop(note.cid, None)
        if entry is None:
            return
        rep = AgentId.topics_of(self.server_id)
        for topic_filter in entry.filters:
            self.sessions._send(rep, Unsubscribe(topic_filter, entry.box))
        self.sessions._send(entry.box, AgentDeleteRequest())
        self._to(self.directory, Unregister(note.cid, self.server_id))

    # The holders.

    def _give(self, cid: str, to: int) -> bool:
        """Send the session to ``to`` and keep a copy that is no longer live here, deleted
        when ``to`` says it has committed its own (:meth:`_taken`); False: not here."""
        sessions = self.sessions
        record = sessions.record_now(cid)
        if record is None or record.anchor is None:
            return False
        box = sessions._mailbox(record.box)
        # A copy: the items stay until the receiver has them. Nothing is appended meanwhile:
        # the anchor forwards to the receiver from now on (its own mailbox too, see _roam).
        items = box.take(0, box.count) if box is not None else []
        # A backlog larger than a frame goes ahead in parts (MovedItems), the session last:
        # one reaction's sends to one server arrive in order.
        parts, size = _cut(items, self.frame_budget)
        for part in parts[:-1]:
            self._to(to, MovedItems(cid, part))
        moved = SessionMoved(
            cid,
            record.anchor,
            sessions.state_of(record),
            parts[-1],
            box.next_seq if box is not None else 1,
            box.dropped if box is not None else 0,
            size,
        )
        # Its shared subscriptions' groups are this server's: it leaves them (what they handed
        # it moves with its backlog) and joins the groups of its new server once restored.
        for share in shares_in(record.filters):
            sessions.shared.leave_now(cid, share)
        record.leaving = to  # a copy from now on: the device's connection here cannot use it
        self._to(to, moved)
        self._tell(("gone", cid))  # its connection here is closed as a takeover
        return True

    def _taken(self, _sender: AgentId, note: Taken) -> None:
        """The receiver has committed the session this server gave it: delete the copy (its
        mailbox; at the anchor, whose mailbox stays and forwards, the copied items)."""
        sessions = self.sessions
        record = sessions._table().get(note.cid)
        if not isinstance(record, SessionRecord) or record.leaving is None:
            return  # cannot happen (one Taken per give, and the copy waits for it)
        del sessions._table()[note.cid]
        self._discard_box(record)

    def _discard_box(self, record: SessionRecord) -> None:
        """Delete the mailbox of ``record``, a session no longer live here: the anchor's own
        stays (it holds the subscriptions and forwards), emptied of what it kept."""
        if record.anchor != self.server_id:
            self.sessions._send(record.box, AgentDeleteRequest())
            return
        box = self.sessions._mailbox(record.box)
        if box is not None and box.forward is not None:
            box.take_all()  # forwarding since the move began: these are the moved items

    def _make_room(self, cid: str) -> None:
        """Before a session arriving here joins the table: what holds ``cid`` here goes. A
        clean session (its connection was taken over by the CONNECT that claimed this one, and
        clean sessions end with their connection) is dropped as at its end. A copy still
        leaving, or a live persistent session, cannot be here (one move at a time, and the
        giver's Taken precedes any later move to it): said, and replaced by the arriving one,
        never left to collide with it."""
        sessions = self.sessions
        record = sessions._table().get(cid)
        if not isinstance(record, SessionRecord):
            return
        if record.leaving is None and (record.clean or record.anchor is None):
            sessions.drop_now(cid)
            return
        log.error(
            "server %s: session %r arrived where it was already held (leaving to %s): replaced",
            self.server_id,
            cid,
            record.leaving,
        )
        del sessions._table()[cid]
        if record.anchor != self.server_id:  # the anchor's mailbox now holds the arrived one
            sessions._send(record.box, AgentDeleteRequest())

    def _handover(self, _sender: AgentId, note: Handover) -> None:
        if not self._give(note.cid, note.to):
            self._to(note.to, Refused(note.cid, BUSY))  # ended here: its Drop is on its way

    def _moved(self, sender: AgentId, note: SessionMoved) -> None:
        sessions, cid = self.sessions, note.cid
        pendings = self._table(_PENDING)
        pending = pendings.get(cid)
        if pending is None:  # cannot happen (the move answers this server's claim): go on
            pending = pendings[cid] = Pending(None)
        if pending.record is not None:  # cannot happen (one move at a time): the newer wins
            log.error("server %s: session %r arrived twice", self.server_id, cid)
        pending.giver = sender
        pending.size = note.size
        items = [*pending.moved, *note.items] if pending.moved else list(note.items)
        pending.moved = None
        next_seq = note.next_seq
        for item in pending.held:  # forwarded before the session arrived: after its backlog
            items.append((next_seq, item))
            next_seq += 1
        pending.held = PersistentList()
        box_id: AgentId | None = None
        if note.anchor == self.server_id:
            entry = self._table(_ANCHORS).get(cid)
            box = sessions._mailbox(entry.box) if entry is not None else None
            if entry is not None and box is not None:
                # Still forwarding to this handler until Restored: what arrives meanwhile is
                # held and appended after what was held before, in order.
                box.restore(items, next_seq, note.dropped)
                box_id = entry.box
            else:  # cannot happen (the anchor's mailbox lives as long as its session)
                log.error("server %s: session %r is back without its mailbox", self.server_id, cid)
        if box_id is None:  # with its items: they travel in the creation request
            box = Mailbox(BOX_PREFIX + cid, None, sessions.backlog)
            box.push = PUSH_KEY
            box.restore(items, next_seq, note.dropped)
            box_id = box.deploy()
        record = SessionRecord(cid, box_id, None, False)
        record.restore(note.state)
        record.anchor = note.anchor
        record.left_at = time.time()  # no device yet: it expires if none comes
        # The record joins the table once its mailbox exists: this server's queue runs the
        # mailbox's creation request first, then Restored (what is forwarded meanwhile is
        # still held, and appended then).
        pending.record = record
        self._to(self.server_id, Restored(cid, record.user))

    def _moved_items(self, _sender: AgentId, note: MovedItems) -> None:
        pendings = self._table(_PENDING)
        pending = pendings.get(note.cid)
        if pending is None:  # cannot happen (the move answers this server's claim): go on
            pending = pendings[note.cid] = Pending(None)
        if pending.moved is None:
            pending.moved = PersistentList()
        pending.moved.extend(note.items)

    def _restored(self, _sender: AgentId, note: Restored) -> None:
        sessions, cid = self.sessions, note.cid
        pending = self._table(_PENDING).pop(cid, None)
        record = pending.record if pending is not None else None
        if pending is None or record is None:
            return  # cannot happen (Restored follows the SessionMoved that made the record)
        self._make_room(cid)
        sessions._table()[cid] = record
        for share in shares_in(record.filters):
            sessions.shared.join_now(cid, record.box, share)
        box = sessions._mailbox(record.box)
        if box is not None:
            box.forward = None  # back at its anchor: it keeps what it receives again
        for item in pending.held:
            if not _owed(record, item):
                continue
            if box is not None:
                box.append(item)
            else:
                sessions._send(record.box, item)
        # Committed with this reaction: the giver may delete its copy, the anchor take the
        # next move (charged to the session's budget).
        if pending.giver is not None:
            sessions._send(pending.giver, Taken(cid))
        self._to(record.anchor, Settled(cid, pending.size))
        self._tell(("ready", cid, record.user, True))

    def _created(self, _sender: AgentId, note: Created) -> None:
        sessions, cid = self.sessions, note.cid
        self._table(_PENDING).pop(cid, None)
        if sessions.record_now(cid) is not None:
            # A clean session of the id, made here meanwhile: the directory now names this
            # server the anchor, which must hold an anchored session.
            sessions.drop_now(cid)
        record = sessions._create(cid, note.user, clean=False)
        record.anchor = self.server_id
        record.left_at = time.time()
        self._table(_ANCHORS)[cid] = AnchorRecord(record.box, note.user, self.server_id)
        self._tell(("ready", cid, note.user, False))

    def _refused(self, _sender: AgentId, note: Refused) -> None:
        self._table(_PENDING).pop(note.cid, None)
        self._tell(("refused", note.cid, note.reason))

    def _forwarded(self, _sender: AgentId, note: Forwarded) -> None:
        cid = note.name[len(BOX_PREFIX) :]
        record = self.sessions.record_now(cid)
        if record is not None:
            if not _owed(record, note.item):
                return
            box = self.sessions._mailbox(record.box)
            if box is not None:
                box.append(note.item)
            else:  # its creation is still queued here: the item follows it
                self.sessions._send(record.box, note.item)
            return
        pending = self._table(_PENDING).get(cid)
        if pending is not None:
            pending.held.append(note.item)
        # Else the session ended here and its Drop is on its way to the anchor: nothing owed.


def _cut(
    items: list[tuple[int, Notification]], budget: int
) -> tuple[list[list[tuple[int, Notification]]], int]:
    """``items`` cut into runs of about ``budget`` bytes each once encoded (at least one run,
    maybe empty), and the bytes of them all."""
    parts: list[list[tuple[int, Notification]]] = [[]]
    size = total = 0
    for item in items:
        note = item[1]
        try:
            weight = len(encode_note(note)) + 16
        except TypeError:  # no data form: SessionMoved's send says so, naming it
            weight = budget
        if parts[-1] and size + weight > budget:
            parts.append([])
            size = 0
        parts[-1].append(item)
        size += weight
        total += weight
    return parts, total


def _owed(record: SessionRecord, item: Notification) -> bool:
    """Whether a forwarded ``item`` is still owed to ``record``'s device: not a publication
    that matched only filters it has unsubscribed from since (at the holder, at once, as MQTT
    asks; the anchor's mailbox stops receiving them once it has handled the unsubscription)."""
    if not isinstance(item, Publication) or not item.filters:
        return True
    filters = record.filters
    return any(f in filters for f in item.filters)
