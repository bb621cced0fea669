"""``python -m perf edge``: the edge scenario, where brokers joined by bridges lose causal order.

Three sites A, B, C, on a line: one-way WAN delay D between neighbours (A-B, B-C) and 2D between
the ends (A-C), each link a :class:`~aaabus.testing.proxy.FaultProxy` with seeded jitter. In every
trial a site-A client publishes a question on topic ``q``; a site-B client publishes the answer on
topic ``a`` as soon as it reads the question; a site-C client subscribed to both counts a
**violation** when it reads the answer before the question (the answer causally follows it).

A system under test only provides three MQTT endpoints, one per site (:class:`EdgeSystem`); the
paho clients, the trials and the counting are the same for every system. Systems run side by side,
their trials interleaved (trial 1 on each system, then trial 2...), so a busy machine hurts them
alike: ``aaabus`` (:class:`AaabusSites`) and ``mosquitto_bridges``.

Threads: the main thread runs the trials; each paho client has its network thread, which records
arrivals under a condition the main thread waits on (with a deadline). Every broker and proxy
started is stopped on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aaabus.testing.proxy import FaultProxy
from perf.aaabus_mqtt import WanLink, mqtt_bus
from perf.brokers import Endpoint, find_binary, start_mosquitto, stop_group
from perf.harness import scratch
from perf.peers import PahoSession

QUESTION, ANSWER = "q", "a"
SITES = ("A", "B", "C")


@dataclass(frozen=True)
class Wan:
    """One-way delays of the links between the sites, in seconds."""

    delay: float
    jitter: float

    def link(self, a: str, b: str) -> float:
        """Sites on a line: neighbours are ``delay`` apart, the two ends twice as far."""
        return self.delay * abs(SITES.index(a) - SITES.index(b))


class EdgeSystem(Protocol):
    """What a system provides to the scenario: one MQTT endpoint per site, joined by WAN links
    with the delays of ``wan`` (each system builds its own links, through FaultProxy)."""

    name: str

    def sites(self, work: Path, wan: Wan) -> contextlib.AbstractContextManager[dict[str, Endpoint]]:
        """Start the system; yield ``{"A": endpoint, "B": ..., "C": ...}``; stop it on exit."""
        ...


class MosquittoBridges:
    """Three Mosquitto brokers, bridged the way an operator bridges topics between sites: each
    topic from the site that publishes it straight to each site that consumes it (``q``: A to B
    and A to C; ``a``: B to C), over the direct WAN link. This is loop-free (a Mosquitto bridge
    forwards whatever it subscribes to, so a mesh of ``#`` bridges would loop) and shortest:
    relaying the question to C through B would cost it a hop it does not need."""

    name = "mosquitto_bridges"
    BRIDGES = (("A", "B", QUESTION), ("A", "C", QUESTION), ("B", "C", ANSWER))

    @staticmethod
    def missing() -> str | None:
        if find_binary("mosquitto") is None:
            return "mosquitto is not installed (`make peers` installs it)"
        return None

    @contextlib.contextmanager
    def sites(self, work: Path, wan: Wan) -> Iterator[dict[str, Endpoint]]:
        procs: list[Any] = []
        proxies: list[FaultProxy] = []
        try:
            endpoints: dict[str, Endpoint] = {}
            # Consumers of bridges first: a bridge's target must exist to put a proxy before it.
            for site in reversed(SITES):
                conf = ""
                for src, dst, topic in self.BRIDGES:
                    if src != site:
                        continue
                    target = endpoints[dst]
                    proxy = FaultProxy(
                        (target.host, target.port), name=f"wan-{src}{dst}", seed=len(proxies)
                    )
                    proxies.append(proxy)
                    proxy.set_delay(wan.link(src, dst), jitter=wan.jitter)
                    conf += (
                        f"\nconnection edge-{src}-{dst}\n"
                        f"address 127.0.0.1:{proxy.port}\n"
                        f"topic {topic} out 1\n"
                        "bridge_protocol_version mqttv311\n"
                        "try_private true\n"
                        "cleansession true\n"
                        "notifications false\n"
                        "restart_timeout 1\n"
                    )
                endpoints[site] = start_mosquitto(
                    work, procs, window=100, name=f"site-{site}", extra_conf=conf
                )
            yield endpoints
        finally:
            for proc in reversed(procs):
                stop_group(proc)
            for proxy in proxies:
                proxy.stop()


class AaabusSites:
    """aaabus: each site a causality domain of three servers (A: 0-2, B: 3-5, C: 6-8), the sites
    joined by two-server router domains over the WAN links (2-3 for A-B, 5-6 for B-C, so A-C
    crosses both: 2D), each WAN link through a delaying proxy; one MQTT listener per site, on a
    server that is not a router (0, 4, 8). Topics relay along the domain tree; causal order is
    the topics' contract (docs/architecture.md), so the expected count of violations is 0."""

    name = "aaabus"
    LAYOUT = [[0, 1, 2], [2, 3], [3, 4, 5], [5, 6], [6, 7, 8]]
    LISTENERS = {"A": 0, "B": 4, "C": 8}

    @staticmethod
    def missing() -> str | None:
        return None

    @contextlib.contextmanager
    def sites(self, work: Path, wan: Wan) -> Iterator[dict[str, Endpoint]]:
        links = (
            WanLink(2, 3, wan.link("A", "B"), wan.jitter, seed=1),
            WanLink(5, 6, wan.link("B", "C"), wan.jitter, seed=2),
        )
        listeners = {server: 100 for server in self.LISTENERS.values()}
        with mqtt_bus(work, self.LAYOUT, listeners, links) as endpoints:
            yield {site: endpoints[server] for site, server in self.LISTENERS.items()}


#: The systems, by name.
SYSTEMS: dict[str, type[MosquittoBridges] | type[AaabusSites]] = {
    "aaabus": AaabusSites,
    "mosquitto_bridges": MosquittoBridges,
}


@dataclass
class Outcome:
    """How the trials of one system went, from site C's point of view."""

    violations: int = 0
    ordered: int = 0
    lost: int = 0
    #: Question published at A until the answer read at C, per ordered or violating trial (ms).
    round_ms: list[float] = field(default_factory=list)


def classify(arrivals: list[tuple[str, str]], trial: str) -> str:
    """``"violation"``, ``"ordered"`` or ``"lost"`` for ``trial``, from the ``(topic, trial)``
    pairs site C read, in the order it read them.

    Reading the answer without having read the question before it is a violation (also when the
    question never comes); both in causal order is ordered; no answer at all is lost.
    """
    seen = [topic for topic, t in arrivals if t == trial]
    if ANSWER not in seen:
        return "lost"
    if QUESTION in seen and seen.index(QUESTION) < seen.index(ANSWER):
        return "ordered"
    return "violation"


class _Site:
    """The three paho clients of one system: asker at A, answerer at B, observer at C."""

    def __init__(self, name: str, endpoints: dict[str, Endpoint]) -> None:
        self.arrivals: list[tuple[str, str]] = []
        self.cond = threading.Condition()
        tag = f"edge-{name}-{int(time.time() * 1000) % 10**8}"
        self.observer = PahoSession(
            endpoints["C"], f"{tag}-C", 1, subscribe="+", on_message=self._observe
        )
        self.answerer = PahoSession(
            endpoints["B"], f"{tag}-B", 1, subscribe=QUESTION, on_message=self._answer
        )
        self.asker = PahoSession(endpoints["A"], f"{tag}-A", 1)
        self.sessions = (self.observer, self.answerer, self.asker)

    def _observe(self, msg: Any) -> None:
        self.observer.client.ack(msg.mid, msg.qos)
        with self.cond:
            self.arrivals.append((msg.topic, msg.payload.decode()))
            self.cond.notify_all()

    def _answer(self, msg: Any) -> None:
        # Runs in B's paho thread: answer at once, then acknowledge the question.
        self.answerer.client.publish(ANSWER, msg.payload, qos=1)
        self.answerer.client.ack(msg.mid, msg.qos)

    def __enter__(self) -> _Site:
        try:
            for session in self.sessions:
                session.connect()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        for session in self.sessions:
            session.close()

    def trial(self, trial: str, timeout: float) -> tuple[str, float]:
        """Ask, wait until C has read the answer (or ``timeout``), classify."""
        t0 = time.monotonic()
        self.asker.client.publish(QUESTION, trial.encode(), qos=1)
        deadline = t0 + timeout
        with self.cond:
            while (ANSWER, trial) not in self.arrivals and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            t1 = time.monotonic()
            verdict = classify(self.arrivals, trial)
            # Late arrivals of this trial (a question after its answer) land in the next
            # trial's list, where classify() ignores them: they carry another trial's id.
            self.arrivals.clear()
        return verdict, (t1 - t0) * 1000.0

    def warm_up(self, deadline: float) -> None:
        """Until one trial goes through end to end: bridges connect in the background."""
        n = 0
        while self.trial(f"warmup-{n}", 2.0)[0] == "lost":
            n += 1
            if time.monotonic() > deadline:
                raise TimeoutError("no answer crossed the sites within the start deadline")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=200, help="questions asked per system")
    parser.add_argument(
        "--wan-ms", type=float, default=20.0, help="one-way delay between neighbouring sites"
    )
    parser.add_argument(
        "--jitter-ms",
        type=float,
        help="extra random delay per chunk, uniform in [0, J) (default: a quarter of --wan-ms)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, among: {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--workdir", help="keep broker data and logs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _log(message: str) -> None:
    print(f"perf edge: {message}", file=sys.stderr, flush=True)


def _chosen(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(
            f"perf edge: error: unknown system(s) {unknown or text!r}; "
            f"--systems takes a comma-separated list among: {', '.join(SYSTEMS)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    if args.trials < 1 or args.wan_ms < 0 or (args.jitter_ms or 0) < 0:
        raise SystemExit("perf edge: error: --trials must be >= 1, delays >= 0")
    names = _chosen(args.systems)
    jitter_ms = args.wan_ms / 4 if args.jitter_ms is None else args.jitter_ms
    wan = Wan(args.wan_ms / 1000.0, jitter_ms / 1000.0)
    # A trial lasts about 4 D; ten times that, and at least 10 s, before it counts as lost.
    timeout = max(10.0, 40 * (wan.delay + wan.jitter))
    outcomes: dict[str, Outcome] = {}
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(scratch(args.workdir))
        sites: dict[str, _Site] = {}
        for name in names:
            system = SYSTEMS[name]()
            reason = system.missing()
            if reason is None:
                try:
                    endpoints = stack.enter_context(system.sites(work / name, wan))
                    sites[name] = stack.enter_context(_Site(name, endpoints))
                    sites[name].warm_up(time.monotonic() + 60.0)
                except (OSError, RuntimeError, ImportError) as exc:
                    reason = f"could not start: {type(exc).__name__}: {exc}"
            if reason is not None:
                skipped[name] = reason
                _log(f"skipping {name}: {reason}")
                continue
            outcomes[name] = Outcome()
        for n in range(args.trials):
            for name, site in sites.items():
                if name not in outcomes:
                    continue
                verdict, ms = site.trial(f"trial-{n}", timeout)
                out = outcomes[name]
                if verdict == "lost":
                    out.lost += 1
                else:
                    out.violations += verdict == "violation"
                    out.ordered += verdict == "ordered"
                    out.round_ms.append(ms)
            if (n + 1) % 50 == 0:
                _log(f"{n + 1}/{args.trials} trials")
    result = {
        "suite": "edge",
        "trials": args.trials,
        "wan_ms": args.wan_ms,
        "jitter_ms": jitter_ms,
        "links_ms": {
            f"{a}-{b}": wan.link(a, b) * 1000 for a, b in (("A", "B"), ("B", "C"), ("A", "C"))
        },
        "violations": {
            name: outcomes[name].violations if name in outcomes else None for name in names
        },
        "ordered": {name: outcomes[name].ordered if name in outcomes else None for name in names},
        "lost": {name: outcomes[name].lost if name in outcomes else None for name in names},
        "question_to_answer_at_c_ms_p50": {
            name: statistics.median(o.round_ms) if o.round_ms else None
            for name, o in outcomes.items()
        },
        "skipped": skipped,
    }
    if not args.json:
        print(f"{'system':<20}{'trials':>8}{'violations':>12}{'lost':>6}{'p50 ms':>9}")
        for name in names:
            if name not in outcomes:
                print(f"{name:<20}  skipped: {skipped[name]}")
                continue
            o = outcomes[name]
            p50 = statistics.median(o.round_ms) if o.round_ms else float("nan")
            print(f"{name:<20}{args.trials:>8}{o.violations:>12}{o.lost:>6}{p50:>9.1f}")
    print(json.dumps(result))
    return 0
