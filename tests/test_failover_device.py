"""The failover benchmark's device publishes a QoS 2 message once across a failover (issue 42).

``python -m perf failover`` counted, in one run of two, a QoS 2 publication made some 20-30 ms
before the kill delivered twice. The bus was not at fault: the old primary had taken the
PUBLISH, answered PUBREC, taken the PUBREL and forgotten the packet identifier (3.1.1 §4.3.3:
a later PUBLISH with it is a new message), and only its PUBCOMP was lost with it. The device
then walked the members, and paho (2.2.0) prepares its session again at *every* connection
attempt, a refused one included: the first turns the owed PUBREL into "resend PUBREL", the
second turns that into "send the PUBLISH again", as new (DUP clear). The new primary rightly
published it a second time.

Here one real server process plays the new primary, and a relay on another loopback address
plays the old one: it carries the device's first connection, eats the server's PUBCOMP, then
closes its port and the connection, as a killed primary does. The device, the benchmark's own
(:class:`perf.failover_load.Device`, paho underneath), finds the relay's address refused and
connects to the server: what the bus published is counted by a durable bus subscription, up
to the device's next publication (one publisher's order is kept, so a second copy would come
before it).
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.mqtt import codes as mq
from perf.failover_load import Connected, Device, Endpoints, Event
from tests.support.harness import published_before
from tests.test_mqtt_qos2_retransmit import Server

# A real server process: not in the fast lane.
pytestmark = pytest.mark.slow

TOPIC = "retx/failover"
#: Where the relay (the old primary) listens: another loopback address, the server's port.
OLD_PRIMARY = "127.0.0.2"


class Relay:
    """Forwards one MQTT connection from ``OLD_PRIMARY:port`` to the server on 127.0.0.1:port,
    reading the server's side packet by packet; at the first PUBCOMP it forwards nothing more:
    it closes its port, then the connection (the PUBCOMP is lost)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server((OLD_PRIMARY, port))
        self.cut = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="relay", daemon=True)]
        self._threads[0].start()

    def _run(self) -> None:
        device, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.port))
        up = threading.Thread(target=_pump, args=(device, server), name="relay-up", daemon=True)
        up.start()
        self._threads.append(up)
        try:
            while True:
                packet = _read_packet(server)
                if packet[0] >> 4 == mq.PUBCOMP:
                    break
                device.sendall(packet)
        finally:
            self.listener.close()  # refused from now on: a dead primary's address
            for sock in (device, server):
                sock.close()
            self.cut.set()

    def close(self) -> None:
        self.listener.close()
        for thread in self._threads:
            thread.join(5.0)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass  # the relay cut the connection


def _read_packet(sock: socket.socket) -> bytes:
    """One whole MQTT packet (fixed header, remaining length, body); OSError at the end."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise OSError("the server closed the connection")
            data += chunk
        return data

    head = exactly(1)
    length, shift, size = 0, 0, b""
    while True:
        byte = exactly(1)
        size += byte
        length |= (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            break
    return head + size + exactly(length)


def next_event(events: queue.SimpleQueue[Event], kind: type, deadline: float) -> Event:
    while (left := deadline - time.monotonic()) > 0:
        try:
            event = events.get(timeout=left)
        except queue.Empty:
            break
        if isinstance(event, kind):
            return event
    raise AssertionError(f"no {kind.__name__} event in time")


@pytest.fixture
def server(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Server]:
    started = Server(tmp_path, make_config)
    try:
        yield started
    finally:
        started.bus.stop()


def test_a_publication_released_before_its_primary_died_is_not_sent_again(
    server: Server,
) -> None:
    relay = Relay(server.port)
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    device = Device("dev", Endpoints(0, (OLD_PRIMARY, "127.0.0.1"), server.port), (), events)
    device.start()
    try:
        deadline = time.monotonic() + 30.0
        first = next_event(events, Connected, deadline)
        assert isinstance(first, Connected) and first.member == 0
        device.publish(TOPIC, ("nobody",))
        assert relay.cut.wait(30.0), "the relay saw no PUBCOMP"
        # The relay's address refused, the device resumes its session on the server and
        # finishes its flow there (its PUBREL, or a PUBLISH paho should not have sent).
        again = next_event(events, Connected, deadline)
        assert isinstance(again, Connected) and (again.member, again.session) == (1, True)
        while device.outstanding():
            assert time.monotonic() < deadline, "the device's flow never completed"
            time.sleep(0.01)
        device.publish(TOPIC, ("nobody",))
        before = published_before(server.config, lambda p: json.loads(p)["mid"] == "dev-2")
        assert [json.loads(p)["mid"] for p in before] == ["dev-1"]
    finally:
        device.stop()
        relay.close()
