"""A device on a bare socket that speaks MQTT 3.1.1 or 5.0 packet by packet (issue 48): for the
QoS 2 retransmissions a library hides (paho resends a flow only on its own terms and drops a
duplicate by packet id before the test could see it). Packets are built and read with
:mod:`aaabus.mqtt.codec`, which tests/test_mqtt_codec.py checks against paho and the
specification."""

from __future__ import annotations

import socket
import time
from typing import Any

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq


class RawClient:
    """One TCP connection to an MQTT listener on 127.0.0.1, at protocol level ``version``
    (``mq.V311`` or ``mq.V5``). Every read has a deadline; nothing runs in the background."""

    def __init__(self, port: int, version: int) -> None:
        self.version = version
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self._buffer = bytearray()

    def send(self, *packets: mc.Packet) -> None:
        self.sock.sendall(b"".join(mc.encode(p, self.version) for p in packets))

    def packet(self, timeout: float = 10.0) -> mc.Packet:
        """The server's next packet, decoded; EOFError when the server closed, TimeoutError
        when nothing whole came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while (found := mc.split(self._buffer, 1 << 28)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole packet from the server in {timeout} s")
            self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed by the server")
            self._buffer += chunk
        first, at, total = found
        body = bytes(self._buffer[at:total])
        del self._buffer[:total]
        return mc.decode(first, body, self.version, from_client=False)

    def connect(self, client_id: str, *, clean: bool, expiry: int | None = None) -> mc.ConnAck:
        """CONNECT and its CONNACK (which must accept). ``expiry``: 5.0's Session Expiry
        Interval, what makes a 5.0 session outlive its connection."""
        props: dict[int, Any] = {} if expiry is None else {mq.SESSION_EXPIRY: expiry}
        self.send(mc.Connect(self.version, client_id, clean, 60, None, None, None, props))
        connack = self.packet()
        assert isinstance(connack, mc.ConnAck) and connack.code == 0, connack
        return connack

    def subscribe(self, topic_filter: str, qos: int, packet_id: int = 1) -> None:
        self.send(mc.Subscribe(packet_id, [(topic_filter, qos)]))
        suback = self.packet()
        assert isinstance(suback, mc.SubAck) and suback.codes == [qos], suback

    def publish(self, topic: str, payload: bytes, qos: int, packet_id: int, dup: bool) -> None:
        self.send(mc.Publish(topic, payload, qos, False, dup, packet_id))

    def ack(self, kind: int, packet_id: int) -> None:
        self.send(mc.Ack(kind, packet_id))

    def expect_ack(self, kind: int, packet_id: int) -> None:
        """The next packet is the acknowledgement ``kind`` of ``packet_id``, with success."""
        got = self.packet()
        assert isinstance(got, mc.Ack), got
        assert (got.kind, got.packet_id, got.code) == (kind, packet_id, mq.SUCCESS), got

    def close(self) -> None:
        self.sock.close()
