"""One MQTT connection's protocol, sans-IO: bytes in, packets out; decisions in, bytes out.

:class:`MqttProtocol` knows nothing of sockets, threads, clocks or sessions. Its owner feeds it
what the socket received (:meth:`MqttProtocol.receive`), pulls the client's packets one at a
time (:meth:`MqttProtocol.next_packet`), and asks it for the bytes of every answer
(:meth:`MqttProtocol.accept`, :meth:`MqttProtocol.publish`, ...). The version (3.1.1 or 5.0) is
fixed by the CONNECT; every encoding after it follows it.

Every state change is in :data:`TRANSITIONS`, keyed by the state and what happened: a packet
type the client sent, or one of the server's decisions (``"accept"``, ``"refuse"``,
``"close"``). Anything not in the table is a protocol violation: a packet before CONNECT, a
second CONNECT, a packet after DISCONNECT, an answer given twice. While the server decides on a
CONNECT (``CONNECTING``: checking credentials, opening the session in the store) the protocol
hands out nothing more: the client may already have sent its first SUBSCRIBE or PUBLISH (MQTT
lets it), and those wait, unparsed, until :meth:`MqttProtocol.accept`. Once connected, what
each QoS 1/2 packet does to its packet identifier's flow, and the order of the answers, is
:mod:`aaabus.mqtt.flows`'s table (:data:`~aaabus.mqtt.flows.FLOWS`).

A violation raises :class:`~aaabus.errors.MqttProtocolError` (one line) and closes the
protocol; its ``code`` is what to answer with: for a CONNECT, the CONNACK code in the client's
version (:meth:`MqttProtocol.refuse`), later the 5.0 reason of a DISCONNECT
(:meth:`MqttProtocol.disconnect`, which a 3.1.1 client is not sent).
"""

from __future__ import annotations

import enum
from typing import Any

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq

__all__ = ["TRANSITIONS", "MqttProtocol", "State", "connack_code"]


class State(enum.Enum):
    AWAIT_CONNECT = "await-connect"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSED = "closed"


_A, _C, _OK, _X = State.AWAIT_CONNECT, State.CONNECTING, State.CONNECTED, State.CLOSED

#: (state, event) -> next state. Events: the type of a packet received from the client, or a
#: decision of the server. The only place a connection's state changes.
TRANSITIONS: dict[tuple[State, int | str], State] = {
    (_A, mq.CONNECT): _C,
    (_A, "close"): _X,
    (_C, "accept"): _OK,
    (_C, "refuse"): _X,
    (_C, "close"): _X,
    (_OK, mq.PUBLISH): _OK,
    (_OK, mq.PUBACK): _OK,
    (_OK, mq.PUBREC): _OK,
    (_OK, mq.PUBREL): _OK,
    (_OK, mq.PUBCOMP): _OK,
    (_OK, mq.SUBSCRIBE): _OK,
    (_OK, mq.UNSUBSCRIBE): _OK,
    (_OK, mq.PINGREQ): _OK,
    (_OK, mq.DISCONNECT): _X,
    (_OK, "close"): _X,
    (_X, "close"): _X,
}

_NAMES = {
    mq.CONNECT: "CONNECT",
    mq.PUBLISH: "PUBLISH",
    mq.PUBACK: "PUBACK",
    mq.PUBREC: "PUBREC",
    mq.PUBREL: "PUBREL",
    mq.PUBCOMP: "PUBCOMP",
    mq.SUBSCRIBE: "SUBSCRIBE",
    mq.UNSUBSCRIBE: "UNSUBSCRIBE",
    mq.PINGREQ: "PINGREQ",
    mq.DISCONNECT: "DISCONNECT",
    mq.AUTH: "AUTH",
}

# A 5.0 CONNACK reason -> the 3.1.1 return code that says the same (3.1.1 has five).
_CONNACK_311 = {
    mq.SUCCESS: 0,
    mq.UNSUPPORTED_VERSION: mq.UNACCEPTABLE_PROTOCOL,
    mq.CLIENT_ID_NOT_VALID: mq.IDENTIFIER_REJECTED,
    mq.BAD_CREDENTIALS: mq.BAD_CREDENTIALS_311,
    mq.NOT_AUTHORIZED: mq.NOT_AUTHORIZED_311,
}


def connack_code(reason: int, version: int) -> int:
    """The CONNACK code of 5.0 reason ``reason`` in ``version``: 3.1.1 has five codes, and
    everything it cannot say (busy, quota, banned...) is "server unavailable". A code under
    0x80 is taken to be a 3.1.1 code already (the codec's, for a 3.1.1 CONNECT)."""
    if version == mq.V5 or reason < 0x80:
        return reason
    return _CONNACK_311.get(reason, mq.SERVER_UNAVAILABLE_311)


class MqttProtocol:
    """The protocol state of one connection (see the module docstring).

    ``max_packet``: largest packet accepted from the client, in bytes; ``bound``: the user
    properties one of its property sections may carry (:data:`mq.UserBound`).
    """

    __slots__ = ("_broken", "_buffer", "_pos", "bound", "max_packet", "state", "version")

    def __init__(self, max_packet: int, bound: mq.UserBound = mq.UNBOUNDED) -> None:
        self.max_packet = max_packet
        self.bound = bound
        self.state = State.AWAIT_CONNECT
        #: The protocol level of the CONNECT (:data:`mq.V311` or :data:`mq.V5`); 3.1.1 until then.
        self.version = mq.V311
        self._buffer = bytearray()
        self._pos = 0  # bytes of _buffer already handed out as packets
        self._broken = False  # the client broke the protocol: hand out nothing more

    def _move(self, event: int | str) -> None:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            state = self.state
            if isinstance(event, str):  # a bug of the owner, not of the client
                raise RuntimeError(f"MQTT server decision {event!r} while {state.value}")
            what = _NAMES.get(event, f"packet type {event}")
            if state is State.AWAIT_CONNECT:
                raise MqttProtocolError(f"{what} before CONNECT")
            raise MqttProtocolError(f"{what} not allowed while {state.value}", mq.PROTOCOL_ERROR)
        self.state = nxt

    # -- bytes in, packets out -----------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Append what the socket received."""
        if self._pos:
            del self._buffer[: self._pos]
            self._pos = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not handed out yet (a bound for the owner to check)."""
        return len(self._buffer) - self._pos

    def next_packet(self) -> Any | None:
        """The client's next whole packet, or None: more bytes are needed, or the server has a
        CONNECT to decide on, or the connection is closed. Raises :class:`MqttProtocolError`."""
        if self._broken or self.state is State.CONNECTING or self.state is State.CLOSED:
            return None
        view = memoryview(self._buffer)[self._pos :]
        kind = 0
        try:
            found = mc.split(view, self.max_packet)
            if found is None:
                return None
            first, start, total = found
            kind = first >> 4
            self._move(kind)  # before decoding: a packet out of order is refused as such
            body = view[start:total]
            if kind == mq.CONNECT and len(body) > 6 and body[6] == mq.V5:
                # The protocol level, read ahead: a refused 5.0 CONNECT is answered in 5.0.
                self.version = mq.V5
            packet = mc.decode(first, body, self.version, bound=self.bound)
        except MqttProtocolError:
            # The owner answers (refuse() for a CONNECT, disconnect()) or closes; nothing more
            # is handed out.
            self._broken = True
            raise
        finally:
            view.release()
        self._pos += total
        if isinstance(packet, mc.Connect):
            self.version = packet.version
        return packet

    # -- decisions in, bytes out ---------------------------------------------------------------

    def accept(self, session_present: bool, properties: dict[int, Any] | None = None) -> bytes:
        """CONNACK: the CONNECT is accepted. Packets received after it are handed out next."""
        self._move("accept")
        return mc.encode(mc.ConnAck(session_present, 0, properties or {}), self.version)

    def refuse(self, reason: int, properties: dict[int, Any] | None = None) -> bytes:
        """CONNACK with 5.0 reason ``reason`` (said in the client's version); the connection is
        over: close it once the bytes are sent."""
        self._move("refuse")
        code = connack_code(reason, self.version)
        props = properties if self.version == mq.V5 and properties else {}
        return mc.encode(mc.ConnAck(False, code, props), self.version)

    def disconnect(self, reason: int) -> bytes:
        """The server ends the connection: a 5.0 client is told why (DISCONNECT), a 3.1.1
        client is not (it has no DISCONNECT from the server); close once sent."""
        connected = self.state is State.CONNECTED
        self.close()
        if connected and self.version == mq.V5:
            return mc.encode(mc.Disconnect(reason, {}), mq.V5)
        return b""

    def close(self) -> None:
        """The connection ends (any state; a refused CONNECT is closed by :meth:`refuse`)."""
        self._move("close")

    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: dict[int, Any] | None = None,
    ) -> bytes:
        """PUBLISH; ``properties`` (5.0) are dropped for 3.1.1."""
        return mc.encode_publish(
            topic, payload, qos, retain, dup, packet_id, self.version, properties
        )

    def ack(self, kind: int, packet_id: int, code: int = 0) -> bytes:
        """PUBACK, PUBREC, PUBREL or PUBCOMP; ``code`` (5.0 reason) is dropped for 3.1.1."""
        return mc.encode_ack(kind, packet_id, self.version, code if self.version == mq.V5 else 0)

    def suback(self, packet_id: int, codes: list[int]) -> bytes:
        """SUBACK: per filter the granted QoS, or a 5.0 failure reason (>= 0x80), which 3.1.1
        says as its only failure code 0x80."""
        if self.version != mq.V5:
            codes = [c if c < 0x80 else 0x80 for c in codes]
        return mc.encode(mc.SubAck(packet_id, codes, {}), self.version)

    def unsuback(self, packet_id: int, codes: list[int]) -> bytes:
        return mc.encode(
            mc.UnsubAck(packet_id, codes if self.version == mq.V5 else [], {}), self.version
        )

    def pingresp(self) -> bytes:
        return mc.encode(mc.PingResp(), self.version)
