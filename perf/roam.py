"""``python -m perf roam``: a device moves between three sites; does it get every message once,
in order, when the servers it leaves are killed?

The scenario (issue 32): three sites, each an MQTT endpoint in its own place (aaabus: a server
in each of three causality domains joined by routers; Mosquitto: three brokers joined by
bridges). A **publisher** elsewhere sends ``--messages`` QoS 2 messages on ``roam/<n>`` at a
steady pace. The **device** (client id ``roamer``, persistent session, subscribed to ``roam/#``
at QoS 2) visits the sites in turn, ``--moves`` times, staying ``--dwell`` seconds at each; every
``--kill-every``-th time it leaves a site, that site's server (broker) is SIGKILLed under it and
started again while the device goes on to the next site. After each arrival the device publishes
``moved/<k>`` (QoS 2), which a **watcher** next to the publisher reads: what a device publishes
from a site must not overtake what it published from the one before.

The device is the same paho program for every system: it reconnects to the next site with the
same client id and session, retries a refused or failed CONNECT until a deadline, and subscribes
again only when the server says it has no session (CONNACK session present = 0) — as a device
written for any broker would. At the end it stays at its last site until it has every message or
nothing more arrives for ``--quiet`` seconds.

Counted per system: ``lost`` (messages never received), ``duplicated`` (received more than once),
``violations`` (a message received for the first time after a later one of the same publisher,
plus the watcher's ``moved/<k>`` out of order).

Systems: ``aaabus`` (roaming sessions on: ``aaabus.mqtt.roaming``; the directory on the
publisher's server, which is never killed) and ``mosquitto_bridges`` (the publisher's broker
bridges ``roam/#`` out to each site's broker at QoS 2 with persistent bridge sessions, each
site's broker bridges ``moved/#`` back; persistence on, saved every second — Mosquitto's most
durable setting short of saving on every change). A Mosquitto session lives on the broker that
made it: what is queued there while the device is elsewhere is lost to it, or delivered twice
when it comes back.

Threads: the main thread moves the device; paho's network threads record arrivals under a
condition the main thread waits on (with deadlines); the publisher paces itself in a thread of its
own; restarts after a kill run in a thread so the device does not wait for them. Everything
started is stopped on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from perf.aaabus_mqtt import mqtt_servers
from perf.brokers import Endpoint, find_binary, free_ports, start_mosquitto, stop_group
from perf.harness import scratch

ROAM, MOVED = "roam", "moved"
#: Published before the messages until the device has one: the device's subscription is then
#: in force where the publisher publishes (not counted).
PROBE = f"{ROAM}/probe"
CLIENT_ID = "roamer"


@dataclass
class Sites:
    """A running system: the three sites the device visits, where the publisher and the watcher
    connect, and how to kill a site's server (SIGKILL, returns once it is dead) and start it
    again (returns once it serves MQTT again)."""

    sites: list[Endpoint]
    publisher: Endpoint
    kill: Callable[[int], None]
    restart: Callable[[int], None]
    #: Returns once every site would pass on what the device publishes to the watcher, whose
    #: subscription is made first (aaabus: a subscription reaches the other servers as a
    #: message does; Mosquitto's bridges are configured beforehand: nothing to wait for).
    ready: Callable[[], None] = lambda: None


class RoamSystem(Protocol):
    name: str

    def missing(self) -> str | None: ...

    def start(self, work: Path) -> contextlib.AbstractContextManager[Sites]: ...


class AaabusRoaming:
    """aaabus: domains A = {0, 1}, B = {1, 2, 3, 5}, C = {3, 4}; servers 1 and 3 are routers.
    The device's sites are the listeners of 0, 2 and 4 (one per domain, none a router); the
    publisher and the watcher use the listener of 5, which is also the sessions' directory."""

    name = "aaabus"
    LAYOUT = [[0, 1], [1, 2, 3, 5], [3, 4]]
    SITES = (0, 2, 4)
    PUBLISHER = 5

    def missing(self) -> str | None:
        return None

    @contextlib.contextmanager
    def start(self, work: Path) -> Iterator[Sites]:
        listeners = {server: 100 for server in (*self.SITES, self.PUBLISHER)}
        bus_properties = {
            "aaabus.mqtt.roaming": "true",
            "aaabus.mqtt.directory": str(self.PUBLISHER),
        }
        with mqtt_servers(work, self.LAYOUT, listeners, bus_properties=bus_properties) as running:
            bus = running.bus

            def kill(site: int) -> None:
                bus[self.SITES[site]].kill()

            def restart(site: int) -> None:
                bus[self.SITES[site]].start().wait_ready(60.0)

            def ready() -> None:
                # The watcher's filter is the only one so far: each site knows it.
                for server in self.SITES:
                    _wait_remote_filters(running.bus.config, server, 1, 60.0)

            yield Sites(
                [running.endpoints[s] for s in self.SITES],
                running.endpoints[self.PUBLISHER],
                kill,
                restart,
                ready,
            )


def _wait_remote_filters(config: str | Path, server: int, count: int, timeout: float) -> None:
    """Until server ``server``'s topic representative knows ``count`` filters subscribed on
    other servers (read through its admin port)."""
    from aaabus.tools.client import Client

    deadline = time.monotonic() + timeout
    while Client(config, server).status()["topics"]["remote_filters"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"server {server} does not know the watcher's subscription")
        time.sleep(0.05)  # another process's state, read through its admin port: poll it


class MosquittoBridges:
    """Four Mosquitto brokers: the publisher's (P) and one per site. P bridges ``roam/#`` out to
    every site at QoS 2; every site bridges ``moved/#`` out to P. Bridges keep persistent
    sessions (``cleansession false``), so what a broker down meanwhile misses waits at the other
    end of its bridge."""

    name = "mosquitto_bridges"

    def missing(self) -> str | None:
        if find_binary("mosquitto") is None:
            return "mosquitto is not installed (`make peers` installs it)"
        return None

    @staticmethod
    def _bridge(name: str, port: int, topic: str) -> str:
        return (
            f"\nconnection {name}\n"
            f"address 127.0.0.1:{port}\n"
            f"topic {topic}/# out 2\n"
            "bridge_protocol_version mqttv311\n"
            "try_private true\n"
            "cleansession false\n"
            "notifications false\n"
            "restart_timeout 1\n"
        )

    @contextlib.contextmanager
    def start(self, work: Path) -> Iterator[Sites]:
        procs: list[Any] = []
        pub_port, *site_ports = free_ports(4)
        durable = "autosave_interval 1\n"
        site_conf = [durable + self._bridge(f"site{i}-to-pub", pub_port, MOVED) for i in range(3)]
        by_site: dict[int, Any] = {}

        def start_site(i: int) -> Endpoint:
            endpoint = start_mosquitto(
                work,
                procs,
                window=100,
                name=f"site-{i}",
                extra_conf=site_conf[i],
                port=site_ports[i],
            )
            by_site[i] = procs[-1]
            return endpoint

        try:
            sites = [start_site(i) for i in range(3)]
            pub_conf = durable + "".join(
                self._bridge(f"pub-to-site{i}", site_ports[i], ROAM) for i in range(3)
            )
            publisher = start_mosquitto(
                work, procs, window=100, name="publisher", extra_conf=pub_conf, port=pub_port
            )

            def kill(site: int) -> None:
                proc = by_site[site]
                os.killpg(proc.pid, signal.SIGKILL)  # its own group: start_new_session
                proc.wait(10)

            def restart(site: int) -> None:
                start_site(site)

            yield Sites(sites, publisher, kill, restart)
        finally:
            for proc in reversed(procs):
                stop_group(proc)


#: The systems, by name.
SYSTEMS: dict[str, type[AaabusRoaming] | type[MosquittoBridges]] = {
    "aaabus": AaabusRoaming,
    "mosquitto_bridges": MosquittoBridges,
}


@dataclass
class Tally:
    """What arrived where, in order (paho threads append under ``cond``)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    roam: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)

    def add(self, into: list[int], value: int) -> None:
        with self.cond:
            into.append(value)
            self.cond.notify_all()

    def wait_for(self, test: Callable[[], bool], deadline: float) -> bool:
        with self.cond:
            while not test():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True


def _client(client_id: str, clean: bool) -> Any:
    import paho.mqtt.client as mqtt

    # No automatic reconnection: the device goes where the scenario sends it, never back to a
    # site that dropped it (which would pull its session back).
    return mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=clean,
        protocol=mqtt.MQTTv311,
        reconnect_on_failure=False,
    )


class Device:
    """The roaming device: one paho client (its session state: QoS 2 messages awaiting
    PUBREL) carried from site to site."""

    def __init__(self, tally: Tally) -> None:
        self.client = _client(CLIENT_ID, clean=False)
        self.client.max_inflight_messages_set(100)
        self.tally = tally
        self._events: list[tuple[str, Any]] = []
        self._cond = threading.Condition()
        self.client.on_message = self._message
        self.client.on_connect = lambda _c, _u, flags, rc, _p: self._event(
            "connack", (rc.value, flags.session_present)
        )
        self.client.on_subscribe = lambda *_a: self._event("suback", None)
        self.client.on_disconnect = lambda *_a: self._event("gone", None)

    def _message(self, _c: Any, _u: Any, msg: Any) -> None:
        if msg.topic == PROBE:
            self.tally.add(self.tally.probes, 0)
        else:
            self.tally.add(self.tally.roam, int(msg.payload))

    def _event(self, kind: str, value: Any) -> None:
        with self._cond:
            self._events.append((kind, value))
            self._cond.notify_all()

    def _next(self, kinds: tuple[str, ...], deadline: float) -> tuple[str, Any] | None:
        with self._cond:
            while True:
                for i, (kind, value) in enumerate(self._events):
                    if kind in kinds:
                        del self._events[: i + 1]
                        return kind, value
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def arrive(self, site: Endpoint, deadline: float) -> int:
        """Connect to ``site`` until accepted (retrying refusals and failures); subscribe if
        the server has no session. Returns the number of attempts."""
        attempts = 0
        while True:
            attempts += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device could not connect to {site} ({attempts} tries)")
            with self._cond:
                self._events.clear()
            try:
                self.client.connect(site.host, site.port, keepalive=30)
            except OSError:
                time.sleep(0.2)  # the server is restarting: nothing to wait on but time
                continue
            self.client.loop_start()
            got = self._next(("connack", "gone"), min(deadline, time.monotonic() + 15.0))
            if got is not None and got[0] == "connack" and got[1][0] == 0:
                if not got[1][1]:
                    self.client.subscribe(f"{ROAM}/#", 2)
                    if self._next(("suback",), deadline) is None:
                        raise TimeoutError(f"no SUBACK from {site}")
                return attempts
            self.client.loop_stop()
            with contextlib.suppress(Exception):
                self.client.disconnect()
            time.sleep(0.2)  # refused (busy, moving): retry, as a device would

    def publish(self, topic: str, payload: bytes, deadline: float) -> None:
        info = self.client.publish(topic, payload, qos=2)
        info.wait_for_publish(max(0.1, deadline - time.monotonic()))

    def leave(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def dropped(self) -> None:
        """The site's server was killed under the device: stop paho's thread (it would
        reconnect to the dead site) before going on."""
        self._next(("gone",), time.monotonic() + 10.0)
        self.client.loop_stop()


@dataclass
class Outcome:
    moves: int = 0
    messages: int = 0
    lost: int = 0
    duplicated: int = 0
    violations: int = 0
    kills: int = 0
    connect_attempts: int = 0
    seconds: float = 0.0
    missing: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "moves": self.moves,
            "messages": self.messages,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "violations": self.violations,
            "kills": self.kills,
            "connect_attempts": self.connect_attempts,
            "seconds": round(self.seconds, 1),
            "missing_first": self.missing[:20],
        }


def out_of_order(arrivals: list[int]) -> int:
    """First arrivals of a value below one seen before (one publisher: its FIFO order)."""
    seen: set[int] = set()
    top = -1
    count = 0
    for value in arrivals:
        if value in seen:
            continue
        seen.add(value)
        if value < top:
            count += 1
        top = max(top, value)
    return count


def scenario(sites: Sites, args: argparse.Namespace) -> Outcome:
    tally = Tally()
    started = time.monotonic()
    watcher = _client("roam-watcher", clean=False)
    watcher.on_message = lambda _c, _u, m: tally.add(tally.moved, int(m.payload))
    watched = threading.Event()
    watcher.on_subscribe = lambda *_a: watched.set()
    watcher.on_connect = lambda c, *_a: c.subscribe(f"{MOVED}/#", 2)
    watcher.connect(sites.publisher.host, sites.publisher.port, keepalive=30)
    watcher.loop_start()
    publisher = _client("roam-publisher", clean=False)
    publisher.max_inflight_messages_set(20)
    publisher.connect(sites.publisher.host, sites.publisher.port, keepalive=30)
    publisher.loop_start()
    device = Device(tally)
    outcome = Outcome(moves=args.moves, messages=args.messages)
    restarts: list[threading.Thread] = []
    try:
        if not watched.wait(30.0):
            raise TimeoutError("the watcher got no SUBACK")
        sites.ready()
        # Before the publisher starts: the device's session (and subscription) exists, and is
        # in force where the publisher publishes (probes until one arrives).
        outcome.connect_attempts += device.arrive(sites.sites[0], time.monotonic() + 60.0)
        probe_deadline = time.monotonic() + 60.0
        while not tally.wait_for(lambda: bool(tally.probes), time.monotonic() + 0.2):
            if time.monotonic() > probe_deadline:
                raise TimeoutError("no probe reached the device in 60 s")
            publisher.publish(PROBE, b"probe", qos=2)
        pace = args.moves * args.dwell / args.messages

        def publish_all() -> None:
            next_at = time.monotonic()
            last = None
            for n in range(args.messages):
                last = publisher.publish(f"{ROAM}/{n % 10}", str(n).encode(), qos=2)
                next_at += pace
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing, not synchronisation
            if last is not None:
                last.wait_for_publish(120.0)

        pub_thread = threading.Thread(target=publish_all, name="roam-publisher", daemon=True)
        pub_thread.start()
        site = 0
        for move in range(args.moves):
            deadline = time.monotonic() + 120.0
            if move:
                outcome.connect_attempts += device.arrive(sites.sites[site], deadline)
            device.publish(f"{MOVED}/{move}", str(move).encode(), deadline)
            time.sleep(args.dwell)  # the device stays at the site: the scenario's pace
            if move == args.moves - 1:
                break
            if args.kill_every and move % args.kill_every == args.kill_every - 1:
                for t in restarts:
                    t.join()  # a site is killed again only once it is back
                restarts.clear()
                sites.kill(site)
                outcome.kills += 1
                device.dropped()
                t = threading.Thread(
                    target=sites.restart, args=(site,), name=f"roam-restart-{site}", daemon=True
                )
                t.start()
                restarts.append(t)
            else:
                device.leave()
            site = (site + 1) % len(sites.sites)
        pub_thread.join(300.0)
        # The device stays: everything still on its way arrives, or nothing for --quiet s.
        want = args.messages
        while True:
            before = len(tally.roam)
            done = tally.wait_for(
                lambda: len(set(tally.roam)) >= want and len(set(tally.moved)) >= args.moves,
                time.monotonic() + args.quiet,
            )
            if done or len(tally.roam) == before:
                break
        # Late duplicates of what is already there get a moment too.
        tally.wait_for(lambda: False, time.monotonic() + min(2.0, args.quiet))
        for t in restarts:
            t.join()
    finally:
        for client in (device.client, publisher, watcher):
            with contextlib.suppress(Exception):
                client.disconnect()
            client.loop_stop()
    with tally.cond:
        roam, moved = list(tally.roam), list(tally.moved)
    distinct = set(roam)
    outcome.lost = args.messages - len(distinct & set(range(args.messages)))
    outcome.missing = sorted(set(range(args.messages)) - distinct)
    outcome.duplicated = len(roam) - len(distinct)
    outcome.violations = out_of_order(roam) + out_of_order(moved)
    outcome.seconds = time.monotonic() - started
    return outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moves", type=int, default=30, help="sites the device visits in turn")
    parser.add_argument("--messages", type=int, default=3000, help="QoS 2 messages published")
    parser.add_argument("--dwell", type=float, default=1.0, help="seconds at each site")
    parser.add_argument(
        "--kill-every", type=int, default=3, help="SIGKILL the site left every N moves (0: never)"
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=20.0,
        help="at the end: seconds without arrivals",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated among {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--workdir", help="keep stores, configs and logs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _log(message: str) -> None:
    print(f"perf roam: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.moves < 1 or args.messages < 1 or args.dwell < 0 or args.kill_every < 0:
        raise SystemExit(
            "perf roam: error: --moves and --messages must be >= 1, --dwell and --kill-every >= 0"
        )
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(
            f"perf roam: error: unknown system(s) {unknown or args.systems!r}; "
            f"--systems takes a comma-separated list among: {', '.join(SYSTEMS)}"
        )
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with scratch(args.workdir) as work:
        # One system after the other (each has the machine to itself while it runs).
        for name in names:
            system = SYSTEMS[name]()
            reason = system.missing()
            if reason is not None:
                skipped[name] = reason
                _log(f"skipping {name}: {reason}")
                continue
            _log(f"{name}: {args.moves} moves, {args.messages} messages")
            with system.start(work / name) as sites:
                results[name] = scenario(sites, args).as_json()
            _log(f"{name}: {results[name]}")
    result = {"suite": "roam", "systems": results, "skipped": skipped}
    if not args.json:
        print(f"{'system':<20}{'moves':>6}{'messages':>9}{'lost':>7}{'dup':>7}{'viol':>6}")
        for name, r in results.items():
            print(
                f"{name:<20}{r['moves']:>6}{r['messages']:>9}{r['lost']:>7}"
                f"{r['duplicated']:>7}{r['violations']:>6}"
            )
    print(json.dumps(result))
    return 0
