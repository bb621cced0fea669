"""The fault proxy as a WAN link: per-direction delay, jitter that never reorders, bounded memory,
and a clean stop. Real TCP on 127.0.0.1."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from aaabus.testing.proxy import FaultProxy


@pytest.fixture
def target() -> Iterator[socket.socket]:
    """A listening socket on a free port; the test accepts from it."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(10)
    try:
        yield lsock
    finally:
        lsock.close()


def _connect(proxy: FaultProxy, lsock: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    server, _ = lsock.accept()
    server.settimeout(10)
    return client, server


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        data = sock.recv(n - len(chunks))
        if not data:
            raise EOFError(f"{len(chunks)}/{n} bytes before EOF")
        chunks += data
    return bytes(chunks)


def test_delay_applies_to_its_own_direction_only(target: socket.socket) -> None:
    with FaultProxy(target.getsockname(), name="wan-dir") as proxy:
        proxy.set_delay(0.4, direction="up")
        client, server = _connect(proxy, target)
        with client, server:
            t0 = time.monotonic()
            client.sendall(b"up")
            server.sendall(b"down")
            assert _recv_exactly(client, 4) == b"down"
            t_down = time.monotonic() - t0
            assert _recv_exactly(server, 2) == b"up"
            t_up = time.monotonic() - t0
    assert t_up >= 0.4  # the delayed direction never arrives early
    assert t_down < t_up  # the other one was not held back behind it


def test_jittered_stream_arrives_whole_and_in_order(target: socket.socket) -> None:
    payload = random.Random(7).randbytes(1_000_000)
    with FaultProxy(target.getsockname(), name="wan-order", seed=3) as proxy:
        proxy.set_delay(0.002, jitter=0.01)
        client, server = _connect(proxy, target)
        with client, server:

            def send_in_small_writes() -> None:
                for i in range(0, len(payload), 997):
                    client.sendall(payload[i : i + 997])

            sender = threading.Thread(target=send_in_small_writes, name="test-sender")
            sender.start()
            got = _recv_exactly(server, len(payload))
            sender.join(10)
    assert got == payload


def test_a_receiver_that_never_reads_stops_the_sender(target: socket.socket) -> None:
    with FaultProxy(target.getsockname(), name="wan-bound") as proxy:
        client, server = _connect(proxy, target)
        with client, server:
            client.setblocking(False)
            sent, block = 0, b"x" * 65536
            deadline = time.monotonic() + 10
            # Without a bound the proxy would swallow all of it; with one, TCP pushes back.
            while sent < 256 * 2**20 and time.monotonic() < deadline:
                try:
                    sent += client.send(block)
                except BlockingIOError:
                    break
    assert sent < 256 * 2**20


def test_leaving_the_block_stops_every_proxy_thread(target: socket.socket) -> None:
    with FaultProxy(target.getsockname(), name="wan-stop") as proxy:
        client, server = _connect(proxy, target)
        client.sendall(b"ping")
        assert _recv_exactly(server, 4) == b"ping"
    client.close()
    server.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("wan-stop") and t.is_alive()]


def test_negative_delay_is_refused(target: socket.socket) -> None:
    with FaultProxy(target.getsockname(), name="wan-bad") as proxy, pytest.raises(ValueError):
        proxy.set_delay(-1.0)
