"""The network's small policies, without sockets: redial backoff, how loudly closes are logged."""

from __future__ import annotations

import logging
import random

from aaabus.io.logpolicy import close_level, close_message
from aaabus.io.peerdial import BACKOFF_FIRST, BACKOFF_MAX, PeerDial
from aaabus.io.states import ConnState


def test_redials_back_off_exponentially_to_a_cap_with_jitter_and_reset_when_up() -> None:
    random.seed(7)
    dial: PeerDial[object] = PeerDial()
    delays = [dial.next_delay() for _ in range(12)]
    assert BACKOFF_FIRST * 0.5 <= delays[0] <= BACKOFF_FIRST
    assert delays[3] > delays[0] * 2  # 8x the first, less at most half of it for jitter
    assert all(BACKOFF_MAX * 0.5 <= d <= BACKOFF_MAX for d in delays[7:])
    assert dial.failures == 12
    dial.succeeded()
    assert dial.failures == 0
    assert dial.next_delay() <= BACKOFF_FIRST


def test_a_repeated_dial_error_is_said_once() -> None:
    dial: PeerDial[object] = PeerDial()
    assert [dial.first_time(r) for r in ("refused", "refused", "bad MAC", "bad MAC")] == [
        True,
        False,
        True,
        False,
    ]
    dial.succeeded()
    assert dial.first_time("bad MAC")


def test_close_levels_follow_who_failed_and_how() -> None:
    def never() -> bool:
        raise AssertionError("only our own dial's handshake failures ask")

    up, hs, connecting = ConnState.UP, ConnState.HANDSHAKE, ConnState.CONNECTING
    assert close_level(up, outgoing=True, violation=False, first_time=never) == logging.INFO
    assert close_level(up, outgoing=False, violation=True, first_time=never) == logging.WARNING
    # A link reset by the layer above (closing) that fails meanwhile is a link going down.
    closing = ConnState.CLOSING
    assert close_level(closing, outgoing=False, violation=False, first_time=never) == logging.INFO
    assert close_level(hs, outgoing=False, violation=False, first_time=never) == logging.WARNING
    assert close_level(connecting, outgoing=True, violation=False, first_time=never) == (
        logging.DEBUG
    )
    assert close_level(hs, outgoing=True, violation=False, first_time=lambda: True) == (
        logging.WARNING
    )
    assert close_level(hs, outgoing=True, violation=False, first_time=lambda: False) == (
        logging.DEBUG
    )
    assert ConnState.TLS.handshaking and not ConnState.UP.handshaking
    assert not ConnState.CLOSED.handshaking
    assert close_message(was_up=True, peer=3, label="h:1") == "server 3 at h:1 is down"
    assert close_message(was_up=False, peer=3, label="h:1") == ("dialling server 3 at h:1 failed")
