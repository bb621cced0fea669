"""One MQTT connection of the listener (:mod:`aaabus.node.mqtt`): a device's packets in, the
bus's messages out, on the listener's event loop.

Everything here runs on the listener's loop thread (``mqtt-<server>``), which owns every
connection: no lock, no thread of its own. A connection is an :class:`asyncio.Protocol` whose
bytes go through a sans-IO :class:`~aaabus.io.mqttproto.MqttProtocol`; what must touch the store
becomes an operation of the listener's next engine batch (:meth:`ConnectionHost.op`), and its
answer (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK, CONNACK of a persistent session) is sent
when that batch is durable. Answers leave in the order their packets arrived (:class:`_Answers`).

Delivery is pushed: the session's mailbox hands each item to the listener once durable
(:meth:`MqttConnection.pushed`), and the connection sends it at once if it is the next one and
the window allows: at most ``aaabus.mqtt.inflight`` QoS 1/2 messages unacknowledged, and the
socket's queue under ``aaabus.mqtt.queued_bytes`` (asyncio's write-buffer flow control). When it
falls behind (a full window, a slow socket, a reconnection), it takes the rest from the store
(:meth:`~aaabus.node.mqttsessions.MqttSessions.take_now`), a window at a time. The device's
acknowledgements are cumulated and committed in the next batch: the store forgets what the
device has.

A protocol violation, an oversized packet, a keep-alive lapse or a closed socket ends the
connection; a 5.0 device is told why (DISCONNECT with a reason). The will is published when the
connection ends without DISCONNECT. Nothing here raises to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from aaabus.errors import MqttProtocolError
from aaabus.io import mqttcodec as mc
from aaabus.io.mqttproto import MqttProtocol, State
from aaabus.node.mqttsessions import Delivery, MqttSessions, Opened, packet_id

__all__ = ["ConnectionHost", "MqttConnection"]

#: Bytes a connection may hold unparsed beyond one whole packet before its socket is not read.
_SLACK = 65536

log = logging.getLogger("aaabus.mqtt")


class ConnectionHost(Protocol):
    """What a connection uses of its listener (:class:`aaabus.node.mqtt.MqttListener`); all of
    it on the loop thread."""

    server_id: int
    sessions: MqttSessions
    max_packet: int
    inflight: int
    queued_bytes: int
    max_filters: int
    max_keepalive: int
    keepalive_0: bool
    retained: int
    retained_bytes: int
    retained_total: int

    def op(
        self,
        conn: MqttConnection,
        fn: Callable[[], Any],
        then: Callable[[Any], None],
        *,
        lazy: bool = False,
    ) -> None:
        """Run ``fn`` on the engine thread in the next batch; ``then(outcome)`` on the loop
        once it is durable (``outcome``: its result, or the exception it raised). ``lazy``:
        nobody waits for it; it may ride along with a later batch."""
        ...

    def admit(self, conn: MqttConnection) -> bool: ...
    def dirty(self, conn: MqttConnection) -> None: ...
    def flush_writes(self) -> None: ...
    def stored(self, client_id: str) -> bool: ...
    def stored_changed(self, client_id: str, user: str | None, present: bool) -> None: ...
    def authenticate(
        self, user: str | None, password: bytes | None, then: Callable[[bool], None]
    ) -> None: ...
    def claim(self, conn: MqttConnection) -> int | None: ...
    def forget(self, conn: MqttConnection) -> None: ...
    def refused(self, where: str, reason: str) -> None: ...


class _Answers:
    """The connection's answers in the order of the packets they answer: a slot is reserved
    when the packet arrives and filled when its batch is durable; the filled prefix is sent."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: deque[list[bytes | None]] = deque()

    def reserve(self) -> list[bytes | None]:
        slot: list[bytes | None] = [None]
        self._slots.append(slot)
        return slot

    def ready(self) -> list[bytes]:
        out: list[bytes] = []
        slots = self._slots
        while slots and slots[0][0] is not None:
            data = slots.popleft()[0]
            if data:
                out.append(data)
        return out


class MqttConnection(asyncio.Protocol):
    """One accepted socket (see the module docstring)."""

    def __init__(self, host: ConnectionHost, n: int, connect_s: float) -> None:
        self.host = host
        self.n = n
        self.proto = MqttProtocol(host.max_packet)
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.opened_at = time.monotonic()
        #: When the connection ends unless the device speaks (CONNECT deadline, then
        #: 1.5 keep-alives after the last packet; None: no keep-alive).
        self.deadline: float | None = self.opened_at + connect_s
        self.last_in = self.opened_at
        self.client_id = ""
        self.user: str | None = None
        self.clean = True
        self.keep_alive = 0
        self.will: tuple[str, bytes, int, bool] | None = None
        self.ended = False
        self._graceful = False
        self._has_record = False  # the store holds a session for this client id
        self._calls = 0  # engine operations in flight: reading pauses at the inflight bound
        self._reading_paused = False
        self._writing_paused = False
        self._out: list[bytes] = []  # written this turn of the loop, not sent yet
        self._answers: _Answers | None = None  # set once the client id is claimed
        self._accepted = False  # CONNACK sent
        # Delivery (created at CONNACK: an idle waiting connection carries none of it).
        self._granted: dict[str, int] = {}
        self._inbound2: set[int] = set()  # QoS 2 packet ids of a clean session awaiting PUBREL
        self._inflight: dict[int, int] = {}  # packet id -> backlog seq awaiting the device
        self._outstanding: deque[int] = deque()  # seqs handed to the device, in order
        self._done: set[int] = set()
        self._acked = 0  # every item up to this one is the device's
        self._ack_sent = 0  # the acked value last committed or being committed
        self._acking = False
        self._next = 1  # the next backlog seq to send
        self._heard = 0  # the highest backlog seq pushed so far
        # Pushed items not sent yet (the window was full), contiguous from _next; bounded.
        self._ahead: deque[Delivery] = deque()
        self._ahead_bytes = 0
        self._gap = False  # the store holds items beyond _next that memory does not
        self._fetching = False

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if peer else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.host.admit(self):
            self.ended = True
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        self.last_in = time.monotonic()
        if self.keep_alive:
            self.deadline = self.last_in + self.keep_alive * 1.5
        self.proto.receive(data)
        self._drain()
        self.host.flush_writes()

    def eof_received(self) -> bool | None:
        self.end("closed by the device")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.end("connection lost" if exc is None else f"connection lost ({exc})")

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._pump()

    # -- packets in ----------------------------------------------------------------------------

    def _drain(self) -> None:
        """Handle every whole packet received, unless too many operations are in flight (then
        reading pauses: the device waits for its acknowledgements, as MQTT's flow control
        expects)."""
        while not self.ended and self._calls < self.host.inflight:
            try:
                packet = self.proto.next_packet()
                if packet is None:
                    break
                self._handle(packet)
            except MqttProtocolError as exc:
                self._violation(exc)
                return
        if self.transport is None or self.ended:
            return
        # Also while bytes wait unparsed (a CONNECT being decided, a client that pipelines
        # more than its operations allow): what a device can make the server buffer is bounded.
        busy = (
            self._calls >= self.host.inflight or self.proto.buffered > self.host.max_packet + _SLACK
        )
        if busy and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        elif not busy and self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    def _violation(self, exc: MqttProtocolError) -> None:
        self.host.refused(self.address, f"client {self.client_id!r}: {exc}")
        if self.proto.state is State.CONNECTING and exc.code is not None:
            self._write(self.proto.refuse(exc.code))
            self.end(str(exc), answered=True)
        else:
            self.end(str(exc), reason=exc.code or mc.PROTOCOL_ERROR)

    def _handle(self, packet: Any) -> None:
        if isinstance(packet, mc.Publish):
            self._publish(packet)
        elif isinstance(packet, mc.Ack):
            self._acknowledged(packet)
        elif isinstance(packet, mc.PingReq):
            self._answer_now(self.proto.pingresp())
        elif isinstance(packet, mc.Subscribe):
            self._subscribe(packet)
        elif isinstance(packet, mc.Unsubscribe):
            self._unsubscribe(packet)
        elif isinstance(packet, mc.Connect):
            self._connect(packet)
        elif isinstance(packet, mc.Disconnect):
            self._graceful = True
            if packet.code == 0x04:  # 5.0 "disconnect with will message"
                self._graceful = False
            self.end("DISCONNECT")

    # -- CONNECT -------------------------------------------------------------------------------

    def _connect(self, packet: mc.Connect) -> None:
        host = self.host
        if packet.version != mc.V311:
            # The codec reads 5.0; the session semantics of 5.0 (expiry, flow control, aliases)
            # are the next step. Until then a 5.0 client is told so in its own format and may
            # fall back to 3.1.1.
            raise MqttProtocolError("MQTT 5.0 is not served yet", mc.UNSUPPORTED_VERSION)
        if packet.keep_alive == 0 and not host.keepalive_0:
            raise MqttProtocolError(
                "keep-alive 0 refused (aaabus.mqtt.keepalive_0 is off)", mc.CLIENT_ID_NOT_VALID
            )
        if packet.keep_alive > host.max_keepalive:
            raise MqttProtocolError(
                f"keep-alive {packet.keep_alive} s over aaabus.mqtt.max_keepalive "
                f"({host.max_keepalive} s)",
                mc.CLIENT_ID_NOT_VALID,
            )
        will = packet.will
        if will is not None:
            if "+" in will.topic or "#" in will.topic or not will.topic:
                raise MqttProtocolError(
                    f"invalid will topic {will.topic[:60]!r}", mc.PROTOCOL_ERROR
                )
            self.will = (will.topic, will.payload, will.qos, will.retain)
        client_id = packet.client_id
        if not client_id:
            # MQTT: the server names a client that gives no id (clean sessions only; the codec
            # refuses an empty id with a persistent 3.1.1 session).
            client_id = f"auto-{uuid.uuid4().hex}"
        self.client_id = client_id
        self.clean = packet.clean
        self.user = packet.username
        self.keep_alive = packet.keep_alive
        host.authenticate(packet.username, packet.password, self._authenticated)

    def _authenticated(self, ok: bool) -> None:
        if self.ended:
            return
        if not ok:
            self.host.refused(self.address, f"bad credentials for user {self.user!r}")
            self._write(self.proto.refuse(mc.NOT_AUTHORIZED))
            self.end("bad credentials", answered=True)
            return
        refusal = self.host.claim(self)
        if refusal is not None:
            self._write(self.proto.refuse(refusal))
            self.end("refused", answered=True)
            return
        self.deadline = time.monotonic() + self.keep_alive * 1.5 if self.keep_alive else None
        self._answers = _Answers()
        sessions, cid, clean, user = self.host.sessions, self.client_id, self.clean, self.user
        stored = self._has_record = self.host.stored(cid)
        if clean and not stored:
            # Nothing to drop, nothing to create: a clean session's CONNECT writes nothing.
            self._opened(Opened(False, {}))
            return
        self._call(lambda: sessions.open_now(cid, clean, user), self._opened)

    def _opened(self, outcome: Any) -> None:
        if isinstance(outcome, BaseException) or self.ended:
            return
        self._has_record = not self.clean
        self.host.stored_changed(self.client_id, self.user, self._has_record)
        self._granted = dict(outcome.filters)
        self._write(self.proto.accept(outcome.present))
        self._accepted = True  # deliveries may go out from now on, never before CONNACK
        if self._has_record:
            self._gap = True  # a backlog may wait in the store
        self._fill()
        self._drain()  # packets the device sent before its CONNACK

    # -- PUBLISH from the device ---------------------------------------------------------------

    def _publish(self, packet: mc.Publish) -> None:
        host, sessions, cid = self.host, self.host.sessions, self.client_id
        topic, payload, qos, retain, pid = (
            packet.topic,
            packet.payload,
            packet.qos,
            packet.retain,
            packet.packet_id,
        )
        if not topic:
            raise MqttProtocolError("topic aliases are not enabled here", mc.TOPIC_ALIAS_INVALID)
        qos2_id: int | None = None
        if qos == 2:
            if self.clean:
                if pid in self._inbound2:  # a retransmission: published already
                    self._answer_now(self.proto.ack(mc.PUBREC, pid or 0))
                    return
                self._inbound2.add(pid or 0)
            else:
                qos2_id = pid
        user = self.user
        if retain and user is not None:
            size = len(payload)

            def op() -> Any:
                refusal = sessions.retain_now(
                    user, topic, size, host.retained, host.retained_bytes, host.retained_total
                )
                if refusal is not None:
                    return refusal
                return sessions.publish_now(cid, topic, payload, retain, qos, qos2_id)

        else:

            def op() -> Any:
                return sessions.publish_now(cid, topic, payload, retain, qos, qos2_id)

        if qos == 0:
            self._call(op, self._ignore_refusal)
            return
        kind = mc.PUBACK if qos == 1 else mc.PUBREC
        slot = self._reserve()

        def answered(outcome: Any) -> None:
            code = mc.SUCCESS
            if isinstance(outcome, str):
                host.refused(self.address, f"client {cid!r}: retained message refused: {outcome}")
                code = mc.QUOTA_EXCEEDED
            slot[0] = self.proto.ack(kind, pid or 0, code)

        self._call(op, answered, slot)

    def _ignore_refusal(self, outcome: Any) -> None:
        if isinstance(outcome, str):
            self.host.refused(self.address, f"client {self.client_id!r}: {outcome}")

    # -- acknowledgements from the device ------------------------------------------------------

    def _acknowledged(self, packet: mc.Ack) -> None:
        pid, kind = packet.packet_id, packet.kind
        if kind == mc.PUBREL:
            self._release(pid)
            return
        seq = self._inflight.get(pid)
        if seq is None:
            return  # unknown id (a late duplicate): nothing to do
        if kind == mc.PUBREC:
            cid, sessions = self.client_id, self.host.sessions

            def then(_outcome: Any) -> None:
                if self._inflight.get(pid) == seq:
                    self._write(self.proto.ack(mc.PUBREL, pid))

            self._call(lambda: sessions.received_now(cid, seq), then)
            return
        del self._inflight[pid]
        self._finished(seq)
        self._pump()

    def _release(self, pid: int) -> None:
        """PUBREL of an inbound QoS 2 flow: PUBCOMP (after the store forgets it, persistent)."""
        if self.clean:
            self._inbound2.discard(pid)
            self._answer_now(self.proto.ack(mc.PUBCOMP, pid))
            return
        cid, sessions = self.client_id, self.host.sessions
        slot = self._reserve()

        def then(_outcome: Any) -> None:
            slot[0] = self.proto.ack(mc.PUBCOMP, pid)

        self._call(lambda: sessions.release_now(cid, pid), then, slot)

    def _finished(self, seq: int) -> None:
        """Item ``seq`` is the device's: advance the cumulative ack over the finished prefix
        (QoS 1 and 2 flows finish in order, QoS 0 at once) and commit it soon."""
        self._done.add(seq)
        outstanding, done = self._outstanding, self._done
        while outstanding and outstanding[0] in done:
            self._acked = outstanding.popleft()
            done.discard(self._acked)
        if self._acked > self._ack_sent and not self._acking:
            self._commit_ack()

    def _commit_ack(self) -> None:
        self._acking = True
        self._ack_sent = acked = self._acked
        cid, sessions = self.client_id, self.host.sessions

        def then(_outcome: Any) -> None:
            self._acking = False
            if self._acked > self._ack_sent and not self.ended:
                self._commit_ack()

        # Lazy: a crash before it is durable only resends what the device had (QoS 1 allows
        # it; a QoS 2 item goes as PUBREL, which the device answers without delivering).
        self._call(lambda: sessions.ack_now(cid, acked), then, lazy=True)

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------------

    def _subscribe(self, packet: mc.Subscribe) -> None:
        codes: list[int] = []
        wanted: list[tuple[str, int]] = []
        room = self.host.max_filters - len(self._granted)
        for topic_filter, options in packet.topics:
            qos = options & 0x03
            if topic_filter not in self._granted:
                if room <= 0:
                    codes.append(mc.QUOTA_EXCEEDED)
                    continue
                room -= 1
            wanted.append((topic_filter, qos))
            codes.append(qos)
        if len(wanted) < len(packet.topics):
            self.host.refused(
                self.address,
                f"client {self.client_id!r}: over aaabus.mqtt.max_filters "
                f"({self.host.max_filters}) filters",
            )
        for topic_filter, qos in wanted:
            self._granted[topic_filter] = qos
        proto, pid = self.proto, packet.packet_id
        if not wanted:
            self._answer_now(proto.suback(pid, codes))
            return
        cid, user, clean, sessions = self.client_id, self.user, self.clean, self.host.sessions
        slot = self._reserve()
        had_record = self._has_record
        self._has_record = True

        def then(outcome: Any) -> None:
            slot[0] = proto.suback(pid, codes)
            if not had_record:
                self.host.stored_changed(cid, user, True)

        self._call(lambda: sessions.subscribe_now(cid, user, clean, wanted), then, slot)

    def _unsubscribe(self, packet: mc.Unsubscribe) -> None:
        filters = list(packet.filters)
        codes = [mc.SUCCESS if f in self._granted else 0x11 for f in filters]  # 0x11: none
        for topic_filter in filters:
            self._granted.pop(topic_filter, None)
        proto, pid = self.proto, packet.packet_id
        cid, sessions = self.client_id, self.host.sessions
        slot = self._reserve()

        def then(_outcome: Any) -> None:
            slot[0] = proto.unsuback(pid, codes)

        self._call(lambda: sessions.unsubscribe_now(cid, filters), then, slot)

    # -- delivery ------------------------------------------------------------------------------

    def pushed(self, seq: int, item: Delivery) -> None:
        """The session's mailbox appended ``item`` as ``seq`` (durable): send it now if it is
        the next one and there is room; keep it in memory while the window is full (up to
        ``queued_bytes`` of payload); beyond, let the store catch the connection up."""
        if not self._accepted or self.ended or seq < self._next:
            return
        if seq > self._heard:
            self._heard = seq
        ahead = self._ahead
        if self._gap or seq != self._next + len(ahead):
            if seq >= self._next + len(ahead):
                self._gap = True  # what lies between is in the store only
                self._fill()
            return
        size = len(item.payload)
        if ahead and self._ahead_bytes + size > self.host.queued_bytes:
            self._gap = True  # the store keeps it; memory stays bounded
            return
        ahead.append(item)
        self._ahead_bytes += size
        self._pump()

    def _room(self) -> bool:
        return len(self._inflight) < self.host.inflight and not self._writing_paused

    def _pump(self) -> None:
        """Send what waits in memory while there is room, then ask the store for the rest."""
        ahead = self._ahead
        while ahead and self._room():
            item = ahead.popleft()
            self._ahead_bytes -= len(item.payload)
            self._send(item)
        if not ahead and self._gap:
            self._fill()

    def _fill(self) -> None:
        """Take from the store what lies beyond what was sent and is not in memory, a window at
        a time, once at least half the window is free (a read: the batch writes nothing)."""
        if not self._accepted or self.ended or self._fetching or not self._gap or self._ahead:
            return
        window = self.host.inflight
        free = window - len(self._inflight)
        if (free < max(1, window // 2) and self._inflight) or self._writing_paused:
            return
        self._fetching = True
        cid, sessions, after = self.client_id, self.host.sessions, self._next - 1

        def then(outcome: Any) -> None:
            self._fetching = False
            if self.ended or isinstance(outcome, BaseException):
                return
            items: list[Delivery] = outcome or []
            for item in items:
                if item.seq >= self._next:
                    self._send(item)
            if len(items) < free:
                # The store had nothing more when it answered. What was announced before the
                # answer and not given was dropped at the backlog limit; what its own batch
                # appended is announced after it, in order.
                self._next = max(self._next, self._heard + 1)
                self._gap = False
            self._pump()

        self._call(lambda: sessions.take_now(cid, after, free), then)

    def _send(self, item: Delivery) -> None:
        seq = item.seq
        self._next = seq + 1
        self._outstanding.append(seq)
        if item.qos < 0:
            self._finished(seq)
            return
        granted = max((self._granted.get(f, 0) for f in item.filters), default=0)
        qos = min(granted, item.qos)
        pid = packet_id(seq)
        if qos == 0:
            data = self.proto.publish(item.topic, item.payload, 0, item.retained, False, None)
            self._write(data)
            self._finished(seq)
            return
        self._inflight[pid] = seq
        if item.release:
            self._write(self.proto.ack(mc.PUBREL, pid))
        else:
            self._write(
                self.proto.publish(item.topic, item.payload, qos, item.retained, False, pid)
            )

    # -- engine operations and answers ---------------------------------------------------------

    def _call(
        self,
        fn: Callable[[], Any],
        then: Callable[[Any], None],
        slot: list[bytes | None] | None = None,
        *,
        lazy: bool = False,
    ) -> None:
        self._calls += 1

        def done(outcome: Any) -> None:
            self._calls -= 1
            if isinstance(outcome, BaseException):
                log.warning(
                    "server %s: MQTT client %r: not committed (%s)",
                    self.host.server_id,
                    self.client_id,
                    outcome,
                )
                if slot is not None:
                    slot[0] = b""
                self.end("not committed")
                return
            if not self.ended:
                then(outcome)
                if slot is not None:
                    self._flush_answers()
                if self._reading_paused or self.proto.buffered:
                    self._drain()

        self.host.op(self, fn, done, lazy=lazy)

    def _reserve(self) -> list[bytes | None]:
        assert self._answers is not None
        return self._answers.reserve()

    def _answer_now(self, data: bytes) -> None:
        self._reserve()[0] = data
        self._flush_answers()

    def _flush_answers(self) -> None:
        if self._answers is not None:
            for data in self._answers.ready():
                self._write(data)

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for the socket: what one turn of the loop sends a device leaves in
        one system call (:meth:`flush`, which the listener calls at the end of each handler,
        and which a first write also schedules, so that nothing waits for another event)."""
        if data:
            if not self._out:
                self.host.dirty(self)
            self._out.append(data)

    def flush(self) -> None:
        """Send what :meth:`_write` queued (loop thread)."""
        out, self._out = self._out, []
        transport = self.transport
        if out and transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))

    # -- the end -------------------------------------------------------------------------------

    def end(self, why: str, *, reason: int | None = None, answered: bool = False) -> None:
        """End the connection (loop thread, any time, idempotent): tell a 5.0 device
        ``reason``, publish the will unless it said DISCONNECT, delete a clean session."""
        if self.ended:
            return
        self.ended = True
        log.debug("server %s: MQTT connection %s ends: %s", self.host.server_id, self.n, why)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if not answered and reason is not None and self.proto.state is State.CONNECTED:
                self._write(self.proto.disconnect(reason))
            self.flush()
            transport.close()  # sends what is queued first
        connected = self._answers is not None
        self.host.forget(self)
        if not connected:
            return
        will = None if self._graceful else self.will
        if will is None and self.clean and not self._has_record:
            return  # nothing in the store to change
        cid, sessions, now, clean, host = (
            self.client_id,
            self.host.sessions,
            time.time(),
            self.clean,
            self.host,
        )

        def then(_outcome: Any) -> None:
            if clean:  # close_now deleted it
                host.stored_changed(cid, None, False)

        host.op(self, lambda: sessions.close_now(cid, will, now), then)
