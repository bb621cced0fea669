"""The traffic of ``python -m perf failover``, driven and recorded from outside the bus.

Every participant is a program of this process that the checker can see whole:

* :class:`Device`: an MQTT 3.1.1 device (paho), persistent session, QoS 2 both ways, that
  follows its server's primary: when its connection ends it tries each member's hostname in
  turn (same port) until one accepts its CONNECT (a follower refuses: it is not the primary);
* the stream publishers and subscribers, the causal devices (they republish part of what they
  receive, so that causal chains cross the servers) and the pinger are devices;
* :class:`Pinger`: sends pings through a :class:`~aaabus.tools.client.Client` of a server that
  is never killed to the :class:`~perf.agents.failover.Ponger` agent on the server that fails
  over, and reads the pongs it publishes with its own device.

Every message carries, in its JSON payload, the vector clock of the event that sent it; each
receipt ticks the receiver's clock (``merge_and_tick``), each publication too. What is sent and
what is received goes to one :class:`queue.SimpleQueue` as :class:`Sent` and
:class:`Delivered` events, which the run's main thread alone turns into the history the
independent checker judges (:mod:`aaabus.testing.failhistory`).

Threads: paho's network thread of each device (receipts, and the republications they cause),
one keeper thread per device (its connections), one pacer thread per publishing device, the
pinger's thread. A device's clock is shared by its paho thread and its pacer or pinger: its
lock guards the clock and the publication that carries it, so that publication order and clock
order are one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aaabus.testing.workload import merge_and_tick

#: Topics of the run.
PONG, STREAM, CAUSAL = "fo/pong", "fo/stream", "fo/causal"
#: Seconds between two rounds of connection attempts over every member.
RECONNECT_PAUSE = 0.05


@dataclass(frozen=True)
class Sent:
    """``sender`` sent ``mid`` (owed to each of ``dests``) at an event whose clock is ``vc``."""

    at: float
    mid: str
    sender: str
    dests: tuple[str, ...]
    vc: dict[str, int]


@dataclass(frozen=True)
class Delivered:
    """``receiver`` (a device of ``server``, connected to ``member`` since ``since``) received
    the message whose payload is ``body`` at ``at``."""

    at: float
    receiver: str
    server: int
    member: int
    since: float
    body: dict[str, Any]


@dataclass(frozen=True)
class Connected:
    """Device ``device`` was accepted by ``member`` of ``server``; ``session`` is false when the
    server had no session for it (its first connection, or a session lost)."""

    at: float
    device: str
    server: int
    member: int
    session: bool


Event = Sent | Delivered | Connected


@dataclass
class Endpoints:
    """Where a server's devices connect: each member's hostname (member 0 first), one port."""

    server: int
    hosts: tuple[str, ...]
    port: int


@functools.cache
def _client_class() -> Any:
    """paho's client class, with its session kept across connection attempts that fail.

    paho (2.2.0) prepares its unfinished publications again at every :meth:`connect`, a
    refused one included, and that step is not idempotent: the first turns a QoS 2 flow whose
    PUBREL is owed into "resend PUBREL", the second turns that into "send the PUBLISH again",
    as a new message (DUP clear). A device walking the members of a server that failed over
    makes several attempts; a flow whose PUBCOMP died with the primary was then published
    twice, the bus rightly taking a PUBLISH after the PUBREL as new (3.1.1 §4.3.3, §4.4: the
    sender must send the PUBREL again, never the PUBLISH). Here a flow that owes its PUBREL
    is put back to awaiting PUBCOMP before paho's step, which maps that to "resend PUBREL"
    however many attempts come first (tests/test_failover_device.py)."""
    import paho.mqtt.client as mqtt

    class _Client(mqtt.Client):
        def _messages_reconnect_reset_out(self) -> None:
            with self._out_message_mutex:  # an RLock: paho's step takes it again
                for message in self._out_messages.values():
                    if message.state == mqtt.mqtt_ms_resend_pubrel:
                        message.state = mqtt.mqtt_ms_wait_for_pubcomp
                super()._messages_reconnect_reset_out()

    return _Client


def _paho(client_id: str) -> Any:
    import paho.mqtt.client as mqtt

    # No automatic reconnection: the device itself goes to the next member, never back to the
    # same address by paho's own loop.
    client = _client_class()(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=False,
        protocol=mqtt.MQTTv311,
        reconnect_on_failure=False,
    )
    client.max_inflight_messages_set(20)
    client.max_queued_messages_set(0)
    return client


class Device:
    """One device of the run (see the module's docstring).

    ``react``: called on paho's thread with each received payload, after the clock ticked
    (a causal device republishes from there). ``keepalive``: seconds of MQTT keep-alive (a
    paused primary is noticed after 1.5 times that).
    """

    def __init__(
        self,
        name: str,
        where: Endpoints,
        filters: Sequence[str],
        events: queue.SimpleQueue[Event],
        *,
        react: Callable[[Device, dict[str, Any]], None] | None = None,
        keepalive: int = 5,
    ) -> None:
        self.name = name
        self.where = where
        self.filters = tuple(filters)
        self.events = events
        self.react = react
        self.keepalive = keepalive
        self.client = _paho(name)
        self.lock = threading.Lock()
        self.vc: dict[str, int] = {}
        #: Member accepted last (-1: none yet) and since when (monotonic).
        self.member = -1
        self.since = 0.0
        self.connections = 0
        # Publications made and completed (PUBCOMP): counted apart, the second on paho's thread
        # under its own lock (paho holds its message lock while it calls on_publish, and
        # publish() takes that lock: :attr:`lock` there could deadlock).
        self.published = 0
        self._completed = 0
        self._acks = threading.Lock()
        self._state: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name=f"device-{name}", daemon=True)
        # Publications wait in the outbox while the device is between members and until paho
        # has sent again what the last connection left unacknowledged: paho sends those only
        # after on_connect returns, so a publication made meanwhile would overtake them on the
        # wire (seen: c1-938 published before c1-930..937, which the bus then rightly
        # delivered in that order). Its own thread stamps and sends them, in order.
        self._outbox: queue.SimpleQueue[tuple[str, tuple[str, ...], dict[str, Any]]] = (
            queue.SimpleQueue()
        )
        self._open = threading.Event()
        self._sender = threading.Thread(target=self._send, name=f"device-{name}-out", daemon=True)
        self.client.on_connect = lambda _c, _u, flags, rc, _p: self._state.put(
            ("connack", (rc.value, flags.session_present))
        )
        self.client.on_disconnect = self._gone
        self.client.on_message = self._message
        self.client.on_publish = self._complete

    # -- connections (the keeper thread) ------------------------------------------------------

    def start(self) -> Device:
        self._keeper.start()
        self._sender.start()
        return self

    def _gone(self, *_args: Any) -> None:
        self._open.clear()
        self._state.put(("gone", None))

    def _keep(self) -> None:
        member = 0
        while not self._stop.is_set():
            if self._connect(member):
                self._wait_gone()
            else:
                member = (member + 1) % len(self.where.hosts)
                if member == 0:
                    self._stop.wait(RECONNECT_PAUSE)
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()

    def _connect(self, member: int) -> bool:
        """One CONNECT to ``member``; True once it is accepted (the device then stays)."""
        while not self._state.empty():
            self._state.get()
        try:
            self.client.connect(self.where.hosts[member], self.where.port, self.keepalive)
        except OSError:
            return False  # not listening there: a follower, or a member down
        self.client.loop_start()
        answer = self._next(time.monotonic() + 5.0)
        if answer is not None and answer[0] == "connack" and answer[1][0] == 0:
            session = bool(answer[1][1])
            self.member, self.since = member, time.monotonic()
            self.connections += 1
            if not session:
                for topic_filter in self.filters:
                    self.client.subscribe(topic_filter, 2)
            self.events.put(Connected(self.since, self.name, self.where.server, member, session))
            while self.outstanding() > 0 and self._state.empty() and not self._stop.is_set():
                self._stop.wait(0.005)  # paho's resends, acknowledged by its thread
            if self._state.empty():
                self._open.set()
            return True
        self.client.loop_stop()
        with contextlib.suppress(Exception):
            self.client.disconnect()
        return False

    def _next(self, deadline: float) -> tuple[str, Any] | None:
        try:
            return self._state.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def _wait_gone(self) -> None:
        while not self._stop.is_set():
            try:
                kind, _ = self._state.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "gone":
                break
        self.member = -1
        self.client.loop_stop()

    def stop(self) -> None:
        self._stop.set()
        self._keeper.join(10)
        self._sender.join(10)

    # -- traffic ------------------------------------------------------------------------------

    def stamp(self) -> tuple[str, dict[str, int]]:
        """A new event of this device: its message id and clock (call with :attr:`lock`)."""
        self.vc[self.name] = self.vc.get(self.name, 0) + 1
        return f"{self.name}-{self.vc[self.name]}", dict(self.vc)

    def publish(self, topic: str, dests: Sequence[str], **extra: Any) -> None:
        """Publish a new message owed to ``dests`` at QoS 2, from any thread: it goes to the
        outbox, and leaves stamped with the clock of the moment it is sent (paho sends it again
        after a reconnection until it is acknowledged)."""
        self._outbox.put((topic, tuple(dests), extra))

    def _send(self) -> None:
        while not self._stop.is_set():
            try:
                topic, dests, extra = self._outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            while not self._open.wait(0.1):
                if self._stop.is_set():
                    return
            self._publish_now(topic, dests, extra)

    def _publish_now(self, topic: str, dests: tuple[str, ...], extra: dict[str, Any]) -> None:
        with self.lock:
            mid, vc = self.stamp()
            body = {"mid": mid, "from": self.name, "vc": vc, **extra}
            self.events.put(Sent(time.monotonic(), mid, self.name, tuple(dests), vc))
            with self._acks:  # counted first: its PUBCOMP may come before publish() returns
                self.published += 1
            self.client.publish(topic, json.dumps(body), qos=2)

    def probe(self, topic: str) -> None:
        """A message outside the history: it shows a subscription in force before the run."""
        with self._acks:
            self.published += 1
        self.client.publish(topic, json.dumps({"probe": self.name}), qos=1)

    def _complete(self, *_args: Any) -> None:
        with self._acks:
            self._completed += 1

    def outstanding(self) -> int:
        """Publications not completed yet (their PUBCOMP not received)."""
        with self._acks:
            return self.published - self._completed

    def backlog(self) -> int:
        """Publications asked for and not completed: in the outbox or unacknowledged."""
        return self._outbox.qsize() + self.outstanding()

    def _message(self, _c: Any, _u: Any, msg: Any) -> None:
        body = json.loads(msg.payload)
        if "probe" in body:
            self.events.put(Delivered(time.monotonic(), self.name, self.where.server, -1, 0, body))
            return
        with self.lock:
            self.vc = merge_and_tick(self.vc, body["vc"], self.name)
            self.events.put(
                Delivered(
                    time.monotonic(), self.name, self.where.server, self.member, self.since, body
                )
            )
        if self.react is not None:
            self.react(self, body)


@dataclass
class Pacer:
    """Publishes on ``topic`` from ``device`` ``rate`` times a second while it runs, holding
    back while more than ``window`` of its publications are unacknowledged."""

    device: Device
    topic: str
    dests: tuple[str, ...]
    rate: float
    window: int = 200
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Pacer:
        self._thread = threading.Thread(
            target=self._run, name=f"pacer-{self.device.name}", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.device.backlog() < self.window:
                self.device.publish(self.topic, self.dests)
            next_at += 1.0 / self.rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


class Causal:
    """A causal device's reaction: a message from another causal device that has made fewer
    than ``ttl`` hops is republished, with probability ``chance``, one hop further, to every
    causal device (``rng`` is this device's own, used on its paho thread only)."""

    def __init__(self, names: tuple[str, ...], ttl: int, chance: float, seed: int) -> None:
        self.names = names
        self.ttl = ttl
        self.chance = chance
        self.rng = random.Random(seed)

    def __call__(self, device: Device, body: dict[str, Any]) -> None:
        hop = int(body.get("hop", 0))
        if body["from"] == device.name or hop >= self.ttl or self.rng.random() >= self.chance:
            return
        device.publish(f"{CAUSAL}/{device.name}", self.names, hop=hop + 1)


class Pinger:
    """Pings ``ponger`` through ``client`` (a server never killed), one at a time: the next
    once the pong of the last came back to ``device`` (subscribed to the pongs)."""

    def __init__(self, device: Device, client: Any, ponger: Any) -> None:
        from perf.agents.failover import Ping

        self._ping = Ping
        self.device = device
        self.client = client
        self.ponger = ponger
        self.answered: set[str] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pinger", daemon=True)
        self.rounds = 0
        #: Round trips in ms (a failover's among them), appended by the pinger's thread.
        self.rtts: list[float] = []
        device.react = self._pong

    def _pong(self, _device: Device, body: dict[str, Any]) -> None:
        with self._cond:
            self.answered.add(body["ping"])
            self._cond.notify_all()

    def start(self) -> Pinger:
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def send_probe(self, mid: str) -> None:
        """A ping outside the history (``probe-...``): its pong shows the subscription of the
        pinger's device in force on the ponger's server."""
        self.client.send(self.ponger, self._ping(mid, {}), request_id=mid)

    def wait_answer(self, mid: str, deadline: float) -> bool:
        with self._cond:
            while mid not in self.answered:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def _run(self) -> None:
        from aaabus.errors import ServerUnreachable

        while not self._stop.is_set():
            started = time.monotonic()
            with self.device.lock:
                mid, vc = self.device.stamp()
                self.device.events.put(
                    Sent(time.monotonic(), mid, self.device.name, ("ponger",), vc)
                )
            while not self._stop.is_set():
                try:
                    self.client.send(self.ponger, self._ping(mid, vc), request_id=mid)
                    break
                except ServerUnreachable:
                    continue  # the same request id: sent once whatever happened before
            self.rounds += 1
            while not self.wait_answer(mid, time.monotonic() + 1.0):
                if self._stop.is_set():
                    return
            self.rtts.append(1000 * (time.monotonic() - started))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(40)
