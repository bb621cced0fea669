"""The store's bounds hold whoever writes (issue 44, findings 6 and 7), against a real server
process: devices without a user name count as one user for the retained topics, their bytes and
the persistent sessions; a retained will is a retained publication like any other, counted
against its device's user."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.mqtt import Device, RawDevice
from tests.support.topics import wait_until
from tests.test_mqtt_bounds import SERVER_UNAVAILABLE, Listener, listener

pytestmark = pytest.mark.slow

__all__ = ["listener"]  # the fixture, shared with tests/test_mqtt_bounds.py


def _text(raw: bytes) -> bytes:
    return len(raw).to_bytes(2, "big") + raw


def _retained(server: Listener) -> int:
    count: int = server.status()["topics"]["retained"]
    return count


def test_anonymous_devices_share_one_users_retained_topics(
    listener: Callable[..., Listener],
) -> None:
    server = listener({"aaabus.mqtt.retained": "5", "aaabus.mqtt.retained_total": "20"})
    # Three anonymous devices publish 30 retained topics between them: 5 are kept.
    devices = [Device(server.port, f"anon-{i}") for i in range(3)]
    for i, device in enumerate(devices):
        assert device.connect()[0] == 0
        for n in range(10):
            device.publish(f"a/{i}/{n}", b"v", 1, retain=True)  # PUBACK once durable
    assert _retained(server) == 5
    for device in devices:
        device.close()


def test_anonymous_devices_share_one_users_persistent_sessions(
    listener: Callable[..., Listener],
) -> None:
    server = listener({"aaabus.mqtt.sessions_per_user": "3"})
    # Three anonymous devices keep a session each; a fourth is refused, a clean one is not,
    # and a named user has bounds of its own.
    kept = [Device(server.port, f"keep-{i}", clean=False) for i in range(3)]
    for device in kept:
        assert device.connect() == (0, False)
    assert Device(server.port, "keep-3", clean=False).connect()[0] == SERVER_UNAVAILABLE
    clean = Device(server.port, "clean")
    assert clean.connect()[0] == 0
    named = Device(server.port, "named", clean=False, user="alice")
    assert named.connect() == (0, False)
    assert server.mqtt()["sessions_stored"] == 4
    for device in [*kept, clean, named]:
        device.close()


def test_retained_wills_are_bounded_like_retained_publications(
    listener: Callable[..., Listener],
) -> None:
    """Ten devices of one user leave retained wills of 3 KB: the user's bounds (2 topics,
    10 KB) keep two of them, the others are refused and counted."""
    server = listener(
        {"aaabus.mqtt.retained": "2", "aaabus.mqtt.retained_bytes": "10000"},
        users={"meter": "pw"},
    )
    before = server.mqtt()["refused"]
    login = _text(b"meter") + _text(b"pw")
    socks = []
    for i in range(10):
        will = _text(f"w/{i}".encode()) + _text(b"x" * 3000)
        sock = RawDevice(server.port)
        # Clean session, will flag, will QoS 1, will retain, user name and password.
        flags = 0x02 | 0x04 | 0x08 | 0x20 | 0xC0
        assert sock.connect(f"dev-{i}", flags=flags, extra=will + login) == 0
        socks.append(sock)
    for sock in socks:
        sock.close()  # no DISCONNECT: each will is published

    def handled() -> bool:
        return _retained(server) + server.mqtt()["refused"] - before >= 10

    wait_until("every will published or refused", handled)
    assert _retained(server) == 2
    assert server.mqtt()["refused"] - before == 8
    wait_until(
        "a refusal logged",
        lambda: any("will refused" in line for line in server.bus[0].lines),
    )
