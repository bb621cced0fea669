"""The MQTT standby responder of a follower member (issue 42, aaabus.mqtt.standby): every CONNECT
answered "use another server" (5.0, with the primary's address as Server Reference) or "server
unavailable" (3.1.1, or no primary known), then closed; and its bounds. Real sockets on
127.0.0.1, paho-mqtt as the device, raw packets (the project's codec) for what paho would not
send; the redirection followed to a real server process."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.errors import ConfigError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.standby import GRACE_S, Standby, server_reference
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device, Device5, connect_packet
from tests.support.rawmqtt import RawClient
from tests.support.tls import make_certificate
from tests.support.topics import wait_until


class Primary:
    """Where the standby says the primary is: set by the test, read by the standby's thread."""

    def __init__(self, address: tuple[str, int] | None) -> None:
        self.address = address
        self.calls = 0

    def __call__(self) -> tuple[str, int] | None:
        self.calls += 1
        return self.address


@pytest.fixture
def standby() -> Iterator[Callable[..., Standby]]:
    """``start(primary, **bounds) -> Standby`` on 127.0.0.1 and a free port; all stopped."""
    started: list[Standby] = []

    def start(primary: Callable[[], tuple[str, int] | None], **bounds: float) -> Standby:
        responder = Standby("127.0.0.1", 0, primary, **bounds).start()  # type: ignore[arg-type]
        started.append(responder)
        return responder

    try:
        yield start
    finally:
        for responder in started:
            responder.stop()


def closed_by_peer(sock: socket.socket, timeout: float = 10.0, *, reset_ok: bool = True) -> bytes:
    """Everything the other end sends until it closes (AssertionError past ``timeout``, and on
    a reset unless ``reset_ok``)."""
    deadline = time.monotonic() + timeout
    got = bytearray()
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"still open after {timeout} s (received {bytes(got)!r})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            assert reset_ok, f"reset by the other end after {bytes(got)!r}"
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


# -- the answers ----------------------------------------------------------------------------------


def test_a_paho_5_0_device_is_sent_to_the_primary_with_use_another_server(
    standby: Callable[..., Standby],
) -> None:
    primary = Primary(("127.0.0.7", 18830))
    responder = standby(primary)
    device = Device5(responder.address[1], "meter-1")
    try:
        assert device.connect()[0] == mq.USE_ANOTHER_SERVER
        assert device.connack_props.get("ServerReference") == "127.0.0.7:18830"
    finally:
        device.client.loop_stop()
    assert primary.calls == 1
    figures = responder.figures(5.0)
    assert figures["answered"] == {"0x9c": 1}
    assert figures["address"] == f"127.0.0.1:{responder.address[1]}"


def test_without_a_known_primary_5_0_is_told_server_unavailable(
    standby: Callable[..., Standby],
) -> None:
    port = standby(Primary(None)).address[1]
    raw = RawClient(port, mq.V5)
    raw.send(mc.Connect(mq.V5, "meter-2", True, 60, None, None, None, {}))
    connack = raw.packet()
    assert isinstance(connack, mc.ConnAck)
    assert (connack.code, connack.session_present, connack.properties) == (
        mq.SERVER_UNAVAILABLE,
        False,
        {},
    )
    with pytest.raises(EOFError):
        raw.packet()  # and closed
    raw.close()


def test_a_3_1_1_device_is_told_server_unavailable_whether_or_not_the_primary_is_known(
    standby: Callable[..., Standby],
) -> None:
    for primary in (Primary(("127.0.0.7", 18830)), Primary(None)):
        port = standby(primary).address[1]
        raw = RawClient(port, mq.V311)
        raw.send(mc.Connect(mq.V311, "old-meter", True, 60, None, None, None))
        connack = raw.packet()
        assert isinstance(connack, mc.ConnAck)
        assert connack.code == mq.SERVER_UNAVAILABLE_311
        with pytest.raises(EOFError):
            raw.packet()
        raw.close()
    # paho 3.1.1 sees a refusal too (it reports 3.1.1's 0x03 as 5.0's 0x88).
    device = Device(port, "paho-311")
    try:
        assert device.connect()[0] == mq.SERVER_UNAVAILABLE
    finally:
        device.client.loop_stop()


def test_a_primary_callable_that_raises_counts_as_unknown_and_is_logged(
    standby: Callable[..., Standby], caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> tuple[str, int] | None:
        raise RuntimeError("no epoch book")

    port = standby(broken).address[1]
    raw = RawClient(port, mq.V5)
    with caplog.at_level(logging.ERROR, logger="aaabus.mqtt.standby"):
        raw.send(mc.Connect(mq.V5, "meter-3", True, 60, None, None, None, {}))
        connack = raw.packet()
    raw.close()
    assert isinstance(connack, mc.ConnAck) and connack.code == mq.SERVER_UNAVAILABLE
    assert any("primary() raised" in r.getMessage() for r in caplog.records)


def test_a_malformed_connect_is_refused_as_the_listener_refuses_it(
    standby: Callable[..., Standby],
) -> None:
    port = standby(Primary(("127.0.0.7", 18830))).address[1]
    # Protocol level 3 (MQTT 3.1): the codec's answer is 3.1.1's "unacceptable protocol".
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(connect_packet(level=3))
        assert closed_by_peer(sock) == bytes((0x20, 2, 0, mq.UNACCEPTABLE_PROTOCOL))
    # A packet before CONNECT: closed without a CONNACK.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\xc0\x00")  # PINGREQ
        assert closed_by_peer(sock) == b""


def test_the_redirection_is_followed_to_a_real_server_that_accepts_the_device(
    tmp_path: Path, make_config: Callable[..., Path], standby: Callable[..., Standby]
) -> None:
    (mqtt_port,) = free_ports(1)
    config = make_config(
        properties={"aaabus.mqtt.port": str(mqtt_port), "aaabus.mqtt.anonymous": "true"}
    )
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT):
        port = standby(Primary(("127.0.0.1", mqtt_port))).address[1]
        device = Device5(port, "follows")
        try:
            assert device.connect()[0] == mq.USE_ANOTHER_SERVER
            host, _, there = device.connack_props["ServerReference"].rpartition(":")
            device.client.loop_stop()
            assert (host, int(there)) == ("127.0.0.1", mqtt_port)
            moved = Device5(int(there), "follows")
            assert moved.connect()[0] == mq.SUCCESS
            moved.close()
        finally:
            device.client.loop_stop()


def test_server_reference_brackets_an_ipv6_host() -> None:
    assert server_reference(("10.0.0.2", 1883)) == "10.0.0.2:1883"
    assert server_reference(("fd00::2", 1883)) == "[fd00::2]:1883"


# -- the bounds -----------------------------------------------------------------------------------


def test_a_connection_without_connect_is_closed_at_the_deadline(
    standby: Callable[..., Standby],
) -> None:
    port = standby(Primary(None), connect_s=0.3).address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(connect_packet()[:5])  # a CONNECT that never ends
        began = time.monotonic()
        assert closed_by_peer(sock, timeout=5.0) == b""
        assert 0.2 <= time.monotonic() - began < 3.0


def test_one_address_holds_at_most_per_address_connections_the_oldest_evicted(
    standby: Callable[..., Standby],
) -> None:
    responder = standby(Primary(None), per_address=3, connect_s=30.0)
    port = responder.address[1]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    try:
        # The standby has them all before the next one comes (each is in its table once read).
        wait_until("3 waiting", lambda: responder.figures(5.0)["waiting"] == 3)
        # The standby's clock for the oldest started before this, never after: the grace
        # waited below is at least the one it sees (taken before the connects, a slow machine
        # let the standby read the first one later than that, and nothing was evicted).
        opened = time.monotonic()
        # Within the grace a burst from one address is let in (a site reconnecting at once).
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        wait_until("4 waiting", lambda: responder.figures(5.0)["waiting"] == 4)
        # Once the oldest has waited that long, the next one from the address evicts it.
        wait_until("the grace to pass", lambda: time.monotonic() - opened > GRACE_S)
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        assert closed_by_peer(socks[0], timeout=5.0) == b""  # the oldest went
        # The others are still served: the newest gets its answer.
        socks[4].sendall(connect_packet(level=4))
        assert closed_by_peer(socks[4]) == bytes((0x20, 2, 0, mq.SERVER_UNAVAILABLE_311))
        socks[1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            socks[1].recv(1)  # still open, still waiting for its CONNECT
    finally:
        for sock in socks:
            sock.close()


def test_at_most_max_connections_are_held_the_oldest_evicted(
    standby: Callable[..., Standby],
) -> None:
    responder = standby(Primary(None), max_connections=2, per_address=10, connect_s=30.0)
    port = responder.address[1]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        wait_until("2 waiting", lambda: responder.figures(5.0)["waiting"] == 2)
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        assert closed_by_peer(socks[0], timeout=5.0) == b""
        wait_until("2 waiting again", lambda: responder.figures(5.0)["waiting"] == 2)
    finally:
        for sock in socks:
            sock.close()


def test_a_connect_over_the_size_limit_is_closed_before_its_body_arrives(
    standby: Callable[..., Standby], caplog: pytest.LogCaptureFixture
) -> None:
    port = standby(Primary(("127.0.0.7", 18830)), max_packet=1024).address[1]
    big = connect_packet(extra=b"", client_id="x" * 4000)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(big[:8])  # the fixed header says 4000+ bytes: refused on the length alone
        assert closed_by_peer(sock, timeout=5.0) == b""
    # Refused in one warning line, not an error of the standby (no traceback).
    assert [r.levelno for r in caplog.records if "over the limit" in r.getMessage()] == [
        logging.WARNING
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Under the limit, the same client id is answered.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(connect_packet(client_id="x" * 500))
        assert closed_by_peer(sock) == bytes((0x20, 2, 0, mq.SERVER_UNAVAILABLE_311))


def test_a_device_that_pipelines_after_connect_still_reads_its_connack(
    standby: Callable[..., Standby],
) -> None:
    port = standby(Primary(("127.0.0.7", 18830))).address[1]
    # CONNECT then a megabyte the standby never parses, more than one read of its loop takes:
    # closing on unread input resets the connection (RST, not FIN), which some stacks let
    # destroy the CONNACK before the device reads it. The standby reads until the device
    # closes: a clean end, never a reset.
    publish = mc.encode(mc.Publish("t", b"p" * 60000, 0, False, False, None), mq.V311)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:

        def pipeline() -> None:
            with contextlib.suppress(OSError):  # cut short once the answer is read
                sock.sendall(connect_packet() + publish * 17)

        sender = threading.Thread(target=pipeline, name="test-pipeline", daemon=True)
        sender.start()
        got = closed_by_peer(sock, reset_ok=False)
        sock.shutdown(socket.SHUT_RDWR)
        sender.join(10)
    assert got == bytes((0x20, 2, 0, mq.SERVER_UNAVAILABLE_311))


def test_stopping_while_a_device_lingers_logs_no_error(
    standby: Callable[..., Standby], caplog: pytest.LogCaptureFixture
) -> None:
    """A member that takes over stops its standby with devices still connected (answered, not
    yet gone): their connections end quietly, nothing is logged as an error."""
    responder = standby(Primary(("127.0.0.7", 18830)))
    with caplog.at_level(logging.ERROR), socket.create_connection(responder.address, 10) as sock:
        sock.sendall(connect_packet())
        assert sock.recv(4) == bytes((0x20, 2, 0, mq.SERVER_UNAVAILABLE_311))
        wait_until("the answer counted", lambda: responder.figures(5)["answered"], 10)
        responder.stop()  # the device has not closed: its handler is still lingering
        assert sock.recv(1) == b""  # closed by the standby
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_stop_frees_the_port_and_is_idempotent(standby: Callable[..., Standby]) -> None:
    responder = standby(Primary(None))
    host, port = responder.address
    responder.stop()
    responder.stop()
    with socket.create_server((host, port)):
        pass  # bindable again
    assert not any(t.name == f"mqtt-standby-{port}" for t in threading.enumerate())


def test_a_standby_stopped_before_it_started_frees_its_port_and_loop() -> None:
    responder = Standby("127.0.0.1", 0, Primary(None))
    responder.stop()
    assert responder._loop.is_closed()
    with socket.create_server(responder.address):
        pass


def test_a_port_already_taken_is_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"MQTT standby cannot listen on 127.0.0.1:{port}"):
            Standby("127.0.0.1", port, Primary(None))


def test_a_device_speaking_tls_reads_the_answer_over_tls(
    tmp_path: Path, standby: Callable[..., Standby]
) -> None:
    cert, key = make_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    port = standby(Primary(("127.0.0.7", 18830)), tls=context).address[1]
    device = Device(port, "tls-meter", tls_ca=str(cert))
    try:
        assert device.connect()[0] == mq.SERVER_UNAVAILABLE  # paho's name for 3.1.1's 0x03
    finally:
        device.client.loop_stop()
    # A device that opens TCP and never starts TLS is closed at the CONNECT deadline too.
    port = standby(Primary(None), tls=context, connect_s=0.3).address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert closed_by_peer(sock, timeout=5.0) == b""
