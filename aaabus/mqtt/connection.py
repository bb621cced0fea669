"""One MQTT connection of the listener (:mod:`aaabus.mqtt.listener`): a device's packets in, the
bus's messages out, on the listener's event loop.

Everything here runs on the listener's loop thread (``mqtt-<server>``), which owns every
connection: no lock, no thread of its own. A connection is an :class:`asyncio.Protocol` whose
bytes go through a sans-IO :class:`~aaabus.mqtt.protocol.MqttProtocol`; what must touch the store
becomes an operation of the listener's next engine batch (:meth:`ConnectionHost.op`), and its
answer (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK, CONNACK of a persistent session) is sent
when that batch is durable. The QoS flows, their packet ids and the order of the answers are
the sans-IO :class:`~aaabus.mqtt.flows.QosFlows` (its table is the flows' documentation):
this adapter feeds it packets and durable commits and writes what it says.

Delivery is pushed: the session's mailbox hands each item to the listener once durable
(:meth:`MqttConnection.pushed`), and the connection sends it at once if it is the next one and
the window allows: at most ``aaabus.mqtt.inflight`` QoS 1/2 messages unacknowledged, and the
socket's queue under ``aaabus.mqtt.queued_bytes`` (asyncio's write-buffer flow control). When it
falls behind (a full window, a slow socket, a reconnection), it takes the rest from the store
(:meth:`~aaabus.mqtt.sessions.MqttSessions.take_now`), a window at a time; where it is in
the backlog is the sans-IO :class:`~aaabus.mqtt.backlog.Backlog`'s bookkeeping. The device's
acknowledgements are cumulated and committed in the next batch: the store forgets what the
device has.

What the CONNECT settled (:mod:`aaabus.mqtt.terms`: clean start and session expiry,
keep-alive, the device's Receive Maximum and Maximum Packet Size, CONNACK's properties) is the
connection's :attr:`MqttConnection.terms`; a 3.1.1 CONNECT gets terms too, in 3.1.1's rules.

A protocol violation, an oversized packet, a keep-alive lapse, a takeover, the listener's stop
or a closed socket ends the connection; a 5.0 device is told why (DISCONNECT with a reason).
The will is published when the connection ends without DISCONNECT (5.0: after its delay).
Nothing here raises to the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from aaabus.errors import MqttProtocolError, TopicError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt import messages as mm
from aaabus.mqtt.auth import Credentials
from aaabus.mqtt.backlog import Backlog
from aaabus.mqtt.batchtrace import BatchTrace
from aaabus.mqtt.flows import Do, QosFlows, Slot, Step
from aaabus.mqtt.protocol import MqttProtocol, State
from aaabus.mqtt.sessions import Delivery, MqttSessions, Opened, Will, accounted, packet_id
from aaabus.mqtt.shared import share_of
from aaabus.mqtt.terms import OutboundAliases, Terms, disconnect_expiry, negotiate

__all__ = ["ConnectionHost", "MqttConnection"]

#: Bytes a connection may hold unparsed beyond one whole packet before its socket is not read.
_SLACK = 65536
#: Seconds a connection the server ended keeps draining the device's input after its last
#: packet (see :meth:`MqttConnection._linger`): a deadline, so a device that never closes
#: costs a socket for this long at most.
LINGER_S = 2.0

log = logging.getLogger("aaabus.mqtt")


class ConnectionHost(Protocol):
    """What a connection uses of its listener (:class:`aaabus.mqtt.listener.MqttListener`); all of
    it on the loop thread."""

    server_id: int
    sessions: MqttSessions
    max_packet: int
    #: User properties per property section: (count, bytes); see codes.UserBound.
    user_bound: tuple[int, int]
    inflight: int
    queued_bytes: int
    max_filters: int
    max_keepalive: int
    keepalive_0: bool
    max_idle_s: float
    session_expiry_s: float
    topic_aliases: int
    credentials: Credentials | None
    published_out: int
    roaming: bool
    #: Where each batch's time goes (aaabus.trace only): told of every socket read.
    trace: BatchTrace | None

    def op(
        self,
        conn: MqttConnection,
        fn: Callable[[], Any],
        then: Callable[[Any], None],
        *,
        lazy: bool = False,
        flow: bool = False,
    ) -> None:
        """Run ``fn`` on the engine thread in the next batch; ``then(outcome)`` on the loop
        once it is durable (``outcome``: its result, or the exception it raised). ``lazy``:
        nobody waits for it; it may ride along with a later batch. ``flow``: a step of a
        publication's QoS flow (PUBLISH, PUBREL, PUBREC), whose answer may follow the batch's
        deliveries (:mod:`aaabus.mqtt.batches`)."""
        ...

    def admit(self, conn: MqttConnection) -> bool: ...
    def dirty(self, conn: MqttConnection) -> None: ...
    def flush_writes(self) -> None: ...
    def stored(self, client_id: str) -> bool: ...
    def stored_changed(self, client_id: str, user: str | None, present: bool) -> None: ...
    def authenticate(
        self,
        conn: MqttConnection,
        user: str | None,
        password: bytes | None,
        then: Callable[[bool | None], None],
    ) -> None: ...
    def claim(self, conn: MqttConnection) -> int | None: ...
    def await_session(self, conn: MqttConnection) -> None: ...
    def roam_refusal(self, conn: MqttConnection, reason: str) -> None: ...
    def may_publish(self, conn: MqttConnection, topic: str) -> bool: ...
    def may_subscribe(self, conn: MqttConnection, topic_filter: str) -> bool: ...
    def resumed(self, conn: MqttConnection) -> None: ...
    def forget(self, conn: MqttConnection) -> None: ...
    def refused(self, where: str, reason: str) -> None: ...
    def expires_in(self, seconds: float) -> None:
        """A session will be due for expiry in ``seconds`` (5.0's own expiry): sweep then."""
        ...

    def delay_will(self, client_id: str, will: Will, delay: float, user: str) -> None:
        """Publish ``client_id``'s will (for ``user``, an accounted name) in ``delay`` seconds
        unless its session is resumed."""
        ...

    def deadline_sooner(self, conn: MqttConnection) -> None:
        """``conn.deadline`` moved earlier: check it then, not at the deadline it had."""
        ...

    def lingered(self, change: int) -> bool:
        """One more (``change`` 1) or one less (-1) connection closing after its last packet;
        False, and not counted, when one more would be over the listener's bound."""
        ...


class MqttConnection(asyncio.Protocol):
    """One accepted socket (see the module docstring)."""

    def __init__(self, host: ConnectionHost, n: int, connect_s: float) -> None:
        self.host = host
        self.n = n
        self.proto = MqttProtocol(host.max_packet, host.user_bound)
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.opened_at = time.monotonic()
        #: When the connection ends unless the device speaks (CONNECT deadline, then
        #: :attr:`silence` after the last bytes received).
        self.deadline = self.opened_at + connect_s
        self.last_in = self.opened_at
        #: Seconds a connected device may stay silent: 1.5 keep-alives, at most max_idle_s
        #: (which alone bounds keep-alive 0); 0 until its CONNECT is admitted, so that the
        #: CONNECT deadline stays absolute whatever the device sends meanwhile.
        self.silence = 0.0
        self.client_id = ""
        self.user: str | None = None
        self.clean = True
        self.keep_alive = 0
        self.will: Will | None = None
        self.ended = False
        self._lingering = False  # closing after its last packet (see _linger)
        self._graceful = False
        self._has_record = False  # the store holds a session for this client id
        self._calls = 0  # engine operations in flight: reading pauses at the inflight bound
        self._reading_paused = False
        self._writing_paused = False
        self._out: list[bytes] = []  # written this turn of the loop, not sent yet
        self._claimed = False  # the client id is claimed: the end closes its session
        self._accepted = False  # CONNACK sent
        self._open_op: Callable[[], Any] | None = None  # what opens the session (roaming: again)
        # Delivery (created at CONNACK: an idle waiting connection carries none of it).
        self._granted: dict[str, int] = {}
        # 5.0 options of the filters that have any: filter -> (bits, subscription identifier).
        self._subopts: dict[str, tuple[int, int]] = {}
        # The QoS flows and the answers' order; what the CONNECT settles is added to it.
        self.flows = QosFlows(self.proto, host.inflight)
        self._ack_sent = 0  # the acked value last committed or being committed
        self._acking = False
        # Delivery: what is sent, what waits in memory, what is to be read from the store.
        self._backlog: Backlog[Delivery] = Backlog(host.queued_bytes)
        # What the CONNECT settled (aaabus.mqtt.terms); 3.1.1's fixed rules until then.
        self.terms = Terms(True, 0, 0, host.inflight)
        self._max_out = 0  # the device's Maximum Packet Size (0: none)
        self._told_too_large = False
        self._out_aliases: OutboundAliases | None = None  # only if the device allows them
        self._expiry_changed = False  # by the device's DISCONNECT
        self._will_delay = 0  # 5.0's Will Delay Interval, seconds

    @property
    def v5(self) -> bool:
        """Whether the device speaks MQTT 5.0 (known once its CONNECT is read)."""
        return self.proto.version == mq.V5

    def figures(self) -> dict[str, Any]:
        """What the console lists of this device (loop thread): its protocol, keep-alive, the
        QoS 1/2 deliveries it has not acknowledged, and its backlog (items of its session
        pushed to this server and not yet acknowledged by the device)."""
        return {
            "client": self.client_id,
            "protocol": "5.0" if self.v5 else "3.1.1",
            "address": self.address,
            "keep_alive": self.keep_alive,
            "clean": self.clean,
            "inflight": self.flows.in_flight,
            "backlog": max(0, self._backlog.heard - self.flows.acked),
        }

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
        if self.host.trace is not None:
            self.host.trace.reading()
        self.last_in = time.monotonic()
        if self.silence:
            self.deadline = self.last_in + self.silence
        self.proto.receive(data)
        self._drain()
        self.host.flush_writes()

    def eof_received(self) -> bool | None:
        self.end("closed by the device")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering:
            self._lingering = False
            self.host.lingered(-1)
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
            self.end(str(exc), reason=exc.code or mq.PROTOCOL_ERROR)

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
            self._disconnected(packet)

    # -- CONNECT -------------------------------------------------------------------------------

    def _connect(self, packet: mc.Connect) -> None:
        host = self.host
        client_id = packet.client_id
        # MQTT: the server names a client that gives no id (the codec refuses an empty id with
        # a persistent 3.1.1 session; 5.0 allows it, and is told the name in CONNACK).
        assigned = None if client_id else f"auto-{uuid.uuid4().hex}"
        self._settle(negotiate(packet, host, assigned if self.v5 else None))
        will = packet.will
        if will is not None:
            if "+" in will.topic or "#" in will.topic or not will.topic:
                raise MqttProtocolError(
                    f"invalid will topic {will.topic[:60]!r}", mq.PROTOCOL_ERROR
                )
            props = will.properties
            self._will_delay = props.pop(mq.WILL_DELAY, 0)  # the connection's, not the message's
            self.will = (will.topic, will.payload, will.qos, will.retain, props or None)
        self.client_id = client_id or assigned or ""
        self.user = packet.username
        host.authenticate(self, packet.username, packet.password, self._authenticated)

    def _authenticated(self, ok: bool | None) -> None:
        """The credentials checked (None: not checked, too many logins wait; refused busy)."""
        if self.ended:
            return
        if ok is None:
            self._write(self.proto.refuse(mq.SERVER_BUSY))  # 3.1.1: "server unavailable"
            self.end("server busy", answered=True)
            return
        if not ok:
            self.host.refused(self.address, f"bad credentials for user {self.user!r}")
            self._write(self.proto.refuse(self._credentials_refused()))
            self.end("bad credentials", answered=True)
            return
        refusal = self.host.claim(self)
        if refusal is not None:
            self._write(self.proto.refuse(refusal))
            self.end("refused", answered=True)
            return
        before = self.deadline
        idle = self.host.max_idle_s
        self.silence = min(self.keep_alive * 1.5, idle) if self.keep_alive else idle
        self.deadline = time.monotonic() + self.silence
        if self.deadline < before:
            self.host.deadline_sooner(self)  # a keep-alive shorter than the CONNECT deadline
        self._claimed = True
        sessions, cid, clean, user = self.host.sessions, self.client_id, self.clean, self.user
        stored = self._has_record = self.host.stored(cid)
        # Roaming: a clean CONNECT asks the store too, where the id's session may be arriving
        # or leaving (refused busy then: Roaming.refusal_now).
        if clean and not stored and not self.host.roaming:
            # Nothing to drop, nothing to create: a clean session's CONNECT writes nothing.
            self._opened(Opened(False, {}))
            return
        start, expiry = self.terms.clean_start, self.terms.expiry

        def open_op() -> Opened:
            return sessions.open_now(cid, start, user, expiry, time.time())

        self._open_op = open_op  # roaming: run again once the session has arrived
        self._call(open_op, self._opened)

    def _opened(self, outcome: Any) -> None:
        if isinstance(outcome, BaseException) or self.ended:
            return
        if outcome.awaited:  # roaming: the session is on its way (aaabus.mqtt.roaming)
            self.host.await_session(self)
            return
        if outcome.refused is not None:  # roaming: its session is moving here or from here
            self.host.roam_refusal(self, outcome.refused)
            return
        # 5.0: a session resumed by a connection with expiry 0 is in the store until it ends.
        self._has_record = not self.clean or outcome.present
        # Inbound QoS 2 state in memory for a session that ends with its connection and was
        # not resumed; a resumed one's is in the store, where its last connection left it.
        self.flows.volatile = self.clean and not outcome.present
        self.host.stored_changed(self.client_id, self.user, self._has_record)
        self._granted = dict(outcome.filters)
        self._subopts = dict(outcome.options)
        self.host.resumed(self)  # the ACL may have changed since its filters were granted
        self._write(self.proto.accept(outcome.present, self.terms.connack))
        self._accepted = True  # deliveries may go out from now on, never before CONNACK
        if self._has_record:
            self._backlog.gap = True  # a backlog may wait in the store
        self._fill()
        self._drain()  # packets the device sent before its CONNACK

    def session_arrived(self, present: bool) -> None:
        """Roaming: the session this CONNECT waits for is in the store now (loop thread): open
        it as the CONNECT asked, and answer ``present`` (False: the bus had none, it was
        created here)."""

        def then(outcome: Any) -> None:
            if not isinstance(outcome, BaseException) and not outcome.awaited:
                outcome = dataclasses.replace(outcome, present=present)
            self._opened(outcome)

        if self._open_op is not None:
            self._call(self._open_op, then)

    def roam_refused(self, code: int, why: str) -> None:
        """Roaming: this CONNECT gets no session (loop thread): CONNACK ``code`` (5.0 reason,
        said in the device's version), then close. Never accepted: no will, nothing to write."""
        self._claimed = False
        self._write(self.proto.refuse(code))
        self.end(why, answered=True)

    # -- MQTT 5.0: the connection's terms (see aaabus.mqtt.terms) ----------------------------

    def _settle(self, terms: Terms) -> None:
        """Keep what the CONNECT settled (loop thread)."""
        self.terms = terms
        self.clean = terms.ends  # the session ends with the connection
        self.keep_alive = terms.keep_alive
        self._max_out = terms.max_out
        self.flows.settle(terms.window, self.host.inflight, self.host.topic_aliases)
        if self.v5 and terms.aliases_out:
            self._out_aliases = OutboundAliases(terms.aliases_out)

    def _credentials_refused(self) -> int:
        """The CONNACK reason of a CONNECT whose credentials are refused: 5.0 tells "bad user
        name or password" (0x86) from "not authorized" (0x87: no name, or nobody may connect);
        3.1.1's code stays 0x05 ("not authorized"), as before 5.0 was served."""
        if self.v5 and self.user is not None and self.host.credentials is not None:
            return mq.BAD_CREDENTIALS
        return mq.NOT_AUTHORIZED

    def _disconnected(self, packet: mc.Disconnect) -> None:
        """The device's DISCONNECT: 5.0 may change the session's expiry. A change from 0 is a
        protocol error: the device is told (0x82) and its will is published."""
        try:
            expiry = disconnect_expiry(self.terms, packet, self.host)
        except MqttProtocolError as exc:
            self.host.refused(self.address, f"client {self.client_id!r}: {exc}")
            self._graceful = False
            self._write(mc.encode(mc.Disconnect(mq.PROTOCOL_ERROR, {}), mq.V5))
            self.end(str(exc), answered=True)
            return
        if expiry is not None and expiry != self.terms.expiry:
            self.terms.expiry = expiry
            self.clean = expiry == 0
            self._expiry_changed = True
        self.end("DISCONNECT")

    def _fits(self, item: Delivery, data: bytes) -> bool:
        """Whether the PUBLISH ``data`` is within the device's Maximum Packet Size. One over it
        is not sent and counts as delivered (5.0 §3.1.2.24); said once per connection in the
        log."""
        size = len(data)
        if not self._max_out or size <= self._max_out:
            return True
        if not self._told_too_large:
            self._told_too_large = True
            self.host.refused(
                self.address,
                f"client {self.client_id!r}: a message on {item.topic[:60]!r} of {size} bytes "
                f"is over the device's maximum packet size ({self._max_out}); not sent (nor "
                "the next ones so large, which are not logged)",
            )
        return False

    def _undelayed(self, will: Will | None) -> Any:
        """``will`` if it goes out as the connection ends; None if there is none, or if a 5.0
        Will Delay Interval hands it to the listener, which publishes it when the delay or the
        session ends, whichever comes first, unless a connection resumes the session before
        (5.0 §3.1.3.2.2)."""
        if will is None or not self._will_delay or self.clean:
            return will  # no delay, or the session ends now: the will with it
        assert self.terms.expiry is not None  # 5.0 (3.1.1 has no will delay)
        delay = min(self._will_delay, self.terms.expiry)
        self.host.delay_will(self.client_id, will, delay, accounted(self.user))
        return None

    def _expiry_at_close(self) -> None:
        """The session's 5.0 expiry as the connection ends (loop thread, from :meth:`end`,
        before the session is closed): what the DISCONNECT changed goes to the store first; an
        expiry shorter than the listener's usual sweep has the sweep come on time."""
        expiry, sessions, cid = self.terms.expiry, self.host.sessions, self.client_id
        if expiry is None:
            return
        if self._expiry_changed:
            self.host.op(self, lambda: sessions.expiry_now(cid, expiry), lambda _outcome: None)
        if expiry:
            self.host.expires_in(expiry)

    def _not_committed(self) -> None:
        """An operation of this connection failed in the store: a CONNECT is refused with
        "server unavailable" (0x88; 3.1.1: 0x03), a 5.0 device connected is told "unspecified
        error" (0x80), and the connection ends."""
        if self.proto.state is State.CONNECTING:
            self._write(self.proto.refuse(mq.SERVER_UNAVAILABLE))
            self.end("not committed", answered=True)
        else:
            self.end("not committed", reason=mq.UNSPECIFIED)

    def shutdown(self) -> None:
        """The listener stops (loop thread): a 5.0 device is told so (0x8B), the socket is cut.
        Nothing is written to the store: wills and clean sessions are the next boot's."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self.ended and self.proto.state is State.CONNECTED:
            data = self.proto.disconnect(mq.SERVER_SHUTTING_DOWN)
            if data:
                self._out.append(data)
            self.flush()
        self.ended = True
        transport.abort()

    # -- PUBLISH from the device ---------------------------------------------------------------

    def _publish(self, packet: mc.Publish) -> None:
        host, sessions, cid, flows = self.host, self.host.sessions, self.client_id, self.flows
        payload, qos, retain, pid = packet.payload, packet.qos, packet.retain, packet.packet_id or 0
        topic = flows.arrive(packet)  # 5.0: the alias resolved, the Receive Maximum kept
        props = mm.message_props(packet.properties, time.time()) if packet.properties else None
        if props is not None and mm.bad_payload(props, payload):
            self._refuse_publish(packet, mq.PAYLOAD_FORMAT_INVALID, "payload is not UTF-8")
            return
        if not host.may_publish(self, topic):  # the ACL (aaabus.mqtt.acl), and $ topics
            self._refuse_publish(packet, mq.NOT_AUTHORIZED, f"not authorized on {topic[:60]!r}")
            return
        step = flows.publish(qos, pid) if qos else Step(Do.PUBLISH)
        if step.do is Do.ANSWERED:  # a QoS 2 retransmission: published already
            self._flush_answers()
            return
        qos2_id = pid if step.do is Do.PUBLISH_ONCE else None
        user = accounted(self.user)

        def op() -> Any:  # the retained bounds are kept in there (publish_now)
            return sessions.publish_now(cid, topic, payload, retain, qos, qos2_id, props, user=user)

        if qos == 0:
            self._call(op, self._ignore_refusal)
            return

        def answered(outcome: Any) -> None:
            # publish_now's False: no subscriber matched (0x10, a success; 3.1.1 says 0).
            code = mq.SUCCESS if outcome is not False else mq.NO_MATCHING_SUBSCRIBERS
            if isinstance(outcome, str):
                host.refused(self.address, f"client {cid!r}: retained message refused: {outcome}")
                code = mq.QUOTA_EXCEEDED
            flows.published(step, qos, pid, code)

        self._call(op, answered, step.slot, flow=True)

    def _refuse_publish(self, packet: mc.Publish, code: int, why: str) -> None:
        """Do not publish ``packet``: a 5.0 device is told ``code`` in its PUBACK/PUBREC (a
        QoS 2 flow then ends there: nothing awaits a PUBREL), a 3.1.1 device is not told."""
        self.host.refused(self.address, f"client {self.client_id!r}: PUBLISH refused: {why}")
        self.flows.refuse(packet, code)
        self._flush_answers()

    def _ignore_refusal(self, outcome: Any) -> None:
        if isinstance(outcome, str):
            self.host.refused(self.address, f"client {self.client_id!r}: {outcome}")

    # -- acknowledgements from the device ------------------------------------------------------

    def _acknowledged(self, packet: mc.Ack) -> None:
        if packet.kind == mq.PUBREL:
            self._release(packet.packet_id)
            return
        flows = self.flows
        step = flows.acknowledged(packet)
        if step.do is Do.RECEIVE:
            cid, sessions, seq, pid = self.client_id, self.host.sessions, step.seq, packet.packet_id

            def then(_outcome: Any) -> None:
                self._write(flows.received(seq, pid).data)

            self._call(lambda: sessions.received_now(cid, seq), then, flow=True)
        elif step.do is Do.SEND_PUBREL:
            self._write(step.data)
        elif step.do is Do.FINISH:
            self._finished(step.seq)
            self._pump()

    def _release(self, pid: int) -> None:
        """PUBREL of an inbound QoS 2 flow: PUBCOMP (after the store forgets it, persistent)."""
        flows = self.flows
        step = flows.release(pid)
        if step.do is Do.ANSWERED:
            self._flush_answers()
            return
        cid, sessions = self.client_id, self.host.sessions
        self._call(
            lambda: sessions.release_now(cid, pid),
            lambda _outcome: flows.released(step, pid),
            step.slot,
            flow=True,
        )

    def _finished(self, seq: int) -> None:
        """Item ``seq`` is the device's: commit the cumulative ack soon if it moved."""
        if self.flows.finished(seq) and self.flows.acked > self._ack_sent and not self._acking:
            self._commit_ack()

    def _commit_ack(self) -> None:
        self._acking = True
        self._ack_sent = acked = self.flows.acked
        cid, sessions = self.client_id, self.host.sessions

        def then(_outcome: Any) -> None:
            self._acking = False
            if self.flows.acked > self._ack_sent and not self.ended:
                self._commit_ack()

        # Lazy: a crash before it is durable only resends what the device had (QoS 1 allows
        # it; a QoS 2 item goes as PUBREL, which the device answers without delivering).
        self._call(lambda: sessions.ack_now(cid, acked), then, lazy=True)

    # -- SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------------

    def _subscribe(self, packet: mc.Subscribe) -> None:
        codes: list[int] = []
        wanted: list[tuple[str, int]] = []
        subopts = mm.subscription_options(packet.topics, packet.properties) if self.v5 else None
        room = self.host.max_filters - len(self._granted)
        for topic_filter, options in packet.topics:
            qos = options & 0x03
            if self._bad_share(topic_filter):  # 3.1.1: the codec leaves $share/ to us
                codes.append(mq.TOPIC_FILTER_INVALID)
                continue
            if not self.host.may_subscribe(self, topic_filter):  # the ACL (aaabus.mqtt.acl)
                codes.append(mq.NOT_AUTHORIZED)
                continue
            if topic_filter not in self._granted:
                if room <= 0:
                    codes.append(mq.QUOTA_EXCEEDED)
                    continue
                room -= 1
            wanted.append((topic_filter, qos))
            codes.append(qos)
        if mq.QUOTA_EXCEEDED in codes:
            self.host.refused(
                self.address,
                f"client {self.client_id!r}: over aaabus.mqtt.max_filters "
                f"({self.host.max_filters}) filters",
            )
        for topic_filter, qos in wanted:
            self._granted[topic_filter] = qos
            self._keep_options(topic_filter, subopts)
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

        self._call(lambda: sessions.subscribe_now(cid, user, clean, wanted, subopts), then, slot)

    def _bad_share(self, topic_filter: str) -> bool:
        """Whether ``topic_filter`` is a malformed shared subscription (logged as refused):
        SUBACK 0x8F (3.1.1: 0x80) for it alone. A 5.0 SUBSCRIBE with one is refused whole by
        the codec, as the spec says; 3.1.1 has no $share, which we accept as Mosquitto does."""
        try:
            share_of(topic_filter)
        except TopicError as exc:
            self.host.refused(self.address, f"client {self.client_id!r}: {exc}")
            return True
        return False

    def _keep_options(self, topic_filter: str, options: dict[str, tuple[int, int]] | None) -> None:
        """The 5.0 options of ``topic_filter``'s new subscription replace those it had."""
        keep = mm.kept(options, topic_filter)
        if keep != (0, 0):
            self._subopts[topic_filter] = keep
        elif self._subopts:
            self._subopts.pop(topic_filter, None)

    def _unsubscribe(self, packet: mc.Unsubscribe) -> None:
        filters = list(packet.filters)
        codes = [mq.SUCCESS if f in self._granted else 0x11 for f in filters]  # 0x11: none
        for topic_filter in filters:
            self._granted.pop(topic_filter, None)
            if self._subopts:
                self._subopts.pop(topic_filter, None)
        proto, pid = self.proto, packet.packet_id
        cid, sessions = self.client_id, self.host.sessions
        slot = self._reserve()

        def then(_outcome: Any) -> None:
            slot[0] = proto.unsuback(pid, codes)

        self._call(lambda: sessions.unsubscribe_now(cid, filters), then, slot)

    # -- delivery ------------------------------------------------------------------------------

    def send_status(self, topic: str, payload: bytes, retain: bool) -> None:
        """One of the listener's ``$SYS`` status messages, at QoS 0, outside the backlog (loop
        thread); skipped while the socket's queue is full (the next one replaces it)."""
        if self._accepted and not self.ended and not self._writing_paused:
            self._write(self.proto.publish(topic, payload, 0, retain, False, None))

    def pushed(self, seq: int, item: Delivery) -> None:
        """The session's mailbox appended ``item`` as ``seq`` (durable): send it now if it is
        the next one and there is room; keep it in memory while the window is full (up to
        ``queued_bytes`` of payload); beyond, let the store catch the connection up."""
        if not self._accepted or self.ended:
            return
        todo = self._backlog.pushed(seq, item)
        if todo == "pump":
            self._pump()
        elif todo == "fill":
            self._fill()

    def _room(self) -> bool:
        return self.flows.room() and not self._writing_paused

    def _pump(self) -> None:
        """Send what waits in memory while there is room, then ask the store for the rest."""
        backlog = self._backlog
        while backlog.waiting and self._room():
            self._send(backlog.pop())
        if not backlog.waiting and backlog.gap:
            self._fill()

    def _fill(self) -> None:
        """Take from the store what lies beyond what was sent and is not in memory, a window at
        a time (see :meth:`Backlog.to_read`; a read: the batch writes nothing)."""
        if not self._accepted or self.ended or self._writing_paused:
            return
        backlog = self._backlog
        free = backlog.to_read(self.flows.window, self.flows.in_flight)
        if not free:
            return
        backlog.fetching = True
        cid, sessions, after = self.client_id, self.host.sessions, backlog.next - 1

        def then(outcome: Any) -> None:
            backlog.fetching = False
            if self.ended or isinstance(outcome, BaseException):
                return
            items: list[Delivery] = outcome or []
            for item in items:
                if item.seq >= backlog.next:
                    self._send(item)
            backlog.read(len(items), free)
            self._pump()

        self._call(lambda: sessions.take_now(cid, after, free), then)

    def _send(self, item: Delivery) -> None:
        seq = item.seq
        self._backlog.sent(seq)
        self.flows.handed(seq)
        if item.qos < 0:
            self._finished(seq)
            return
        filters, retain, props = item.filters, item.retained, None
        if (item.props is not None or self._subopts) and not item.release:
            # 5.0's work, only for a message with properties or a device with options.
            shaped = mm.outgoing(item, self._subopts, self.client_id, self.v5, time.time())
            if shaped is None:  # expired, or the device's own under no-local: not for it
                self._finished(seq)
                return
            filters, retain, props = shaped
        granted = max((self._granted.get(f, 0) for f in filters), default=0)
        qos = min(granted, item.qos)
        self.host.published_out += not item.release  # for $SYS (a PUBREL resend is no message)
        pid = packet_id(seq)
        if item.release and qos:
            self._write(self.flows.resend_release(seq, pid).data)
            return
        name, aliases = item.topic, self._out_aliases
        if aliases is not None:  # a 5.0 device that allows topic aliases: one test for others
            name, props = aliases.apply(name, props)
        data = self.proto.publish(
            name, item.payload, qos, retain, False, pid if qos else None, props
        )
        if not self._fits(item, data):
            if aliases is not None:
                aliases.unsent(item.topic, name)
            self._finished(seq)  # 5.0 §3.1.2.24: as if sent and acknowledged
            return
        self._write(data)
        if qos:
            self.flows.sent(seq, pid, qos)
        else:
            self._finished(seq)

    # -- engine operations and answers ---------------------------------------------------------

    def _call(
        self,
        fn: Callable[[], Any],
        then: Callable[[Any], None],
        slot: Slot | None = None,
        *,
        lazy: bool = False,
        flow: bool = False,
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
                self._not_committed()
                return
            if not self.ended:
                then(outcome)
                if slot is not None:
                    self._flush_answers()
                if self._reading_paused or self.proto.buffered:
                    self._drain()

        self.host.op(self, fn, done, lazy=lazy, flow=flow)

    def _reserve(self) -> Slot:
        return self.flows.reserve()

    def _answer_now(self, data: bytes) -> None:
        self.flows.answer(data)
        self._flush_answers()

    def _flush_answers(self) -> None:
        for data in self.flows.ready():
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

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after a last packet the device must read (a DISCONNECT, a refusing CONNACK):
        closing a socket whose input is unread makes the kernel reset the connection, and a
        device still sending then fails on its write before it reads why. So the write side is
        shut after the queued bytes (FIN), what still arrives is read and dropped
        (:meth:`data_received` ignores an ended connection), and the socket closes when the
        device closes its side (:meth:`eof_received`) or :data:`LINGER_S` after this, whichever
        comes first. TLS has no half-close: closed at once; so is a connection beyond the
        listener's bound on lingering sockets (:meth:`ConnectionHost.lingered`)."""
        if not transport.can_write_eof() or not self.host.lingered(1):
            transport.close()
            return
        self._lingering = True
        transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

    def end(self, why: str, *, reason: int | None = None, answered: bool = False) -> None:
        """End the connection (loop thread, any time, idempotent): tell a 5.0 device
        ``reason``, publish the will unless it said DISCONNECT, delete a clean session."""
        if self.ended:
            return
        self.ended = True
        log.debug("server %s: MQTT connection %s ends: %s", self.host.server_id, self.n, why)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            told = answered
            if not answered and reason is not None and self.proto.state is State.CONNECTED:
                data = self.proto.disconnect(reason)
                self._write(data)
                told = bool(data)
            self.flush()
            if told:
                self._linger(transport)
            else:
                transport.close()  # sends what is queued first
        connected = self._claimed
        self.host.forget(self)
        if not connected:
            return
        will = self._undelayed(None if self._graceful else self.will)
        if will is None and self.clean and not self._has_record:
            return  # nothing in the store to change
        cid, sessions, now, clean, host = (
            self.client_id,
            self.host.sessions,
            time.time(),
            self.clean,
            self.host,
        )

        user, address = accounted(self.user), self.address

        def then(outcome: Any) -> None:
            if clean:  # close_now deleted it
                host.stored_changed(cid, None, False)
            if isinstance(outcome, str):
                host.refused(address, f"client {cid!r}: will refused: {outcome}")

        self._expiry_at_close()
        # What the device finished: its shared subscriptions' groups take back the rest.
        finished = (self.flows.acked, self.flows.finished_set())
        host.op(self, lambda: sessions.close_now(cid, will, now, finished, user=user), then)
