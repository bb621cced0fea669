"""Helpers of the MQTT tests: paho devices that collect what they receive, and the Debian
``mosquitto_pub``/``mosquitto_sub`` tools."""

from __future__ import annotations

import queue
import shutil
import socket
import subprocess
import time
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq

#: The Debian clients (package mosquitto-clients); tests that run them skip without them.
TOOLS = shutil.which("mosquitto_pub") is not None and shutil.which("mosquitto_sub") is not None
needs_tools = pytest.mark.skipif(not TOOLS, reason="apt-get install mosquitto-clients")


class Device:
    """A paho client (MQTT 3.1.1) whose received messages land in :attr:`inbox`.

    ``connect()`` waits for CONNACK and returns its reason code (0: accepted)."""

    def __init__(
        self,
        port: int,
        client_id: str,
        *,
        clean: bool = True,
        user: str | None = None,
        password: str | None = None,
        will: tuple[str, bytes, int] | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.port = port
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean
        )
        self.inbox: queue.Queue[tuple[str, bytes, int, bool]] = queue.Queue()
        self.connack: queue.Queue[Any] = queue.Queue()
        self.suback: queue.Queue[Any] = queue.Queue()
        self.client.on_message = lambda _c, _u, m: self.inbox.put(
            (m.topic, bytes(m.payload), m.qos, bool(m.retain))
        )
        self.client.on_connect = lambda _c, _u, flags, rc, _p: self.connack.put(
            (rc.value, flags.session_present)
        )
        self.client.on_subscribe = lambda _c, _u, mid, codes, _p: self.suback.put(mid)
        if user is not None:
            self.client.username_pw_set(user, password)
        if will is not None:
            self.client.will_set(will[0], will[1], will[2])
        if tls_ca is not None:
            self.client.tls_set(ca_certs=tls_ca)
            self.client.tls_insecure_set(True)  # the test certificate names 127.0.0.1 only

    def connect(self, timeout: float = 10.0, keepalive: int = 30) -> tuple[int, bool]:
        self.client.connect("127.0.0.1", self.port, keepalive=keepalive)
        self.client.loop_start()
        result: tuple[int, bool] = self.connack.get(timeout=timeout)
        return result

    def pause(self) -> None:
        """Stop paho's network thread: no packet is read or written, no reconnection tried."""
        self.client.loop_stop()

    def resume(self, timeout: float = 10.0) -> tuple[int, bool]:
        """Reconnect once (paho resends its unfinished QoS flows) and restart the thread."""
        self.client.reconnect()
        self.client.loop_start()
        result: tuple[int, bool] = self.connack.get(timeout=timeout)
        return result

    def subscribe(self, topic_filter: str, qos: int, timeout: float = 10.0) -> None:
        self.client.subscribe(topic_filter, qos)
        self.suback.get(timeout=timeout)

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos, retain).wait_for_publish(10)

    def receive(self, count: int, timeout: float = 20.0) -> list[tuple[str, bytes, int, bool]]:
        """Exactly ``count`` messages (fails if fewer arrive by the deadline)."""
        deadline = time.monotonic() + timeout
        out: list[tuple[str, bytes, int, bool]] = []
        while len(out) < count:
            out.append(self.inbox.get(timeout=max(0.01, deadline - time.monotonic())))
        return out

    def nothing_before(self, topic: str, via: Device | None = None) -> bool:
        """Whether nothing else arrives before a marker published now on ``topic`` (one this
        device receives), by ``via`` or by this device itself: what a time window would only
        suggest, the marker proves, since the bus keeps one publisher's order."""
        marker = f"marker {time.monotonic_ns()}".encode()
        (via or self).publish(topic, marker, 1)
        got = self.receive(1)[0]
        return got[:2] == (topic, marker)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Device5(Device):
    """A paho client speaking MQTT 5.0, otherwise a :class:`Device`. ``expiry``, ``receive_max``
    and ``max_packet``: the CONNECT's Session Expiry Interval, Receive Maximum and Maximum
    Packet Size; ``clean_start``: 5.0's Clean Start; ``manual_ack``: the test acknowledges
    (:meth:`ack`). ``connect()`` returns (reason code, session present) and keeps CONNACK's
    properties in :attr:`connack_props`; a DISCONNECT's reason code lands in :attr:`disconnects`
    (the server's, or paho's own when the socket closes)."""

    def __init__(
        self,
        port: int,
        client_id: str,
        *,
        clean_start: bool = True,
        expiry: int | None = None,
        receive_max: int | None = None,
        max_packet: int | None = None,
        manual_ack: bool = False,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.port = port
        self.clean_start = clean_start
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=MQTTProtocolVersion.MQTTv5
        )
        self.inbox: queue.Queue[tuple[str, bytes, int, bool]] = queue.Queue()
        self.mids: queue.Queue[tuple[int, int]] = queue.Queue()  # (mid, qos) of each message
        self.connack: queue.Queue[Any] = queue.Queue()
        self.suback: queue.Queue[Any] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self.connack_props: dict[str, Any] = {}
        self.properties = Properties(PacketTypes.CONNECT)
        if expiry is not None:
            self.properties.SessionExpiryInterval = expiry
        if receive_max is not None:
            self.properties.ReceiveMaximum = receive_max
        if max_packet is not None:
            self.properties.MaximumPacketSize = max_packet
        self.client.manual_ack_set(manual_ack)

        def message(_c: Any, _u: Any, m: Any) -> None:
            self.mids.put((m.mid, m.qos))
            self.inbox.put((m.topic, bytes(m.payload), m.qos, bool(m.retain)))

        def connected(_c: Any, _u: Any, flags: Any, rc: Any, props: Any) -> None:
            self.connack_props = props.json() if props is not None else {}
            self.connack.put((rc.value, flags.session_present))

        self.client.on_message = message
        self.client.on_connect = connected
        self.client.on_subscribe = lambda _c, _u, mid, codes, _p: self.suback.put(mid)
        self.client.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc.value)
        if user is not None:
            self.client.username_pw_set(user, password)

    def connect(self, timeout: float = 10.0, keepalive: int = 30) -> tuple[int, bool]:
        self.client.connect(
            "127.0.0.1",
            self.port,
            keepalive=keepalive,
            clean_start=self.clean_start,
            properties=self.properties,
        )
        self.client.loop_start()
        result: tuple[int, bool] = self.connack.get(timeout=timeout)
        return result

    def publish_props(
        self, topic: str, payload: bytes, qos: int, properties: Properties, retain: bool = False
    ) -> None:
        self.client.publish(topic, payload, qos, retain, properties).wait_for_publish(10)

    def ack(self, mid: int, qos: int) -> None:
        self.client.ack(mid, qos)

    def close(self, expiry: int | None = None) -> None:
        """DISCONNECT (with a new Session Expiry Interval if ``expiry`` is given)."""
        props = None
        if expiry is not None:
            props = Properties(PacketTypes.DISCONNECT)
            props.SessionExpiryInterval = expiry
        self.client.disconnect(properties=props)
        self.client.loop_stop()


class RawDevice5:
    """A device speaking MQTT 5.0 over a bare socket, its packets encoded and the server's
    decoded by :mod:`aaabus.mqtt.codec` (checked against paho and the specification in
    tests/test_mqtt_codec.py): for what a library would not send."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self._raw = RawDevice.__new__(RawDevice)
        self._raw.sock, self._raw._buffer = self.sock, b""

    def send(self, *packets: Any) -> None:
        self.sock.sendall(b"".join(mc.encode(p, mq.V5) for p in packets))

    def packet(self) -> Any:
        """The server's next packet, decoded; EOFError when the server closed."""
        first, body = self._raw.packet()
        return mc.decode(first, body, mq.V5, from_client=False)

    def until(self, kind: type, timeout: float = 10.0) -> Any:
        """Skip packets up to the first of ``kind`` (EOFError if the server closes first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            got = self.packet()
            if isinstance(got, kind):
                return got
        raise TimeoutError(f"no {kind.__name__} in {timeout} s")

    def connect(
        self,
        client_id: str = "",
        *,
        clean: bool = True,
        keep_alive: int = 30,
        properties: dict[int, Any] | None = None,
    ) -> mc.ConnAck:
        self.send(
            mc.Connect(mq.V5, client_id, clean, keep_alive, None, None, None, properties or {})
        )
        connack = self.packet()
        assert isinstance(connack, mc.ConnAck), connack
        return connack

    def nothing_queued(self) -> bool:
        """Whether the server had nothing queued for this device: a PINGREQ is answered on the
        connection in the order of the server's writes, so a packet it had already decided to
        send (a PUBLISH for a message that reached the session) comes before the PINGRESP. A
        marker through the server's own order, where :meth:`silent` can only wait."""
        self.send(mc.PingReq())
        got = self.packet()
        if isinstance(got, mc.PingResp):
            return True
        raise AssertionError(f"unexpected {got} before the PINGRESP")

    def silent(self, timeout: float = 0.3) -> bool:
        """Whether the server sends nothing for ``timeout`` seconds (an absence can only be
        shown by waiting: keep it short)."""
        self.sock.settimeout(timeout)
        try:
            got = self.packet()
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(10)
        raise AssertionError(f"unexpected {got}")

    def closed(self, timeout: float = 10.0) -> bool:
        """Whether the server closes the socket (and sends nothing more) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def tool(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run a mosquitto client tool to its end."""
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def connect_packet(
    client_id: str | bytes = "dev",
    level: int = 4,
    flags: int = 0x02,
    extra: bytes = b"",
    props: bytes = b"",
    keep_alive: int = 60,
) -> bytes:
    """A CONNECT built by hand (the codec under test must not build its own input); ``props``:
    a 5.0 property block, length included."""

    def text(s: str | bytes) -> bytes:
        raw = s if isinstance(s, bytes) else s.encode()
        return len(raw).to_bytes(2, "big") + raw

    body = (
        text("MQTT")
        + bytes([level, flags])
        + keep_alive.to_bytes(2, "big")
        + props
        + text(client_id)
        + extra
    )
    return bytes([0x10]) + varint(len(body)) + body


def publish_packet(topic: bytes, payload: bytes = b"x", qos: int = 1, pid: int = 7) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += pid.to_bytes(2, "big")
    body += payload
    return bytes([0x30 | qos << 1]) + varint(len(body)) + body


def subscribe_packet(filters: list[str], qos: int = 0, pid: int = 1) -> bytes:
    """One SUBSCRIBE of ``filters``, each at ``qos`` (remaining length as a varint)."""
    body = pid.to_bytes(2, "big")
    for topic_filter in filters:
        raw = topic_filter.encode()
        body += len(raw).to_bytes(2, "big") + raw + bytes([qos])
    return bytes([0x82]) + varint(len(body)) + body


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class RawDevice:
    """A device speaking MQTT 3.1.1 over a bare socket, packet by packet: for what a library
    would not do (never read, flood, stay silent). ``rcvbuf``: a small receive buffer makes a
    device that does not read fill up quickly."""

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self._buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def packet(self) -> tuple[int, bytes]:
        """The next whole packet from the server: (first byte, body); EOFError when closed."""
        while True:
            if len(self._buffer) >= 2:
                length, shift, at = 0, 0, 1
                while at < len(self._buffer):
                    byte = self._buffer[at]
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    at += 1
                    if not byte & 0x80:
                        if len(self._buffer) >= at + length:
                            first, body = self._buffer[0], self._buffer[at : at + length]
                            self._buffer = self._buffer[at + length :]
                            return first, body
                        break
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed by the server")
            self._buffer += chunk

    def connect(self, client_id: str, **kwargs: Any) -> int:
        """CONNECT; the CONNACK's return code."""
        self.send(connect_packet(client_id, **kwargs))
        first, body = self.packet()
        assert first == 0x20, first
        return body[1]

    def close(self) -> None:
        self.sock.close()
