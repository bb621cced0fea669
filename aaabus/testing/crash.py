"""Crash schedules, whatever the workload: layouts, seeded faults, a bus of real processes run
through them, and the end of the run read back exactly in-process.

Shared by the bank workload (:mod:`aaabus.testing.torture`) and the topic workload
(:mod:`aaabus.testing.topictorture`). One schedule is a layout of domains (every one with
routers) and a list of :class:`Fault` fixed by a seed; a workload adds its agents and its judge.

The steps a workload reuses, in order:

1. :func:`write_bus_config`: the ``a3.xml`` of a layout, on free ports;
2. :func:`run_under_faults`: start the server processes, let the workload start its traffic
   (``Traffic.begin``), apply the faults (SIGKILL, restart; ``Traffic.tick`` runs between them
   on the same thread, so it never races a kill), then stop every process with one SIGTERM;
3. :func:`drain_in_process`: reopen the stores with in-process servers on the same files and
   ports and poll their committed state until the workload says it is complete. An engine
   answers :meth:`~aaabus.AgentServer.call` only with committed state, so what is read is
   exactly what the bus committed, not what a killed reaction wrote before its commit was lost.

Everything here runs on the caller's thread; the servers' work runs in their processes (steps 1
and 2) or on the in-process servers' threads (step 3). A server that dies on its own, or does
not come back ready within a minute, raises :class:`AssertionError` or
:class:`~aaabus.errors.LaunchError` out of :func:`run_under_faults`, after every process was
stopped.

Also here, for the workloads that play a rally (:mod:`aaabus.testing.workload`'s bouncers: the
fuzzer, the fault tests): :func:`wait_progress` on the count the rally publishes in a file.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aaabus.config.reader import load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.checker import Report
from aaabus.tools.launch import Bus, ServerProcess, free_port_base

__all__ = [
    "LAYOUTS",
    "CrashOutcome",
    "Fault",
    "Faulted",
    "OnLayout",
    "Traffic",
    "drain_in_process",
    "draw_layout_and_faults",
    "read_progress",
    "routers_of",
    "run_faults",
    "run_under_faults",
    "schedule_seed",
    "servers_of",
    "stop_all",
    "wait_progress",
    "write_bus_config",
]

T = TypeVar("T")

#: Domain layouts (members of D0, D1, ...): every one has routers, some have two in a row.
LAYOUTS: dict[str, list[list[int]]] = {
    # D0 [s0 s1]  D1 [s1 s2 s3]  D2 [s3 s4]: a line, two routers (s1, s3).
    "line": [[0, 1], [1, 2, 3], [3, 4]],
    # s2 joins three domains: a star whose hub is a router.
    "star": [[0, 1, 2], [2, 3], [2, 4, 5]],
    # a tree of four domains: routers s1 and s3, s3 in three domains.
    "tree": [[0, 1], [1, 2, 3], [3, 4], [3, 5]],
}


def servers_of(domains: list[list[int]]) -> list[int]:
    return sorted({s for members in domains for s in members})


def routers_of(domains: list[list[int]]) -> list[int]:
    """The servers in more than one domain."""
    return sorted(s for s in servers_of(domains) if sum(s in m for m in domains) > 1)


class OnLayout:
    """What a schedule knows of its layout, from its ``layout`` name (a key of
    :data:`LAYOUTS`): shared by the schedules of every workload."""

    layout: str

    @property
    def domains(self) -> list[list[int]]:
        return LAYOUTS[self.layout]

    @property
    def servers(self) -> list[int]:
        return servers_of(self.domains)

    @property
    def routers(self) -> list[int]:
        return routers_of(self.domains)


@dataclass(frozen=True)
class Fault:
    """At ``at`` seconds into the run, SIGKILL ``victims``; restart them ``down`` seconds later.

    ``ready`` says whether to wait for the restarted servers to be ready before the next fault:
    when false, the next fault may hit a server while it is still recovering.
    """

    at: float
    victims: tuple[int, ...]
    down: float
    ready: bool


def draw_layout_and_faults(
    rng: random.Random, kills: int, span: float
) -> tuple[str, tuple[Fault, ...]]:
    """A layout and ``kills`` faults within ``span`` s, drawn from ``rng``.

    The first fault always hits a router and at least one fault in three takes two servers down
    together (a router and a random other one), so every schedule crashes routers in the middle
    of re-stamping traffic for the next domain.
    """
    layout = sorted(LAYOUTS)[rng.randrange(len(LAYOUTS))]
    domains = LAYOUTS[layout]
    servers = servers_of(domains)
    routers = routers_of(domains)
    times = sorted(rng.uniform(0.1, span) for _ in range(kills))
    faults = []
    for i, at in enumerate(times):
        if i == 0 or rng.random() < 0.3:
            first = rng.choice(routers)
            victims = {first}
            if i > 0 or rng.random() < 0.5:
                victims.add(rng.choice(servers))
        else:
            victims = {rng.choice(servers)}
        faults.append(
            Fault(
                at=round(at, 3),
                victims=tuple(sorted(victims)),
                down=round(rng.uniform(0.0, 0.4), 3),
                ready=rng.random() < 0.7,
            )
        )
    return layout, tuple(faults)


def schedule_seed(base: int, index: int) -> int:
    """The seed of the ``index``-th schedule of a run started with ``base``."""
    return random.Random(f"{base}/{index}").randrange(1 << 31)


def write_bus_config(
    directory: Path,
    domains: list[list[int]],
    properties: dict[str, str],
    service: tuple[int, str] | None = None,
) -> Path:
    """The a3.xml of ``domains`` in ``directory``, on free ports, with a bus key beside it.

    ``service``: ``(server, xml)``, a ``<service .../>`` element added to that server.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ports = sum(len(m) for m in domains)
    servers = len(servers_of(domains))
    text = render(domains, servers, base_port=free_port_base(ports), properties=properties)
    if service is not None:
        sid, element = service
        start = text.index(f'<server id="{sid}"')
        end = text.index("</server>", start)
        text = text[:end] + "  " + element + "\n  " + text[end:]
    path = directory / "a3.xml"
    path.write_text(text)
    ensure_secret(directory / "bus.key")
    return path


def pause(seconds: float) -> None:
    """Wait out a fault schedule's own timing (when to kill, how long a server stays down): the
    delay IS the fault, nothing is being synchronised on."""
    if seconds > 0:
        threading.Event().wait(seconds)


def check_alive(bus: Bus, down: set[int]) -> None:
    """AssertionError naming the first server not in ``down`` that is not running."""
    for sid, proc in bus.servers.items():
        if sid not in down and not proc.running():
            tail = " | ".join(list(proc.lines)[-5:]) or "no output"
            raise AssertionError(f"server {sid} died on its own during the schedule: {tail}")


def stop_all(
    bus: Bus, timeout: float = 20.0, evidence: dict[int, list[str]] | None = None
) -> dict[int, int | None]:
    """SIGTERM every server once and wait for each; the exit statuses. With ``evidence``, the
    thread stacks and last output of each server that did not stop go there (by server id).

    Not :meth:`Bus.stop`: it signals every process a second time from ``ServerProcess.stop``,
    and a second SIGTERM that lands while a server's interpreter is finalising (its handler
    already reset to the default) kills a server that had stopped cleanly, reporting -15.
    """
    for proc in bus.servers.values():
        if proc.running():
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    for sid, proc in bus.servers.items():
        assert proc.proc is not None
        try:
            codes[sid] = proc.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[sid] = None  # did not stop: bus.stop() below kills it
            if evidence is not None:
                evidence[sid] = _stacks_of(proc)
    bus.stop()
    return codes


def _stacks_of(proc: ServerProcess) -> list[str]:
    """The stack of every thread of a server that does not stop (``aaabus-server`` prints them
    on SIGUSR1) and its last output lines before them: where it is stuck."""
    seen = len(proc.lines)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGUSR1)
    # The dump is relayed line by line and has no end marker: it is over once lines have
    # stopped coming for a while (or at the deadline).
    deadline = time.monotonic() + 5.0
    count, quiet_since = seen, time.monotonic()
    while time.monotonic() < deadline and (count == seen or time.monotonic() - quiet_since < 0.3):
        pause(0.05)
        if len(proc.lines) != count:
            count, quiet_since = len(proc.lines), time.monotonic()
    return list(proc.lines)[max(0, seen - 40) :]


class Traffic(Protocol):
    """What a workload does on the live bus, on the thread that applies the faults.

    ``begin`` runs once every server is ready, before the first fault; ``tick`` runs every
    ``interval`` seconds while the faults are applied (also while servers are down: it must use
    only those that :meth:`~aaabus.tools.launch.ServerProcess.is_ready` says are ready).
    """

    interval: float

    def begin(self, bus: Bus) -> None: ...

    def tick(self, bus: Bus) -> None: ...


def _wait(bus: Bus, until: float, traffic: Traffic | None) -> None:
    """Until ``until`` (monotonic), ticking ``traffic`` every ``traffic.interval`` seconds."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return
        if traffic is None:
            pause(left)
            return
        traffic.tick(bus)
        pause(min(traffic.interval, until - time.monotonic()))


def run_faults(
    bus: Bus, faults: tuple[Fault, ...], t0: float, traffic: Traffic | None = None
) -> list[int]:
    """Apply ``faults`` to a running bus (their times count from ``t0``, monotonic); returns
    the servers killed, one entry per kill."""
    killed: list[int] = []
    for fault in faults:
        _wait(bus, t0 + fault.at, traffic)
        check_alive(bus, set())
        for sid in fault.victims:
            bus[sid].kill()
            killed.append(sid)
        _wait(bus, time.monotonic() + fault.down, traffic)
        for sid in fault.victims:
            bus[sid].start()
        if fault.ready:
            for sid in fault.victims:
                bus[sid].wait_ready(60)
    for proc in bus.servers.values():
        proc.wait_ready(60)
    return killed


@dataclass
class Faulted:
    """What :func:`run_under_faults` did: the servers killed (one entry per kill) and the exit
    status of every server at the final SIGTERM (``None``: it had to be killed)."""

    killed: list[int] = field(default_factory=list)
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    #: The thread stacks and last output of each server that did not stop (see stop_all).
    stuck: dict[int, list[str]] = field(default_factory=dict)
    #: Lines in which a server named a store older than its peers remember
    #: (:meth:`aaabus.core.channel.Channel.compare_state`), under the faults or in the drain
    #: that follows (:func:`drain_in_process`): no store is lost in these schedules (a kill
    #: keeps what was committed), so each is a false alarm or a lost commit.
    diverged: list[str] = field(default_factory=list)

    def hear(self, line: str) -> None:
        """A server's output line (a process's reader thread, or an in-process server's thread
        that logged it): kept if it names a store older."""
        if "store is older than" in line:
            self.diverged.append(line)

    def bad_exits(self) -> dict[int, int | None]:
        return {sid: code for sid, code in self.exit_codes.items() if code != 0}


@dataclass
class CrashOutcome:
    """What one crash schedule did and what the independent checker said, whatever the
    workload; each workload's outcome adds its own figures and judges
    (:class:`~aaabus.testing.torture.Outcome`, :class:`~aaabus.testing.topictorture.TopicOutcome`).
    """

    seed: int
    layout: str
    kills: int = 0
    router_kills: int = 0
    delivered_at_stop: int = 0
    finished_in_process: int = 0
    lost: int = 0
    duplicated: int = 0
    misdelivered: int = 0
    causal_violations: int = 0
    fifo_violations: int = 0
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def took(self, faulted: Faulted, routers: list[int], workdir: Path) -> None:
        """Note what the faults did: the kills (those of ``routers`` apart), the exit codes, and
        as a problem each server that did not exit 0 on SIGTERM (its stacks in ``workdir``)."""
        self.exit_codes = faulted.exit_codes
        self.kills = len(faulted.killed)
        self.router_kills = sum(sid in routers for sid in faulted.killed)
        if faulted.bad_exits():
            stuck = stuck_note(faulted, workdir)
            self.problems.append(f"servers did not exit 0 on SIGTERM: {faulted.bad_exits()}{stuck}")
        if faulted.diverged:
            self.problems.append(
                f"{len(faulted.diverged)} line(s) named a store older than its peers remember, "
                f"though none was lost: {faulted.diverged[0]}"
            )

    def checked(self, report: Report, whose: str = "") -> None:
        """Add the checker's findings in ``report`` (one of the run, or one of each subscriber,
        ``whose`` then naming it in the problem)."""
        self.lost += len(report.lost)
        self.duplicated += len(report.duplicated)
        self.misdelivered += len(report.misdelivered)
        self.causal_violations += len(report.causal_violations)
        self.fifo_violations += len(report.fifo_violations)
        if not report.ok:
            self.problems.append(f"checker{whose}: {report.summary()}")


def stuck_note(faulted: Faulted, workdir: Path) -> str:
    """Write the evidence of each server that did not stop to ``workdir/stuck-s<id>.txt``;
    the words naming those files (empty when there is none)."""
    paths = []
    for sid, lines in sorted(faulted.stuck.items()):
        path = workdir / f"stuck-s{sid}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(str(path))
    return f" (thread stacks: {', '.join(paths)})" if paths else ""


def run_under_faults(
    config: Path,
    servers: list[int],
    storage: Path,
    faults: tuple[Fault, ...],
    traffic: Traffic | None = None,
) -> Faulted:
    """Start ``servers`` of ``config`` (stores under ``storage``), begin ``traffic``, apply
    ``faults`` from then on, and stop every process with one SIGTERM, also on error."""
    done = Faulted()
    bus = Bus(config, servers, storage, sink=done.hear)
    try:
        bus.start(timeout=60)
        if traffic is not None:
            traffic.begin(bus)
        done.killed = run_faults(bus, faults, time.monotonic(), traffic)
        check_alive(bus, set())
    finally:
        done.exit_codes = stop_all(bus, evidence=done.stuck)
    return done


def drain_in_process(
    config: Path,
    storage_root: Path,
    read: Callable[[InProcessBus], T],
    complete: Callable[[T], bool],
    timeout: float,
    hear: Callable[[str], None] | None = None,
) -> tuple[T, T]:
    """Resume the stopped bus in this process until ``complete(read(bus))`` or ``timeout``.

    Returns the first state read (what the processes had committed when they stopped) and the
    last one. Stops at the deadline even if the workload is incomplete: its judge says what is
    missing. ``hear``: called with each line the servers' channels log meanwhile (on the
    thread that logs it), as :meth:`Faulted.hear` is with a process's output.
    """
    cfg = load_config(config)
    # The store kind the server processes used (the config's, else the default).
    kind = cfg.setting(min(cfg.servers), "aaabus.store")
    # The channel's logger, heard whatever the root logger's level: a line naming a store
    # older than its peers remember must fail the schedule in this phase too.
    channel_log = logging.getLogger("aaabus.channel")
    handler = _Hearing(hear) if hear is not None else None
    if handler is not None:
        channel_log.addHandler(handler)
    try:
        with InProcessBus(cfg, store_kind=kind, storage_root=storage_root) as bus:
            deadline = time.monotonic() + timeout
            first = state = read(bus)
            while not complete(state) and time.monotonic() < deadline:
                pause(0.05)  # the traffic runs on the servers' threads: poll its committed state
                state = read(bus)
            return first, state
    finally:
        if handler is not None:
            channel_log.removeHandler(handler)


class _Hearing(logging.Handler):
    """Hands each record's message to ``hear`` (on the thread that logs it)."""

    def __init__(self, hear: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self._hear = hear

    def emit(self, record: logging.LogRecord) -> None:
        self._hear(record.getMessage())


# -- a rally's progress, published by its agents in a file -----------------------------------


def read_progress(path: Path) -> dict[str, int]:
    """The count and errors a rally last published in ``path`` (zeros before its first)."""
    try:
        data: dict[str, int] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"count": 0, "errors": 0}
    return data


def wait_progress(
    path: Path, at_least: int, procs: list[ServerProcess], timeout: float = 30.0
) -> dict[str, int]:
    """Wait until the rally's published count reaches ``at_least``; fail fast if a server died."""
    deadline = time.monotonic() + timeout
    while True:
        got = read_progress(path)
        if got["count"] >= at_least:
            return got
        for proc in procs:
            if not proc.running():
                tail = " | ".join(list(proc.lines)[-5:])
                raise AssertionError(f"server {proc.server_id} died: {tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"rally stuck at {got} (wanted {at_least}) after {timeout}s")
        pause(0.02)  # the file is written by another process: poll it
