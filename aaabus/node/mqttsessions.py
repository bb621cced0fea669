"""MQTT sessions in the server's store: what survives a device's disconnection and a restart.

A session (:class:`SessionRecord`, in the store root under ``mqtt_sessions``, keyed by client id)
is a mailbox agent (:mod:`aaabus.topics.mailbox`) that holds the device's backlog, subscribed
through the topic representative to the device's filters, plus the QoS state MQTT asks a server
to keep: the granted QoS of each filter, the packet ids of inbound QoS 2 publications awaiting
their PUBREL (a retransmitted PUBLISH with one of them is not published twice), and the backlog
numbers of outbound QoS 2 messages the device has PUBREC'd (resent as PUBREL, never as PUBLISH,
after a reconnection).

Threads: every method of :class:`MqttSessions` named ``*_now`` runs on the engine thread inside a
call of the server (``AgentServer.call``/``call_async``), so a session has one writer and each
change is committed with what it sends. The others are called from connection threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree, OOTreeSet
from persistent import Persistent

from aaabus.model.ids import AgentId
from aaabus.model.notifications import AgentDeleteRequest, Notification
from aaabus.model.pubsub import Publication, Publish, Subscribe, Unsubscribe
from aaabus.topics.mailbox import Mailbox

__all__ = ["Delivery", "MqttSessions", "SessionRecord", "packet_id"]

_ROOT_KEY = "mqtt_sessions"


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

    def __init__(self, client_id: str, box: AgentId) -> None:
        self.client_id = client_id
        self.box = box
        self.filters: OOBTree = OOBTree()  # filter -> granted QoS
        self.inbound: OOTreeSet = OOTreeSet()  # QoS 2 packet ids awaiting PUBREL
        self.released: LOBTree = LOBTree()  # backlog seq -> True: PUBREC'd by the device


@dataclass(frozen=True)
class Delivery:
    """One backlog item for a device: ``release`` means send PUBREL, not the PUBLISH again."""

    seq: int
    topic: str
    payload: bytes
    qos: int
    retained: bool
    release: bool


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

    def _rep(self) -> AgentId:
        return AgentId.topics_of(self.server_id)

    # -- engine thread -----------------------------------------------------------------------------

    def record_now(self, client_id: str) -> SessionRecord | None:
        record = self._table().get(client_id)
        return record if isinstance(record, SessionRecord) else None

    def open_now(self, client_id: str, clean: bool) -> tuple[bool, AgentId]:
        """Start a connection's session: ``(session present, mailbox id)``. ``clean`` drops a
        session kept from before and starts an empty one."""
        record = self.record_now(client_id)
        if record is not None and clean:
            self.drop_now(client_id)
            record = None
        if record is not None:
            return True, record.box
        # Deployed here and now (not through the representative): the id is known at once, and
        # the creation request precedes, in this server's FIFO queue, every subscription sent
        # for it, so the mailbox exists before its first publication.
        box = Mailbox(f"mqtt:{client_id}", None, self.backlog).deploy()
        self._table()[client_id] = SessionRecord(client_id, box)
        return False, box

    def drop_now(self, client_id: str) -> None:
        """Delete a session: its subscriptions, its mailbox and its backlog."""
        record = self._table().pop(client_id, None)
        if not isinstance(record, SessionRecord):
            return
        for topic_filter in record.filters:
            self._send(self._rep(), Unsubscribe(topic_filter, record.box))
        self._send(record.box, AgentDeleteRequest())

    def subscribe_now(self, client_id: str, filters: list[tuple[str, int]]) -> None:
        record = self._require(client_id)
        for topic_filter, qos in filters:
            record.filters[topic_filter] = qos
            self._send(self._rep(), Subscribe(topic_filter, record.box))

    def unsubscribe_now(self, client_id: str, filters: list[str]) -> None:
        record = self._require(client_id)
        for topic_filter in filters:
            if record.filters.pop(topic_filter, None) is not None:
                self._send(self._rep(), Unsubscribe(topic_filter, record.box))

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
        (``qos2_id``: the packet id of an inbound QoS 2 PUBLISH)."""
        if qos2_id is not None:
            record = self._require(client_id)
            if qos2_id in record.inbound:
                return False
            record.inbound.insert(qos2_id)
        # MQTT clears a retained value with an empty retained payload; the bus with None.
        value: bytes | None = None if retain and not payload else payload
        self._send(self._rep(), Publish(topic, value, retain, qos))
        return True

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

    def take_now(
        self, client_id: str, acked: int, after: int, most: int
    ) -> tuple[bool, list[Delivery]]:
        """Forget backlog items up to ``acked`` (the device has them); return up to ``most``
        items above ``after``. ``(found anything, deliveries)``."""
        record = self._require(client_id)  # KeyError: dropped (a clean session took over)
        box = self._mailbox(record.box)
        if box is None:
            return False, []  # not created yet (its creation is queued)
        box.ack(acked)
        while record.released and record.released.minKey() <= acked:
            del record.released[record.released.minKey()]
        out: list[Delivery] = []
        for seq, note in box.take(after, most):
            if isinstance(note, Publication):
                # MQTT: the lower of the subscription's granted QoS and the publication's.
                granted = max((record.filters.get(f, 0) for f in note.filters), default=0)
                qos = min(granted, note.qos)
                out.append(
                    Delivery(
                        seq,
                        note.topic,
                        payload_bytes(note.payload),
                        qos,
                        note.retained,
                        seq in record.released,
                    )
                )
            else:  # a reply or an error report: nothing a device can read; counted as done
                out.append(Delivery(seq, "", b"", -1, False, False))
        return bool(out), out

    # -- helpers -----------------------------------------------------------------------------------

    def _require(self, client_id: str) -> SessionRecord:
        record = self.record_now(client_id)
        if record is None:
            raise KeyError(f"no MQTT session {client_id!r}")
        return record

    def _mailbox(self, box_id: AgentId) -> Mailbox | None:
        box = self._agents().get((box_id.origin, box_id.stamp))
        return box if isinstance(box, Mailbox) else None
