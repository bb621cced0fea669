"""User Properties are bounded per packet (issue 44, finding 8), against a real server process:
a 5.0 packet of thousands of small pairs, which the event loop every device shares would decode
one by one, closes its connection with 0x95 once over ``aaabus.mqtt.user_properties`` (or its
bytes), before the rest is decoded; a packet within the bound is published with its pairs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from tests.support.mqtt import RawDevice5
from tests.test_mqtt_bounds import Listener, listener

pytestmark = pytest.mark.slow

__all__ = ["listener"]  # the fixture, shared with tests/test_mqtt_bounds.py


def _publish(pairs: list[tuple[str, str]], pid: int) -> mc.Publish:
    return mc.Publish("up/x", b"p", 1, False, False, pid, {mq.USER_PROPERTY: pairs})


def test_user_properties_over_the_bound_close_the_connection_with_0x95(
    listener: Callable[..., Listener],
) -> None:
    server = listener(
        {"aaabus.mqtt.user_properties": "10", "aaabus.mqtt.user_properties_bytes": "2000"}
    )
    sub = RawDevice5(server.port)
    assert sub.connect("sub").code == 0
    sub.send(mc.Subscribe(1, [("up/#", 1)], {}))
    assert isinstance(sub.until(mc.SubAck), mc.SubAck)
    pub = RawDevice5(server.port)
    assert pub.connect("pub").code == 0
    within = [(f"k{i}", "v") for i in range(10)]
    pub.send(_publish(within, 1))
    assert pub.until(mc.Ack).code == 0
    got = sub.until(mc.Publish)
    assert got.properties[mq.USER_PROPERTY] == within
    # Many small pairs (a ~1 MiB packet of them), and a few large ones over the bytes.
    for pairs in ([("k", "v")] * 140_000, [("name", "x" * 700)] * 3):
        flood = RawDevice5(server.port)
        assert flood.connect("flood").code == 0
        flood.send(_publish(pairs, 2))
        assert flood.until(mc.Disconnect).code == mq.PACKET_TOO_LARGE
        assert flood.closed()
        flood.close()
    # In a CONNECT (its will apart): refused in CONNACK.
    over = RawDevice5(server.port)
    over.send(
        mc.Connect(mq.V5, "c", True, 30, None, None, None, {mq.USER_PROPERTY: [("a", "b")] * 11})
    )
    assert over.packet().code == mq.PACKET_TOO_LARGE
    over.close()
    # The subscriber got nothing of the refused packets, and is served.
    sub.send(mc.PingReq())
    assert isinstance(sub.packet(), mc.PingResp)
    pub.close()
    sub.close()
