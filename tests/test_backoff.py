"""The one retry policy: a server redialling a peer and a client retrying a request both wait
what :class:`aaabus.io.backoff.Backoff` draws."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.errors import ServerUnreachable
from aaabus.io.backoff import Backoff
from aaabus.io.peerdial import BACKOFF_FIRST, BACKOFF_MAX, PeerDial
from aaabus.tools import client as client_module
from aaabus.tools.client import RETRY_FIRST, RETRY_MAX, Client


def highest(low: float, high: float) -> float:
    """A jitter that never takes anything off: the nominal delays, exactly."""
    return high


def test_delays_double_from_the_first_to_the_ceiling_and_start_over_after_a_reset() -> None:
    backoff = Backoff(0.02, 1.0, uniform=highest)
    assert [backoff.next_delay() for _ in range(8)] == [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1, 1]
    assert backoff.failures == 8
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next_delay() == 0.02


def test_jitter_takes_off_at_most_half_of_each_delay() -> None:
    draws: list[tuple[float, float]] = []

    def lowest(low: float, high: float) -> float:
        draws.append((low, high))
        return low

    backoff = Backoff(0.05, 1.0, uniform=lowest)
    assert [backoff.next_delay() for _ in range(3)] == [0.025, 0.05, 0.1]
    assert draws == [(0.5, 1.0)] * 3
    real = Backoff(0.05, 1.0)  # random.uniform: within the bounds, whatever it draws
    for nominal in (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0):
        assert nominal / 2 <= real.next_delay() <= nominal


def test_a_peer_away_for_long_keeps_the_ceiling() -> None:
    backoff = Backoff(0.02, 1.0, uniform=highest)
    for _ in range(10_000):
        delay = backoff.next_delay()
    assert delay == 1.0 and backoff.failures == 10_000


@pytest.mark.parametrize(("first", "ceiling"), [(0, 1), (-1, 1), (2, 1)])
def test_a_backoff_needs_a_positive_first_delay_under_its_ceiling(
    first: float, ceiling: float
) -> None:
    with pytest.raises(ValueError, match="0 < first <= ceiling"):
        Backoff(first, ceiling)


def test_a_server_redials_with_the_shared_backoff() -> None:
    dial: PeerDial[object] = PeerDial()
    assert isinstance(dial.backoff, Backoff)
    assert (dial.backoff.first, dial.backoff.ceiling) == (BACKOFF_FIRST, BACKOFF_MAX)
    dial.next_delay()
    assert dial.failures == dial.backoff.failures == 1
    dial.succeeded()
    assert dial.backoff.failures == 0


def test_a_client_retries_with_the_shared_backoff(
    monkeypatch: pytest.MonkeyPatch, make_config: Callable[..., Path]
) -> None:
    """No server listens: the client tries again after each delay the policy draws (no jitter
    here, to compare exactly), then gives up in one line at its timeout."""
    made: list[Backoff] = []

    class Recorded(Backoff):
        def __init__(self, first: float, ceiling: float, **kwargs: Any) -> None:
            super().__init__(first, ceiling, uniform=highest)
            made.append(self)

    monkeypatch.setattr(client_module, "Backoff", Recorded)
    client = Client(make_config(), timeout=0.5)
    waits: list[float] = []
    real = threading.Event()

    class Pause:
        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            return real.wait(seconds)

    client._pause = Pause()  # type: ignore[assignment]
    with pytest.raises(ServerUnreachable, match=r"did not answer within 0\.5s"):
        client.status()
    assert len(made) == 1 and (made[0].first, made[0].ceiling) == (RETRY_FIRST, RETRY_MAX)
    assert waits == [0.05, 0.1, 0.2][: len(waits)] and len(waits) >= 2, waits
    assert made[0].failures == len(waits) + 1  # the last delay would have passed the deadline
