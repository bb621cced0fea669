"""The MQTT listener's own status topics, ``$SYS/aaabus/<id>/...``.

A device granted a ``$SYS`` filter (the ACL decides, as for any filter) gets the current
values at once, retain set as for a retained message, then every ``aaabus.mqtt.sys_interval_s``
at QoS 0. The values are the listener's counts (:class:`Counts`) and the publication rates
computed here. Threads: the listener's loop alone (``mqtt-<id>``), which owns the table of
subscribed connections: no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from aaabus.model.topicnames import matches
from aaabus.mqtt.connection import MqttConnection

__all__ = ["Counts", "SysTopics"]


@dataclass(frozen=True)
class Counts:
    """What the listener counts now, for its status topics."""

    connected: int
    sessions_stored: int
    published_in: int
    published_out: int
    refused: int


class SysTopics:
    """Server ``sid``'s status topics, sent every ``interval_s`` on ``loop``: ``counts()``
    reads the listener's counts, ``flush()`` sends the connections' queued bytes,
    ``stopping()`` says the listener is closing (the ticks stop)."""

    def __init__(
        self,
        sid: int,
        interval_s: float,
        counts: Callable[[], Counts],
        flush: Callable[[], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.interval_s = interval_s
        self._base = f"$SYS/aaabus/{sid}/"
        self._counts, self._flush, self._stopping = counts, flush, stopping
        # Connections granted a $SYS filter, with those filters.
        self._conns: dict[MqttConnection, list[str]] = {}
        self._started = time.monotonic()
        # The counts of publications in and out when the rates were last computed, and those.
        self._rates = (self._started, 0, 0, 0.0, 0.0)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tick on ``loop`` from now on (the loop's thread)."""
        self._loop = loop
        loop.call_later(self.interval_s, self._tick)

    def subscribed(self, conn: MqttConnection, topic_filter: str) -> None:
        """``conn`` was granted ``topic_filter``, a ``$SYS`` filter: the values now, after this
        turn of the loop (the SUBACK may precede them, as it may any matching PUBLISH)."""
        mine = self._conns.setdefault(conn, [])
        if topic_filter not in mine:
            mine.append(topic_filter)
        assert self._loop is not None
        self._loop.call_soon(self._send, {conn: [topic_filter]}, self._values(), True)

    def forget(self, conn: MqttConnection) -> None:
        """``conn`` ended."""
        self._conns.pop(conn, None)

    def _values(self) -> dict[str, bytes]:
        """The status topics and their values now (text payloads)."""
        now = time.monotonic()
        counts = self._counts()
        seen_in, seen_out = counts.published_in, counts.published_out
        at, was_in, was_out, rate_in, rate_out = self._rates
        if now - at >= self.interval_s / 2:
            rate_in = (seen_in - was_in) / (now - at)
            rate_out = (seen_out - was_out) / (now - at)
            self._rates = (now, seen_in, seen_out, rate_in, rate_out)
        values = {
            "connected": counts.connected,
            "sessions_stored": counts.sessions_stored,
            "publications/in_per_s": round(rate_in, 1),
            "publications/out_per_s": round(rate_out, 1),
            "publications/in": seen_in,
            "publications/out": seen_out,
            "refused": counts.refused,
            "uptime_s": int(now - self._started),
        }
        return {self._base + name: str(value).encode() for name, value in values.items()}

    def _send(
        self, conns: dict[MqttConnection, list[str]], values: dict[str, bytes], fresh: bool
    ) -> None:
        """Send each connection the status topics its $SYS filters match, at QoS 0 (retain set
        for the values a fresh subscriber gets at once, as for a retained message)."""
        for conn, filters in conns.items():
            if conn.ended:
                continue
            for topic, payload in values.items():
                if any(matches(f, topic) and f in conn._granted for f in filters):
                    conn.send_status(topic, payload, fresh)
        self._flush()

    def _tick(self) -> None:
        """Every ``interval_s``: the status topics to their subscribers."""
        if self._stopping():
            return
        if self._conns:
            self._send(self._conns, self._values(), False)
        else:
            self._values()  # keep the rates current
        assert self._loop is not None
        self._loop.call_later(self.interval_s, self._tick)
