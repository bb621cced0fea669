"""Logins cannot burn the server (issue 44, finding 4), against a real server process with a
credentials file: wrong-password CONNECTs from one address wait for their scrypt check in a
bounded queue (beyond it: CONNACK "server busy", at once), a device from another address is
served during the flood, a CONNECT whose socket closed is dropped unchecked, and a user name
the file does not hold costs the same check as one it does."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from tests.support.mqtt import Device, connect_packet
from tests.support.topics import wait_until
from tests.test_mqtt_bounds import Listener, listener

pytestmark = pytest.mark.slow

__all__ = ["listener"]  # the fixture, shared with tests/test_mqtt_bounds.py

#: 3.1.1 CONNACK codes: server unavailable (5.0's server busy says that), not authorized.
BUSY_311, NOT_AUTHORIZED_311 = 3, 5


def _login(client_id: str, user: bytes, password: bytes) -> bytes:
    extra = len(user).to_bytes(2, "big") + user + len(password).to_bytes(2, "big") + password
    return connect_packet(client_id, flags=0xC2, extra=extra)


def _open(port: int, address: str, data: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _connack(sock: socket.socket) -> int:
    """The CONNACK's return code (-1: closed without one)."""
    data = b""
    while len(data) < 4:
        chunk = sock.recv(4 - len(data))
        if not chunk:
            return -1
        data += chunk
    assert data[0] == 0x20, data
    return data[3]


def test_a_wrong_password_flood_is_bounded_and_a_device_elsewhere_is_served(
    listener: Callable[..., Listener],
) -> None:
    server = listener(
        {"aaabus.mqtt.login_queue": "16", "aaabus.mqtt.login_per_address": "4"},
        users={"meter": "pw"},
    )
    flood = [_open(server.port, "127.0.0.2", _login(f"f{i}", b"meter", b"bad")) for i in range(400)]
    try:
        # During the flood, the device with the right password from another address gets in.
        started = time.monotonic()
        device = Device(server.port, "legit", user="meter", password="pw")
        assert device.connect(timeout=5.0)[0] == 0
        served_in = time.monotonic() - started
        device.close()
        codes = [_connack(sock) for sock in flood]
    finally:
        for sock in flood:
            sock.close()
    # Every CONNECT of the flood is answered: most at once with "busy", few checked.
    busy, refused = codes.count(BUSY_311), codes.count(NOT_AUTHORIZED_311)
    assert busy + refused == 400, sorted(set(codes))
    assert busy >= 300, (busy, refused)
    assert server.mqtt()["logins_checked"] == refused + 1
    print(f"legit CONNACK in {served_in:.3f} s; flood: {busy} busy, {refused} checked")


def test_a_login_whose_socket_closed_is_not_checked(listener: Callable[..., Listener]) -> None:
    server = listener(
        {"aaabus.mqtt.login_queue": "1000", "aaabus.mqtt.login_per_address": "1000"},
        users={"meter": "pw"},
    )
    for i in range(200):  # connect, CONNECT, close at once: 200 logins nobody waits for
        _open(server.port, "127.0.0.3", _login(f"c{i}", b"meter", b"bad")).close()
    wait_until("no login waiting", lambda: server.mqtt()["logins_waiting"] == 0)
    wait_until("the checks started are over", lambda: server.mqtt()["sockets"] == 0)
    checked = server.mqtt()["logins_checked"]
    assert checked < 100, checked  # only those a thread took before their socket closed
    # The server is free: a device logs in at once.
    device = Device(server.port, "after", user="meter", password="pw")
    assert device.connect(timeout=5.0)[0] == 0
    device.close()


def test_an_unknown_user_costs_the_check_a_known_one_does(
    listener: Callable[..., Listener],
) -> None:
    server = listener({}, users={"meter": "pw"})
    for user in (b"ghost", b"meter"):
        sock = _open(server.port, "127.0.0.1", _login("u", user, b"bad"))
        assert _connack(sock) == NOT_AUTHORIZED_311
        sock.close()
    assert server.mqtt()["logins_checked"] == 2
