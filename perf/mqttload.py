"""An independent MQTT 3.1.1 load client: thousands of devices per process, for ``perf mqtt``.

It checks the bus from the outside, so it shares nothing with it: it does not import ``aaabus``
(its packets are encoded and decoded here, by hand, from the specification: CONNECT, CONNACK,
PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT), and
it runs on the standard library alone.

**Processes.** A :class:`LoadClient` (the orchestrator, in the caller's process) starts worker
processes (this file run as a script: ``python perf/mqttload.py worker``) and talks to them in
JSON lines over their stdin/stdout. Each worker is one asyncio event loop on one thread, with raw
non-blocking sockets (asyncio transports) and one small state machine per device, so one process
holds 10,000+ connections (it raises its own ``RLIMIT_NOFILE`` soft limit to the hard limit; never
the system's). Devices are spread over ``processes`` workers so that the client is not the
bottleneck; worker 0 is kept for the single client of a scenario (the fan-in subscriber, the
fan-out publisher, the probe publisher), the others share the N devices. A worker exits when its
stdin closes, so none outlives its orchestrator; the orchestrator also kills them by PID.

**Clocks.** Every timestamp is ``CLOCK_MONOTONIC`` (``time.monotonic``), shared by all processes
of the machine: a publication carries its send time in its payload and the subscriber, in another
process, computes the delivery latency from it.

**Scenarios** (:func:`fan_in`, :func:`fan_out`, :func:`idle`, :func:`storm`) take a
:class:`Target` (where the N devices connect, where the single client connects, the PIDs of the
server processes to watch in ``/proc``) and return plain dicts (JSON-ready). Latencies are kept in
log-bucket histograms of 1 % resolution (:class:`Hist`), merged across workers, so a run of a
million messages sends a few hundred numbers back, not a million.

Standalone use against any broker: ``python perf/mqttload.py fan_in --port 1883 --devices 1000``
(``--help`` for the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import json
import math
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# -- MQTT 3.1.1 packets, encoded and decoded by hand ------------------------------------------

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14

PINGREQ_PACKET = b"\xc0\x00"
DISCONNECT_PACKET = b"\xe0\x00"

#: A packet this client accepts from a server; anything longer is a protocol error.
MAX_PACKET = 16 * 1024 * 1024


class ProtocolError(Exception):
    """The server sent bytes that are not MQTT 3.1.1 (or not what a client may receive)."""


def encode_length(n: int) -> bytes:
    """The Remaining Length varint (1-4 bytes, 7 bits each, least significant first)."""
    if not 0 <= n <= 268_435_455:
        raise ValueError(f"remaining length {n} out of range")
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_length(len(body)) + body


def _string(value: bytes) -> bytes:
    return struct.pack("!H", len(value)) + value


def connect_packet(
    client_id: str,
    keepalive: int,
    clean: bool = True,
    username: str | None = None,
    password: bytes | None = None,
) -> bytes:
    flags = 0x02 if clean else 0x00
    payload = _string(client_id.encode())
    if username is not None:
        flags |= 0x80
        payload += _string(username.encode())
        if password is not None:
            flags |= 0x40
            payload += _string(password)
    header = _string(b"MQTT") + bytes((4, flags)) + struct.pack("!H", keepalive)
    return _packet(CONNECT << 4, header + payload)


def publish_packet(
    topic: bytes, payload: bytes, qos: int, packet_id: int = 0, dup: bool = False
) -> bytes:
    first = (PUBLISH << 4) | (qos << 1) | (0x08 if dup and qos else 0)
    body = _string(topic) + (struct.pack("!H", packet_id) if qos else b"") + payload
    return _packet(first, body)


def ack_packet(kind: int, packet_id: int) -> bytes:
    """PUBACK, PUBREC, PUBREL (its fixed-header flags are 0b0010) or PUBCOMP."""
    flags = 0x02 if kind == PUBREL else 0x00
    return bytes(((kind << 4) | flags, 2)) + struct.pack("!H", packet_id)


def subscribe_packet(packet_id: int, filters: Sequence[tuple[str, int]]) -> bytes:
    body = struct.pack("!H", packet_id)
    for topic, qos in filters:
        body += _string(topic.encode()) + bytes((qos,))
    return _packet((SUBSCRIBE << 4) | 0x02, body)


class Framer:
    """Splits a byte stream into whole packets: ``(first byte, body)``."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos, end = 0, len(buf)
        while end - pos >= 2:
            first = buf[pos]
            length, shift, i = 0, 0, pos + 1
            whole = False  # the Remaining Length is all here
            while i < end:
                byte = buf[i]
                i += 1
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    whole = True
                    break
                shift += 7
                if shift > 21:
                    raise ProtocolError("remaining length longer than 4 bytes")
            if not whole:
                break
            if length > MAX_PACKET:
                raise ProtocolError(f"packet of {length} bytes")
            if i + length > end:
                break  # the body is not all here yet
            out.append((first, bytes(buf[i : i + length])))
            pos = i + length
        if pos:
            del buf[:pos]
        return out


def parse_publish(first: int, body: bytes) -> tuple[bytes, int, int, bytes]:
    """``(topic, qos, packet id or 0, payload)`` of a PUBLISH."""
    qos = (first >> 1) & 0x03
    if qos == 3 or len(body) < 2:
        raise ProtocolError("malformed PUBLISH")
    (tlen,) = struct.unpack_from("!H", body)
    pos = 2 + tlen
    topic = body[2:pos]
    packet_id = 0
    if qos:
        if len(body) < pos + 2:
            raise ProtocolError("PUBLISH without packet id")
        (packet_id,) = struct.unpack_from("!H", body, pos)
        pos += 2
    return topic, qos, packet_id, body[pos:]


# -- latency histograms -----------------------------------------------------------------------


class Hist:
    """Counts of values (ns) in logarithmic buckets 1 % wide: merges across processes cheaply."""

    SCALE = 1.0 / math.log1p(0.01)

    def __init__(self, buckets: dict[int, int] | None = None) -> None:
        self.buckets: dict[int, int] = dict(buckets or {})

    def add(self, ns: int) -> None:
        b = int(math.log(ns) * self.SCALE) if ns > 1 else 0
        self.buckets[b] = self.buckets.get(b, 0) + 1

    def merge(self, other: Hist | dict[str, int]) -> Hist:
        items = other.buckets.items() if isinstance(other, Hist) else other.items()
        for b, c in items:
            key = int(b)
            self.buckets[key] = self.buckets.get(key, 0) + c
        return self

    @property
    def count(self) -> int:
        return sum(self.buckets.values())

    def quantile_ms(self, q: float) -> float | None:
        total = self.count
        if not total:
            return None
        rank = q * (total - 1)
        seen = 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen > rank:
                return math.exp((b + 0.5) / self.SCALE) / 1e6
        return None  # pragma: no cover - the last bucket always passes the rank

    def summary(self) -> dict[str, float | int | None]:
        return {
            "n": self.count,
            "p50": self.quantile_ms(0.50),
            "p99": self.quantile_ms(0.99),
            "max": self.quantile_ms(1.0),
        }

    def to_json(self) -> dict[str, int]:
        return {str(b): c for b, c in self.buckets.items()}


# -- the devices (in a worker) -----------------------------------------------------------------


class Closed(Exception):
    """The connection ended before the awaited packet."""


@dataclasses.dataclass
class PublishJob:
    """What one device publishes: ``count`` messages with at most ``window`` unacknowledged."""

    topic: bytes
    qos: int
    count: int
    window: int
    pad: bytes
    acks: Hist
    done: asyncio.Future[None]
    rate: float = 0.0  # messages per second at most (0: as fast as the window allows)
    t0: float = 0.0  # when the first was due (monotonic seconds)


class Device(asyncio.Protocol):
    """One MQTT client connection: its state machine, driven by the worker's event loop."""

    def __init__(
        self, worker: Worker, index: int, client_id: str, keepalive: int, clean: bool
    ) -> None:
        loop = worker.loop
        self.worker = worker
        self.index = index
        self.client_id = client_id
        self.keepalive = keepalive
        self.clean = clean
        self.transport: asyncio.Transport | None = None
        self.framer = Framer()
        self.connack: asyncio.Future[int] = loop.create_future()
        self.suback: asyncio.Future[list[int]] | None = None
        self.closing = False  # we asked for the close: not a loss
        self.lost = False  # the server closed it, or the socket failed
        self.t_start = 0.0
        self.t_connack = 0.0
        self.t_lost = 0.0
        self.last_sent = 0.0
        self.pings = self.pongs = 0
        # Publishing: packet id -> monotonic ns of the send.
        self.job: PublishJob | None = None
        self.inflight: dict[int, int] = {}
        self.next_id = 0
        self.sent = self.acked = 0
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None  # the next publication due (--rate)
        # Subscribing: per source, how many times each sequence number arrived.
        self.seen: dict[int, bytearray] = {}
        self.distinct = self.dups = self.unexpected = 0
        self.probed = False
        self.subscribed = False  # its SUBSCRIBE was granted: it is owed publications
        self.qos2_in: set[int] = set()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # The CONNECT leaves as soon as TCP is up, as a device's would.
        self.write(connect_packet(self.client_id, self.keepalive, self.clean))

    def data_received(self, data: bytes) -> None:
        try:
            for first, body in self.framer.feed(data):
                self._packet(first, body)
        except ProtocolError as exc:
            self.worker.protocol_errors += 1
            self.worker.note(f"device {self.index}: {exc}")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.t_lost = time.monotonic()
        if not self.closing and self.accepted():
            self.lost = True  # a refusal is counted where it happened, at connect
        self.transport = None
        if not self.connack.done():
            self.connack.set_exception(Closed("closed before CONNACK"))
        if self.suback is not None and not self.suback.done():
            self.suback.set_exception(Closed("closed before SUBACK"))
        if self.job is not None and not self.job.done.done():
            self.job.done.set_result(None)  # what was acked counts; the loss is reported

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.job is not None and self.job.qos == 0:
            self._fill()

    # sending

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.last_sent = time.monotonic()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def accepted(self) -> bool:
        """The server answered CONNACK 0."""
        return (
            self.connack.done()
            and not self.connack.cancelled()
            and self.connack.exception() is None
            and self.connack.result() == 0
        )

    def close(self, disconnect: bool = True) -> None:
        """Close by our choice (not a loss); DISCONNECT first when the session was accepted."""
        self.closing = True
        accepted = self.accepted()
        # Nobody awaits these any more: cancelled, connection_lost leaves them alone (an
        # exception set on a future nobody reads is logged as "never retrieved").
        for fut in (self.connack, self.suback):
            if fut is not None and not fut.done():
                fut.cancel()
        if self.transport is not None:
            if disconnect and accepted:
                self.transport.write(DISCONNECT_PACKET)
            self.transport.close()

    def subscribe(self, topic: str, qos: int) -> asyncio.Future[list[int]]:
        self.suback = self.worker.loop.create_future()
        self.write(subscribe_packet(1, [(topic, qos)]))
        return self.suback

    def publish_once(self, topic: bytes, payload: bytes, qos: int) -> None:
        """One publication outside any job (probes): acknowledged but not timed."""
        packet_id = self._take_id() if qos else 0
        if qos:
            self.inflight[packet_id] = -1
        self.write(publish_packet(topic, payload, qos, packet_id))

    def start(self, job: PublishJob) -> None:
        self.job = job
        self.sent = self.acked = 0
        if self.transport is None:
            job.done.set_result(None)
            return
        self._fill()

    def _take_id(self) -> int:
        while True:
            self.next_id = self.next_id % 65535 + 1
            if self.next_id not in self.inflight:
                return self.next_id

    def _fill(self) -> None:
        job = self.job
        assert job is not None
        while self.sent < job.count and self.transport is not None:
            if job.qos and len(self.inflight) >= job.window:
                return
            if not job.qos and self.paused:
                return  # resume_writing continues
            if job.rate and self._early(job):
                return  # the timer continues
            now = time.monotonic_ns()
            payload = b"%d %d %d " % (self.index, self.sent, now) + job.pad
            packet_id = 0
            if job.qos:
                packet_id = self._take_id()
                self.inflight[packet_id] = now
            self.write(publish_packet(job.topic, payload, job.qos, packet_id))
            self.sent += 1
        if not job.qos and self.sent >= job.count:
            self.acked = self.sent  # QoS 0: nothing to wait for
            if not job.done.done():
                job.done.set_result(None)

    def _early(self, job: PublishJob) -> bool:
        """Whether the next publication is not due yet at ``job.rate``; then a timer resumes
        the filling when it is (one timer at a time)."""
        wait = job.t0 + self.sent / job.rate - time.monotonic()
        if wait <= 0:
            return False
        if self.timer is None:
            self.timer = self.worker.loop.call_later(wait, self._due)
        return True

    def _due(self) -> None:
        self.timer = None
        if self.job is not None and self.transport is not None:
            self._fill()

    def _completed(self, packet_id: int) -> None:
        sent_ns = self.inflight.pop(packet_id, None)
        if sent_ns is None or sent_ns < 0:
            return  # unknown id, or a probe
        job = self.job
        if job is None:
            return
        job.acks.add(time.monotonic_ns() - sent_ns)
        self.acked += 1
        if self.acked >= job.count:
            if not job.done.done():
                job.done.set_result(None)
        else:
            self._fill()

    # receiving

    def _packet(self, first: int, body: bytes) -> None:
        kind = first >> 4
        if kind == PUBLISH:
            self._publish(first, body)
        elif kind in (PUBACK, PUBCOMP):
            (packet_id,) = struct.unpack("!H", body[:2])
            self._completed(packet_id)
        elif kind == PUBREC:
            (packet_id,) = struct.unpack("!H", body[:2])
            self.write(ack_packet(PUBREL, packet_id))
        elif kind == PUBREL:
            (packet_id,) = struct.unpack("!H", body[:2])
            self.qos2_in.discard(packet_id)
            self.write(ack_packet(PUBCOMP, packet_id))
        elif kind == CONNACK:
            if len(body) != 2 or self.connack.done():
                raise ProtocolError("unexpected CONNACK")
            self.t_connack = time.monotonic()
            self.connack.set_result(body[1])
        elif kind == SUBACK:
            if self.suback is not None and not self.suback.done():
                self.suback.set_result(list(body[2:]))
        elif kind == PINGRESP:
            self.pongs += 1
        else:
            raise ProtocolError(f"packet type {kind} from a server")

    def _publish(self, first: int, body: bytes) -> None:
        _topic, qos, packet_id, payload = parse_publish(first, body)
        if qos == 1:
            self.write(ack_packet(PUBACK, packet_id))
        elif qos == 2:
            self.write(ack_packet(PUBREC, packet_id))
            if packet_id in self.qos2_in:
                return  # a resend before our PUBREL's answer: the same message
            self.qos2_in.add(packet_id)
        if payload.startswith(b"probe"):
            self.probed = True
            return
        try:
            src_text, seq_text, t_text, _rest = payload.split(b" ", 3)
            src, seq, t_ns = int(src_text), int(seq_text), int(t_text)
        except ValueError:
            self.unexpected += 1
            return
        w = self.worker
        now = time.monotonic_ns()
        w.deliveries.add(now - t_ns)
        if not w.first_delivery:
            w.first_delivery = now
        w.last_delivery = now
        counts = self.seen.get(src)
        if counts is None:
            counts = self.seen[src] = bytearray()
        if seq >= len(counts):
            counts.extend(bytes(seq + 1 - len(counts)))
        if counts[seq]:
            self.dups += 1
        else:
            self.distinct += 1
        if counts[seq] < 255:
            counts[seq] += 1


class Silent(asyncio.Protocol):
    """A connection that opens TCP and never sends a byte: when does the server close it?"""

    def __init__(self) -> None:
        self.t_open = 0.0
        self.t_closed = 0.0
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t_open = time.monotonic()
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        pass  # nothing is expected; a CONNACK-less server never writes

    def connection_lost(self, exc: Exception | None) -> None:
        self.t_closed = time.monotonic()
        self.transport = None


def _ids(spec: list[int]) -> range:
    lo, hi = spec
    return range(lo, hi)


def _bump(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


class Worker:
    """One worker process's devices and the operations the orchestrator asks for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.devices: dict[int, Device] = {}
        self.silent: list[Silent] = []
        self.protocol_errors = 0
        self.deliveries = Hist()
        self.first_delivery = self.last_delivery = 0
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(text)

    async def keepalive_loop(self) -> None:
        """PINGREQ from every connected device that has sent nothing for half its keep-alive."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for dev in self.devices.values():
                if (
                    dev.keepalive
                    and dev.transport is not None
                    and dev.connack.done()
                    and now - dev.last_sent >= dev.keepalive / 2
                ):
                    dev.write(PINGREQ_PACKET)
                    dev.pings += 1

    async def op_connect(
        self,
        ids: list[int],
        host: str,
        port: int,
        prefix: str,
        keepalive: int,
        clean: bool,
        concurrency: int,
        timeout: float,
        start_at: float,
        subscribe: dict[str, Any] | None = None,
        sources: int = 1,
    ) -> dict[str, Any]:
        """Connect devices ``ids`` (``[lo, hi)``) at ``start_at``: all at once (concurrency 0),
        or at most ``concurrency`` handshakes at a time; subscribe those asked to. ``sources``
        > 1: device ``i`` binds to loopback address :func:`source_address` before it connects."""
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        refused: dict[str, int] = {}
        errors: dict[str, int] = {}
        by_source: dict[str, int] = {}
        counts = {"connected": 0, "closed": 0, "timeouts": 0, "subscribed": 0, "sub_failed": 0}
        hist = Hist()
        gate = asyncio.Semaphore(concurrency) if concurrency > 0 else None
        deadline = time.monotonic() + timeout
        sub_only = set(subscribe.get("only") or ()) if subscribe else set()

        async def one(index: int) -> None:
            dev = Device(self, index, f"{prefix}{index}", keepalive, clean)
            self.devices[index] = dev
            dev.t_start = time.monotonic()
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    transport, _ = await self.loop.create_connection(
                        lambda: dev, host, port, local_addr=source_address(index, sources)
                    )
                    _bump(by_source, transport.get_extra_info("sockname")[0])
                    code = await dev.connack
                    if code != 0:
                        _bump(refused, str(code))
                        dev.close(disconnect=False)
                        return
                    counts["connected"] += 1
                    hist.add(int((dev.t_connack - dev.t_start) * 1e9))
                    if subscribe and (not sub_only or index in sub_only):
                        topic = subscribe["topic"].replace("{i}", str(index))
                        granted = await dev.subscribe(topic, subscribe["qos"])
                        if granted and granted[0] != 0x80:
                            dev.subscribed = True
                            counts["subscribed"] += 1
                        else:
                            counts["sub_failed"] += 1
            except TimeoutError:
                counts["timeouts"] += 1
                dev.close(disconnect=False)
            except Closed:
                counts["closed"] += 1
            except OSError as exc:
                _bump(errors, errno.errorcode.get(exc.errno or 0, type(exc).__name__))
                dev.close(disconnect=False)

        async def gated(index: int) -> None:
            if gate is None:
                await one(index)
            else:
                async with gate:
                    await one(index)

        t_first = time.monotonic()
        await asyncio.gather(*(gated(i) for i in _ids(ids)))
        t_last = max(
            (self.devices[i].t_connack for i in _ids(ids) if self.devices[i].t_connack),
            default=0.0,
        )
        return {
            "attempted": len(_ids(ids)),
            **counts,
            "refused": refused,
            "errors": errors,
            "sources": by_source,
            "t_first": t_first,
            "t_last_connack": t_last,
            "connect_hist": hist.to_json(),
        }

    async def op_publish(
        self,
        ids: list[int],
        topic: str,
        qos: int,
        count: int,
        window: int,
        payload: int,
        start_at: float,
        timeout: float,
        rate: float = 0.0,
    ) -> dict[str, Any]:
        """Every device of ``ids`` publishes ``count`` messages, ``window`` unacknowledged at
        most (and ``rate`` per second at most, if set), starting at ``start_at``; returns once
        all are acknowledged or at the deadline."""
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        acks = Hist()
        pad = b"x" * payload
        jobs: list[asyncio.Future[None]] = []
        t_first = time.monotonic()
        devices = [self.devices[i] for i in _ids(ids) if i in self.devices]
        for dev in devices:
            done: asyncio.Future[None] = self.loop.create_future()
            jobs.append(done)
            name = topic.replace("{i}", str(dev.index)).encode()
            job = PublishJob(name, qos, count, window, pad, acks, done, rate, time.monotonic())
            dev.start(job)
        finished, _pending = await asyncio.wait(jobs, timeout=timeout) if jobs else (set(), set())
        t_last = time.monotonic()
        return {
            "devices": len(devices),
            "sent": sum(d.sent for d in devices),
            "acked": sum(d.acked for d in devices),
            "complete": sum(1 for d in devices if d.job is not None and d.acked >= count),
            "unfinished": len(jobs) - len(finished),
            "lost": sum(1 for d in devices if d.lost),
            # Devices that got fewer PUBACKs than asked (their subscribers are owed fewer).
            "short": {str(d.index): d.acked for d in devices if d.acked < count},
            "t_first": t_first,
            "t_last": t_last,
            "ack_hist": acks.to_json(),
        }

    async def op_probe(self, index: int, topic: str) -> dict[str, Any]:
        self.devices[index].publish_once(topic.encode(), b"probe", 1)
        return {}

    async def op_probe_seen(self, ids: list[int]) -> dict[str, Any]:
        devices = [self.devices[i] for i in _ids(ids) if i in self.devices]
        return {"seen": sum(1 for d in devices if d.probed), "of": len(devices)}

    async def op_clear(self) -> dict[str, Any]:
        self.deliveries = Hist()
        self.first_delivery = self.last_delivery = 0
        return {}

    async def op_received(
        self,
        ids: list[int],
        sources: list[int],
        count: int,
        timeout: float,
        stall: float,
        short: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Wait for every subscriber of ``ids`` to hold what it is owed: the first ``count``
        messages of each source in ``sources``, or the first ``short[source]`` of a source
        whose publisher got fewer PUBACKs (the broker owes only what it acknowledged). Waits
        until the deadline, or until nothing new came for ``stall`` seconds (what is missing
        then is reported, not waited for); then counts what each got. Only subscribers whose
        SUBSCRIBE was granted count (a refused connection is reported where it was refused)."""
        devices = [self.devices[i] for i in _ids(ids) if i in self.devices]
        devices = [d for d in devices if d.subscribed]
        owed = dict.fromkeys(_ids(sources), count)
        owed.update({int(k): v for k, v in (short or {}).items() if int(k) in owed})
        want = sum(owed.values())
        deadline = time.monotonic() + timeout
        progress, last_total = time.monotonic(), -1
        while True:
            now = time.monotonic()
            waiting = [d for d in devices if d.distinct < want and d.transport is not None]
            if not waiting or now > deadline or now - progress > stall:
                break
            total = sum(d.distinct for d in waiting)
            if total != last_total:
                progress, last_total = now, total
            # No event per message: it would cost every delivery a wake-up; 20 ms is fine.
            await asyncio.sleep(0.02)
        per_count: dict[str, int] = {}
        missing = unexpected = 0
        for d in devices:
            _bump(per_count, str(d.distinct))
            good = known = 0
            for src, n in owed.items():
                seen = d.seen.get(src)
                if seen is None:
                    continue
                head = seen[:n]
                good += len(head) - head.count(0)
                known += len(seen) - seen.count(0)
            missing += want - good
            # From no source of the run (sent but not acknowledged messages of a known source
            # beyond what it is owed are neither missing nor unexpected).
            unexpected += d.unexpected + d.distinct - known
        return {
            "subscribers": len(devices),
            "owed_each": want,
            "complete": sum(1 for d in devices if d.distinct >= want),
            "distinct": sum(d.distinct for d in devices),
            "duplicates": sum(d.dups for d in devices),
            "missing": missing,
            "unexpected": unexpected,
            "per_subscriber": per_count,
            "lost": sum(1 for d in devices if d.lost),
            "t_first": self.first_delivery / 1e9,
            "t_last": self.last_delivery / 1e9,
            "latency_hist": self.deliveries.to_json(),
        }

    async def op_progress(self) -> dict[str, Any]:
        """Publications acknowledged to this worker's devices and distinct ones they received,
        so far (a soak's progress, asked while its publish and received operations run)."""
        devs = self.devices.values()
        return {"acked": sum(d.acked for d in devs), "received": sum(d.distinct for d in devs)}

    async def op_status(self) -> dict[str, Any]:
        devs = self.devices.values()
        return {
            "open": sum(1 for d in devs if d.transport is not None),
            "lost": sum(1 for d in devs if d.lost),
            "pings": sum(d.pings for d in devs),
            "pongs": sum(d.pongs for d in devs),
            "protocol_errors": self.protocol_errors,
            "notes": self.notes,
        }

    async def op_close(self, timeout: float) -> dict[str, Any]:
        """DISCONNECT and close every device and silent connection; wait until all are gone."""
        for dev in self.devices.values():
            dev.close()
        for s in self.silent:
            if s.transport is not None:
                s.transport.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (
            any(d.transport is not None for d in self.devices.values())
            or any(s.transport is not None for s in self.silent)
        ):
            await asyncio.sleep(0.02)  # transports report their end through connection_lost
        left = [d for d in self.devices.values() if d.transport is not None]
        for d in left:
            d.abort()
        closed = len(self.devices) - len(left)
        self.devices.clear()
        self.silent.clear()
        return {"closed": closed, "aborted": len(left)}

    async def op_silent(self, count: int, host: str, port: int, timeout: float) -> dict[str, Any]:
        """Open ``count`` TCP connections that never send anything."""
        errors: dict[str, int] = {}

        async def one() -> None:
            proto = Silent()
            try:
                await asyncio.wait_for(
                    self.loop.create_connection(lambda: proto, host, port), timeout
                )
                self.silent.append(proto)
            except TimeoutError:
                _bump(errors, "timeout")
            except OSError as exc:
                _bump(errors, errno.errorcode.get(exc.errno or 0, type(exc).__name__))

        await asyncio.gather(*(one() for _ in range(count)))
        return {"opened": len(self.silent), "errors": errors}

    async def op_silent_status(self) -> dict[str, Any]:
        closed = [s.t_closed - s.t_open for s in self.silent if s.t_closed]
        return {"opened": len(self.silent), "closed": len(closed), "closed_after_s": closed}

    async def op_cpu(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": usage.ru_utime + usage.ru_stime, "t": time.monotonic()}


#: Connections one loopback source address carries at most: a client's TCP connections to one
#: server address and port differ by their source port alone, and the kernel's ephemeral range
#: has 28,232 of them by default (32768-60999); this leaves room for the machine's others.
PER_SOURCE = 20_000


def sources_for(devices: int, host: str) -> int:
    """How many loopback source addresses ``devices`` connections to ``host`` are spread over:
    one per :data:`PER_SOURCE` (at most 254) when ``host`` is a loopback address, else 1 (the
    kernel's choice of source). On Linux every address of 127.0.0.0/8 is the ``lo`` interface's,
    so 127.0.0.2.. need no configuration."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return 1  # a name: its address is the resolver's business
    loopback = address.version == 4 and address.is_loopback
    return min(254, math.ceil(devices / PER_SOURCE)) if loopback and devices > 0 else 1


def source_address(index: int, sources: int) -> tuple[str, int] | None:
    """Where device ``index`` binds before it connects: 127.0.0.1 .. 127.0.0.<sources> in turn
    (any free port); None for ``sources`` <= 1 (unbound, as any client: the kernel picks)."""
    if sources <= 1:
        return None
    return (f"127.0.0.{1 + index % sources}", 0)


def raise_nofile(limit: int | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE to ``limit`` (default: the hard limit), never
    beyond the hard limit and never the system's; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if limit is None else limit
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.buffer.write(json.dumps(message).encode() + b"\n")
    sys.stdout.buffer.flush()


async def _worker_main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    worker = Worker(loop)
    pinger = asyncio.create_task(worker.keepalive_loop())
    tasks: set[asyncio.Task[None]] = set()

    async def handle(message: dict[str, Any]) -> None:
        op = message.pop("op")
        call_id = message.pop("id")
        try:
            result = await getattr(worker, f"op_{op}")(**message)
            _reply({"id": call_id, "ok": True, "result": result})
        except Exception as exc:  # reported to the orchestrator, which raises it there
            _reply({"id": call_id, "ok": False, "error": f"{type(exc).__name__}: {exc}"})

    while True:
        line = await reader.readline()
        if not line:
            break  # the orchestrator is gone: so are we
        message = json.loads(line)
        if message.get("op") == "exit":
            break
        task = asyncio.create_task(handle(message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    pinger.cancel()
    for dev in worker.devices.values():
        dev.close()


def worker_main() -> int:
    # Ctrl-C reaches the whole process group; the orchestrator decides when workers stop (it
    # closes their stdin, or kills them by PID), so that a run always ends in one place.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_nofile()
    asyncio.run(_worker_main())
    return 0


# -- the orchestrator ---------------------------------------------------------------------------


class WorkerFailed(RuntimeError):
    """A worker answered an operation with an error, or died."""


class LoadClient:
    """Worker processes of this file, driven from the caller's event loop.

    Use as ``async with LoadClient(n) as lc``; every worker is stopped on exit (exit message,
    then SIGKILL by PID after a deadline). Worker 0 is for the scenario's single client.
    """

    def __init__(self, processes: int) -> None:
        if processes < 2:
            raise ValueError("a load client needs at least 2 processes (one for the single side)")
        self.size = processes
        self.procs: list[subprocess.Popen[bytes]] = []
        self._writers: list[asyncio.WriteTransport] = []
        self._readers: list[asyncio.Task[None]] = []
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._owner: dict[int, int] = {}
        self._next = 0

    async def __aenter__(self) -> LoadClient:
        loop = asyncio.get_running_loop()
        try:
            for w in range(self.size):
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                self.procs.append(proc)
                assert proc.stdin is not None and proc.stdout is not None
                writer, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
                self._writers.append(writer)
                reader = asyncio.StreamReader(limit=1 << 26, loop=loop)
                await loop.connect_read_pipe(
                    functools.partial(asyncio.StreamReaderProtocol, reader), proc.stdout
                )
                self._readers.append(asyncio.create_task(self._read(w, reader)))
        except BaseException:
            self.kill()
            raise
        return self

    async def __aexit__(self, *_exc: object) -> None:
        try:
            for writer in self._writers:
                with contextlib.suppress(Exception):
                    writer.write(b'{"op": "exit"}\n')
                    writer.close()
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                await asyncio.sleep(0.05)  # a worker ends by itself once it read "exit"
        finally:
            self.kill()
            for task in self._readers:
                task.cancel()

    def kill(self) -> None:
        """SIGKILL every worker still running (by its PID: only processes we started)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)

    async def _read(self, w: int, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                break
            message = json.loads(line)
            fut = self._pending.pop(message["id"], None)
            if fut is not None and not fut.done():
                fut.set_result(message)
        for call_id, owner in list(self._owner.items()):
            fut = self._pending.pop(call_id, None)
            if owner == w and fut is not None and not fut.done():
                fut.set_exception(WorkerFailed(f"load worker {w} exited"))

    async def call(self, w: int, op: str, deadline: float, **args: Any) -> dict[str, Any]:
        """Run ``op`` on worker ``w`` within ``deadline`` seconds; its result, or WorkerFailed /
        TimeoutError."""
        self._next += 1
        call_id = self._next
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        self._owner[call_id] = w
        self._writers[w].write(json.dumps({"op": op, "id": call_id, **args}).encode() + b"\n")
        try:
            message = await asyncio.wait_for(fut, deadline)
        finally:
            self._pending.pop(call_id, None)
            self._owner.pop(call_id, None)
        if not message["ok"]:
            raise WorkerFailed(f"load worker {w}, {op}: {message['error']}")
        result: dict[str, Any] = message["result"]
        return result

    async def each(
        self, workers: Iterable[int], op: str, deadline: float, **args: Any
    ) -> list[dict[str, Any]]:
        """``op`` on several workers at once, each with the same arguments."""
        return list(await asyncio.gather(*(self.call(w, op, deadline, **args) for w in workers)))

    def split(self, n: int) -> list[tuple[int, list[int]]]:
        """Devices ``[0, n)`` dealt in contiguous runs over workers 1.. (``(worker, [lo, hi])``)."""
        workers = self.size - 1
        out = []
        for k in range(workers):
            lo, hi = n * k // workers, n * (k + 1) // workers
            if hi > lo:
                out.append((k + 1, [lo, hi]))
        return out

    async def client_cpu(self) -> list[float]:
        return [r["cpu_s"] for r in await self.each(range(self.size), "cpu", 10.0)]


def processes_for(devices: int, per_process: int = 2500) -> int:
    """Worker processes for ``devices``: one for the single client, and enough for the devices
    that none holds more than ``per_process`` nor more connections than its file limit allows;
    at most one per core beyond two unless the file limit forces more."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (hard if hard != resource.RLIM_INFINITY else 1 << 20) - 64
    by_limit = math.ceil(devices / max(1, room))
    by_load = min(os.cpu_count() or 1, math.ceil(devices / per_process))
    return 1 + max(1, by_limit, by_load)


# -- the server processes seen from /proc ----------------------------------------------------


class ServerGone(RuntimeError):
    """A server process watched in /proc has exited."""


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` (bytes) and ``Threads`` of a process, from /proc/<pid>/status; ServerGone when
    it has exited (gone, or a zombie not yet reaped: its status has no ``VmRSS``)."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            out["rss_bytes"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out["threads"] = int(value)
    if "rss_bytes" not in out:
        raise ServerGone(f"server process {pid} has exited (no memory in /proc/{pid}/status)")
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its own threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    # Fields 14 and 15 of stat(5) (utime, stime), counted from the state field (3).
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_of(pids: Iterable[int]) -> float:
    return sum(proc_cpu_s(p) for p in pids)


# -- scenarios -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """A system under test, seen from the load client."""

    name: str
    devices: tuple[str, int]  # where the N devices connect
    single: tuple[str, int]  # where the single client connects (another aaabus server)
    holder: int  # PID of the server process that holds the devices' connections
    servers: tuple[int, ...]  # every server process (CPU per message)
    connect_deadline_s: float | None = None  # the server's CONNECT deadline, when it has one


@dataclasses.dataclass(frozen=True)
class Options:
    devices: int
    count: int = 100
    window: int = 10
    qos: int = 1
    payload: int = 0
    fanout_count: int = 20
    idle_seconds: float = 10.0
    keepalive: int = 60
    concurrency: int = 100  # handshakes in flight per worker when "as fast as possible"
    persistent_subscribers: bool = True
    silent: int = 200
    storm_slack_s: float = 2.0
    storm_wait_s: float = 10.0  # how long silent connections are watched without a deadline
    stall_s: float = 15.0  # a subscriber that gets nothing new this long is done waiting
    timeout: float = 300.0
    rss_every_s: float = 10.0  # fan-in: how often each server's RSS is sampled
    rate: float = 0.0  # fan-in: messages per second per device at most (0: by the window)
    #: Loopback source addresses the devices are spread over (0: one per PER_SOURCE devices).
    sources: int = 0


def _merge_connect(parts: list[dict[str, Any]]) -> dict[str, Any]:
    hist = Hist()
    refused: dict[str, int] = {}
    errors: dict[str, int] = {}
    sources: dict[str, int] = {}
    for p in parts:
        hist.merge(p["connect_hist"])
        for into, key in ((refused, "refused"), (errors, "errors"), (sources, "sources")):
            for k, v in p.get(key, {}).items():
                into[k] = into.get(k, 0) + v
    t_first = min(p["t_first"] for p in parts)
    t_last = max(p["t_last_connack"] for p in parts)
    connected = sum(p["connected"] for p in parts)
    span = t_last - t_first if connected and t_last > t_first else None
    return {
        "attempted": sum(p["attempted"] for p in parts),
        "connected": connected,
        "refused": refused,
        "refused_total": sum(refused.values()),
        "closed": sum(p["closed"] for p in parts),
        "timeouts": sum(p["timeouts"] for p in parts),
        "errors": errors,
        "sources": sources,  # connections per source address
        "subscribed": sum(p["subscribed"] for p in parts),
        "sub_failed": sum(p["sub_failed"] for p in parts),
        "seconds": span,
        "connects_per_s": connected / span if span else None,
        "connect_ms": hist.summary(),
    }


def _merge_received(parts: list[dict[str, Any]]) -> dict[str, Any]:
    hist = Hist()
    per: dict[str, int] = {}
    for p in parts:
        hist.merge(p["latency_hist"])
        for k, v in p["per_subscriber"].items():
            per[k] = per.get(k, 0) + v
    firsts = [p["t_first"] for p in parts if p["t_first"]]
    return {
        "subscribers": sum(p["subscribers"] for p in parts),
        "complete": sum(p["complete"] for p in parts),
        "received": sum(p["distinct"] for p in parts),
        "duplicates": sum(p["duplicates"] for p in parts),
        "missing": sum(p["missing"] for p in parts),
        "unexpected": sum(p["unexpected"] for p in parts),
        "lost_connections": sum(p["lost"] for p in parts),
        "per_subscriber": per,
        "t_first": min(firsts) if firsts else None,
        "t_last": max((p["t_last"] for p in parts), default=None),
        "latency_ms": hist.summary(),
    }


async def _connect(
    lc: LoadClient,
    spans: list[tuple[int, list[int]]],
    host_port: tuple[str, int],
    prefix: str,
    opts: Options,
    *,
    all_at_once: bool,
    clean: bool = True,
    subscribe: dict[str, Any] | None = None,
    spread: bool = True,
) -> dict[str, Any]:
    """Connect the devices of ``spans``; ``spread``: over loopback source addresses
    (``opts.sources``, by default one per :data:`PER_SOURCE` devices), else all from one."""
    start_at = time.monotonic() + 0.2  # every worker starts together
    total = sum(hi - lo for _w, (lo, hi) in spans)
    sources = 1
    if spread:
        sources = opts.sources if opts.sources else sources_for(total, host_port[0])
    parts = await asyncio.gather(
        *(
            lc.call(
                w,
                "connect",
                opts.timeout + 10,
                ids=ids,
                host=host_port[0],
                port=host_port[1],
                prefix=prefix,
                keepalive=opts.keepalive,
                clean=clean,
                concurrency=0 if all_at_once else opts.concurrency,
                timeout=opts.timeout,
                start_at=start_at,
                subscribe=subscribe,
                sources=sources,
            )
            for w, ids in spans
        )
    )
    return _merge_connect(list(parts))


async def _probe(
    lc: LoadClient,
    publisher: tuple[int, int],
    topic: str,
    subscribers: list[tuple[int, list[int]]],
    timeout: float,
) -> bool:
    """Publish probes until every subscriber has seen one: the route is up end to end (aaabus
    spreads a subscription to the other server's topic representative after its SUBACK)."""
    deadline = time.monotonic() + timeout
    w, index = publisher
    while time.monotonic() < deadline:
        await lc.call(w, "probe", 10.0, index=index, topic=topic)
        await asyncio.sleep(0.2)  # the probe's travel; then look
        seen = await asyncio.gather(
            *(lc.call(sw, "probe_seen", 10.0, ids=ids) for sw, ids in subscribers)
        )
        if all(s["seen"] == s["of"] for s in seen):
            return True
    return False


async def _close_all(lc: LoadClient) -> dict[str, int]:
    parts = await lc.each(range(lc.size), "close", 60.0, timeout=30.0)
    return {
        "closed": sum(p["closed"] for p in parts),
        "aborted": sum(p["aborted"] for p in parts),
    }


async def _status(lc: LoadClient, workers: Iterable[int]) -> dict[str, Any]:
    parts = await lc.each(workers, "status", 10.0)
    return {
        "open": sum(p["open"] for p in parts),
        "lost": sum(p["lost"] for p in parts),
        "pings": sum(p["pings"] for p in parts),
        "pongs": sum(p["pongs"] for p in parts),
        "protocol_errors": sum(p["protocol_errors"] for p in parts),
        "notes": [n for p in parts for n in p["notes"]][:5],
    }


def _tag() -> str:
    return uuid.uuid4().hex[:6]


async def fan_in(lc: LoadClient, target: Target, opts: Options) -> dict[str, Any]:
    """N devices publish ``count`` messages each (``window`` in flight) to ``dev/<i>/data``;
    one subscriber of ``dev/+/data`` on the other endpoint counts them."""
    n, tag = opts.devices, _tag()
    topic = f"ld{tag}/dev/{{i}}/data"
    one = (0, [n, n + 1])
    sub = await _connect(
        lc,
        [one],
        target.single,
        f"{tag}s",
        opts,
        all_at_once=True,
        clean=not opts.persistent_subscribers,
        subscribe={"topic": f"ld{tag}/dev/+/data", "qos": opts.qos},
    )
    if sub["subscribed"] != 1:
        raise RuntimeError(f"fan-in: the subscriber did not subscribe: {sub}")
    spans = lc.split(n)
    devices = await _connect(lc, spans, target.devices, f"{tag}d", opts, all_at_once=False)
    routed = await _probe(
        lc, (spans[0][0], spans[0][1][0]), topic.replace("{i}", "probe"), [one], 60.0
    )
    await lc.call(0, "clear", 10.0)
    cpu0, client0 = cpu_of(target.servers), await lc.client_cpu()
    start_at = time.monotonic() + 0.2
    rss: list[list[float]] = []
    sampler = asyncio.create_task(_sample(lc, target.servers, opts.rss_every_s, rss))
    pubs = await asyncio.gather(
        *(
            lc.call(
                w,
                "publish",
                opts.timeout + 10,
                ids=ids,
                topic=topic,
                qos=opts.qos,
                count=opts.count,
                window=opts.window,
                payload=opts.payload,
                start_at=start_at,
                timeout=opts.timeout,
                rate=opts.rate,
            )
            for w, ids in spans
        )
    )
    acks = Hist()
    for p in pubs:
        acks.merge(p["ack_hist"])
    acked = sum(p["acked"] for p in pubs)
    t_last_ack = max(p["t_last"] for p in pubs)
    short = {k: v for p in pubs for k, v in p["short"].items()}
    received = _merge_received(
        [
            await lc.call(
                0,
                "received",
                opts.timeout + 10,
                ids=one[1],
                sources=[0, n],
                count=opts.count,
                timeout=opts.timeout,
                stall=opts.stall_s,
                short=short,
            )
        ]
    )
    cpu1, client1 = cpu_of(target.servers), await lc.client_cpu()
    sampler.cancel()
    status = await _status(lc, range(lc.size))
    await _close_all(lc)
    span = t_last_ack - start_at
    end = received["t_last"] or t_last_ack
    return {
        "devices": devices,
        # [seconds since the start, publications acknowledged, distinct ones received (a few
        # probes included), RSS of each server (bytes) in Target.servers' order], every
        # rss_every_s while publishing and delivering: a soak's memory against its backlog.
        "rss_timeline": [[t - start_at, *sizes] for t, *sizes in rss],
        "subscriber": sub,
        "routed": routed,
        "sent": sum(p["sent"] for p in pubs),
        "acked": acked,
        "unfinished_devices": sum(p["unfinished"] for p in pubs),
        "seconds": span,
        "msgs_per_s": acked / span if acked and span > 0 else None,
        "puback_ms": acks.summary(),
        "received": received,
        "delivery_ms": received["latency_ms"],
        "delivered_per_s": received["received"] / (end - start_at)
        if received["received"] and end > start_at
        else None,
        "asked": n * opts.count,
        # What the subscriber is owed: every acknowledged publication.
        "expected": acked,
        "missing": received["missing"],
        "duplicates": received["duplicates"],
        "server_cpu_s": cpu1 - cpu0,
        "cpu_us_per_msg": (cpu1 - cpu0) / acked * 1e6 if acked else None,
        "client_cpu_pct_max": _busiest(client0, client1, end - start_at),
        "status": status,
    }


async def _sample(
    lc: LoadClient, pids: Sequence[int], every: float, into: list[list[float]]
) -> None:
    """Append ``[monotonic time, acknowledged, received, RSS of each of pids]`` to ``into``
    every ``every`` seconds, from now until cancelled (a process gone ends the sampling: the
    scenario says why). Acknowledged minus received is the backlog the servers hold."""
    while True:
        t = time.monotonic()
        try:
            sizes = [proc_status(p)["rss_bytes"] for p in pids]
        except ServerGone:
            return
        parts = await lc.each(range(lc.size), "progress", 10.0)
        acked = sum(p["acked"] for p in parts)
        into.append([t, acked, sum(p["received"] for p in parts), *sizes])
        await asyncio.sleep(every)


def _busiest(before: list[float], after: list[float], seconds: float) -> float | None:
    """The busiest load worker's CPU over a phase, % of one core: near 100 % means the client,
    not the server, set the pace."""
    if seconds <= 0:
        return None
    return max(100.0 * (b - a) / seconds for a, b in zip(before, after, strict=True))


async def fan_out(lc: LoadClient, target: Target, opts: Options) -> dict[str, Any]:
    """One publisher (on the single endpoint) and N subscribers of one topic (the devices')."""
    n, tag = opts.devices, _tag()
    topic = f"ld{tag}/fan"
    spans = lc.split(n)
    subs = await _connect(
        lc,
        spans,
        target.devices,
        f"{tag}s",
        opts,
        all_at_once=False,
        clean=not opts.persistent_subscribers,
        subscribe={"topic": topic, "qos": opts.qos},
    )
    one = (0, [n, n + 1])
    pub = await _connect(lc, [one], target.single, f"{tag}p", opts, all_at_once=True)
    routed = await _probe(lc, (0, n), topic, spans, 60.0)
    await lc.each([w for w, _ in spans], "clear", 10.0)
    cpu0, client0 = cpu_of(target.servers), await lc.client_cpu()
    start_at = time.monotonic() + 0.2
    published = await lc.call(
        0,
        "publish",
        opts.timeout + 10,
        ids=one[1],
        topic=topic,
        qos=opts.qos,
        count=opts.fanout_count,
        window=opts.window,
        payload=opts.payload,
        start_at=start_at,
        timeout=opts.timeout,
    )
    received = _merge_received(
        list(
            await asyncio.gather(
                *(
                    lc.call(
                        w,
                        "received",
                        opts.timeout + 10,
                        ids=ids,
                        sources=[n, n + 1],
                        count=opts.fanout_count,
                        timeout=opts.timeout,
                        stall=opts.stall_s,
                        short=published["short"],
                    )
                    for w, ids in spans
                )
            )
        )
    )
    cpu1, client1 = cpu_of(target.servers), await lc.client_cpu()
    status = await _status(lc, range(lc.size))
    await _close_all(lc)
    end = received["t_last"] or time.monotonic()
    return {
        "subscribers": subs,
        "publisher": pub,
        "routed": routed,
        "published": published["sent"],
        "acked": published["acked"],
        "puback_ms": Hist().merge(published["ack_hist"]).summary(),
        "received": received,
        "asked": n * opts.fanout_count,
        # Every subscriber is owed every acknowledged publication.
        "expected": received["subscribers"] * published["acked"],
        "missing": received["missing"],
        "duplicates": received["duplicates"],
        "seconds": end - start_at,
        "deliveries_per_s": received["received"] / (end - start_at)
        if received["received"] and end > start_at
        else None,
        "latency_ms": received["latency_ms"],
        "server_cpu_s": cpu1 - cpu0,
        "cpu_us_per_delivery": (cpu1 - cpu0) / received["received"] * 1e6
        if received["received"]
        else None,
        "client_cpu_pct_max": _busiest(client0, client1, end - start_at),
        "status": status,
    }


async def idle(lc: LoadClient, target: Target, opts: Options) -> dict[str, Any]:
    """N devices connect at once, then idle with keep-alive; the holder's RSS per connection,
    threads and CPU; then one publication must reach one of them."""
    n, tag = opts.devices, _tag()
    listener = n // 2  # the idle device that subscribes (any one would do)
    topic = f"ld{tag}/idle/{{i}}"
    before = proc_status(target.holder)
    spans = lc.split(n)
    connect = await _connect(
        lc,
        spans,
        target.devices,
        f"{tag}i",
        opts,
        all_at_once=True,
        subscribe={"topic": topic, "qos": 1, "only": [listener]},
    )
    cpu0, t0 = proc_cpu_s(target.holder), time.monotonic()
    await asyncio.sleep(opts.idle_seconds)
    cpu1, t1 = proc_cpu_s(target.holder), time.monotonic()
    during = proc_status(target.holder)
    status = await _status(lc, [w for w, _ in spans])
    # One publication, from the single endpoint, to the listening idle device.
    one = (0, [n, n + 1])
    publisher = await _connect(lc, [one], target.single, f"{tag}p", opts, all_at_once=True)
    holder_w = next(w for w, (lo, hi) in spans if lo <= listener < hi)
    await lc.call(holder_w, "clear", 10.0)
    await lc.call(
        0,
        "publish",
        70.0,
        ids=one[1],
        topic=topic.replace("{i}", str(listener)),
        qos=1,
        count=1,
        window=1,
        payload=0,
        start_at=0.0,
        timeout=60.0,
    )
    got = await lc.call(
        holder_w,
        "received",
        40.0,
        ids=[listener, listener + 1],
        sources=[n, n + 1],
        count=1,
        timeout=30.0,
        stall=30.0,
    )
    await _close_all(lc)
    connected = connect["connected"]
    rss = during["rss_bytes"] - before["rss_bytes"]
    return {
        "connect": connect,
        "connected": connected,
        "refused": connect["refused_total"] + connect["closed"],
        "connects_per_s": connect["connects_per_s"],
        "rss_before_bytes": before["rss_bytes"],
        "rss_idle_bytes": during["rss_bytes"],
        "rss_bytes_per_conn": rss / connected if connected else None,
        "threads_before": before["threads"],
        "threads": during["threads"],
        "idle_seconds": t1 - t0,
        "idle_cpu_pct": 100.0 * (cpu1 - cpu0) / (t1 - t0),
        "still_open": status["open"],
        "lost_while_idle": status["lost"],
        "pings": status["pings"],
        "pongs": status["pongs"],
        # None: the listening device itself was refused (see "subscribed").
        "reached": got["distinct"] == 1 if connect["subscribed"] else None,
        "publisher_connected": publisher["connected"] == 1,
        "subscribed": connect["subscribed"],
    }


async def storm(lc: LoadClient, target: Target, opts: Options) -> dict[str, Any]:
    """``silent`` connections that never send, then N devices at once (CONNECT right away), all
    from 127.0.0.1: do the devices all get CONNACK 0, are the silent ones closed in time?"""
    n, tag = opts.devices, _tag()
    host, port = target.devices
    opened = await lc.call(0, "silent", 60.0, count=opts.silent, host=host, port=port, timeout=30.0)
    t_silent = time.monotonic()
    # All from one address, beside the silent ones: the per-address table is what is tested.
    connect = await _connect(
        lc, lc.split(n), target.devices, f"{tag}x", opts, all_at_once=True, spread=False
    )
    # Watch the silent ones until all are closed, or the deadline (+ slack) has passed.
    # The slack: at least storm_slack_s, 10 % of a long deadline (a server may check its
    # deadlines every few seconds: Mosquitto's 90 s went by in 94.8 s once).
    deadline = target.connect_deadline_s
    limit = (
        deadline + max(opts.storm_slack_s, 0.1 * deadline)
        if deadline is not None
        else opts.storm_wait_s
    )
    while True:
        silent = await lc.call(0, "silent_status", 10.0)
        if silent["closed"] >= silent["opened"] or time.monotonic() - t_silent > limit:
            break
        await asyncio.sleep(0.1)  # the server closes them: nothing to wait on but the sockets
    after = sorted(silent["closed_after_s"])
    in_time = sum(1 for s in after if s <= limit)
    status = await _status(lc, range(1, lc.size))
    await _close_all(lc)
    return {
        "devices": n,
        "connack0": connect["connected"],
        "connect": connect,
        "all_connected": connect["connected"] == n,
        "silent": opts.silent,
        "silent_opened": opened["opened"],
        "silent_errors": opened["errors"],
        "silent_closed": silent["closed"],
        "silent_closed_in_time": in_time,
        "deadline_s": limit,
        "server_deadline_s": target.connect_deadline_s,
        "silent_closed_after_s": {
            "min": after[0] if after else None,
            "p50": after[len(after) // 2] if after else None,
            "max": after[-1] if after else None,
        },
        "all_evicted": opened["opened"] > 0 and in_time == opened["opened"],
        "devices_lost_after": status["lost"],
    }


SCENARIOS: dict[str, Callable[[LoadClient, Target, Options], Any]] = {
    "idle": idle,
    "fan_in": fan_in,
    "fan_out": fan_out,
    "storm": storm,
}


def run_scenarios(
    target: Target, opts: Options, names: Sequence[str], processes: int | None = None
) -> dict[str, Any]:
    """Run scenarios ``names`` in order against ``target`` with a fresh load client."""

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with LoadClient(processes or processes_for(opts.devices)) as lc:
            out["processes"] = lc.size
            for name in names:
                out[name] = await SCENARIOS[name](lc, target, opts)
        return out

    raise_nofile()
    return asyncio.run(main())


# -- standalone command line -------------------------------------------------------------------


def _standalone(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python perf/mqttload.py", description="the load client against any MQTT broker"
    )
    parser.add_argument("scenario", choices=[*SCENARIOS, "worker"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--single-port", type=int, help="the single client's port (default: same)")
    parser.add_argument("--pid", type=int, help="the broker's PID (RSS, threads, CPU)")
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--silent", type=int, default=200)
    parser.add_argument("--processes", type=int, help="worker processes (default: by N)")
    args = parser.parse_args(argv)
    if args.scenario == "worker":
        return worker_main()
    pid = args.pid or os.getpid()
    target = Target(
        "broker",
        (args.host, args.port),
        (args.host, args.single_port or args.port),
        pid,
        (pid,),
    )
    opts = Options(
        devices=args.devices,
        count=args.count,
        window=args.window,
        qos=args.qos,
        idle_seconds=args.idle_seconds,
        silent=args.silent,
    )
    print(json.dumps(run_scenarios(target, opts, [args.scenario], args.processes)))
    return 0


if __name__ == "__main__":
    sys.exit(_standalone(sys.argv[1:]))
