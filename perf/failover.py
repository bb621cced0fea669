"""``python -m perf failover``: a primary SIGKILLed with its store deleted, again and again, under
traffic, judged by a checker that knows only what was sent and what was received (issue 42).

The bus (``perf/failover_bus.py``): servers 0 and 1 in one domain; server 1 has ``--replicas``
replicas (default 2), each member on its own loopback address. The traffic
(``perf/failover_load.py``), all of it recorded from outside the bus, every message carrying the
vector clock of the event that sent it:

* a **ping-pong across servers**: pings sent through server 0's admin port (a
  :class:`~aaabus.tools.client.Client`) to an agent on server 1, which publishes each pong for a
  device on server 0; one ping at a time;
* two **streams** of MQTT QoS 2 publications, one from a device on server 0 to a device on
  server 1, one the other way;
* **causal topic traffic**: three devices (one on server 0, two on server 1) publish and
  republish part of what they receive from each other, so that causal chains cross servers.

Then ``--failovers`` times in a row: wait until server 1 has one primary whose followers have
all caught up, SIGKILL the primary, delete its store directory, start it again at once (it must
rejoin as a follower: the other members have taken over), and time **from the kill to the first
delivery made by the new primary**: the first message a device of server 1 receives on a
connection it opened after the kill (devices find the new primary by trying each member's
address in turn; a follower refuses them).

At the end the publishers stop, every publication is waited for until acknowledged and
delivered (or ``--drain`` seconds), and :mod:`aaabus.testing.failhistory` judges the history:
``lost``, ``duplicated``, ``violations`` (causal or FIFO order broken, a message received by a
device it was not for, two members accepted as primary at one epoch, an epoch accepted after a
newer one). The primaries accepted are read from the admin answers of server 1's members.

``ok`` is true only for 0 lost, 0 duplicated, 0 violations, failover p50 <= 2000 ms and max <=
5000 ms, every failover done. ``--schedules N`` runs the randomized schedules instead
(``perf/failover_schedules.py``); ``--peers`` adds RabbitMQ quorum queues' leader kill in the
same run (``perf/safety.py``). One JSON line last; every process started is stopped by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.config.reader import BusConfig, load_config
from aaabus.errors import AaabusError
from aaabus.testing.failhistory import History, Verdict, judge_history
from perf.failover_bus import (
    FAILING,
    Layout,
    Processes,
    caught_up,
    epoch_of,
    probe,
    running,
    write_config,
)
from perf.failover_load import (
    CAUSAL,
    PONG,
    STREAM,
    Causal,
    Connected,
    Delivered,
    Device,
    Endpoints,
    Event,
    Pacer,
    Pinger,
    Sent,
)
from perf.harness import scratch

#: The acceptance bounds of issue 42.
P50_MS, MAX_MS = 2000.0, 5000.0
CAUSAL_DEVICES = (("c0", 0), ("c1", FAILING), ("c2", FAILING))

Log = Callable[[str], None]


class Recorder:
    """Turns the traffic's events into the :class:`History` (on the run's main thread only:
    the traffic's threads hand their events over through ``events``)."""

    def __init__(self, events: queue.SimpleQueue[Event]) -> None:
        self.events = events
        self.history = History()
        self.owed: set[str] = set()
        self.got: set[str] = set()
        self.probes: dict[str, set[str]] = {}
        self.pongs: set[str] = set()
        self.sessions_lost: list[str] = []
        self.connected: dict[str, int] = {}
        self.last_delivery = 0.0
        #: The kill being timed (monotonic) and the first delivery on a connection opened after.
        self.kill_at: float | None = None
        self.first: Delivered | None = None
        #: Every event with its time (and the kills), the evidence of a failed run.
        self.log: list[list[Any]] = []

    def drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self.log.append(_logged(event))
            if isinstance(event, Sent):
                self.history.send(event.mid, event.sender, event.dests, event.vc)
                self.owed.update(f"{event.mid}@{d}" for d in event.dests)
            elif isinstance(event, Delivered):
                self._delivered(event)
            elif isinstance(event, Connected):
                self._connected(event)

    def _delivered(self, event: Delivered) -> None:
        body = event.body
        sender = body.get("probe") or (
            "ponger" if body.get("ping", "").startswith("probe-") else ""
        )
        if sender:
            self.probes.setdefault(event.receiver, set()).add(sender)
            return
        self.history.deliver(event.receiver, body["mid"])
        self.got.add(f"{body['mid']}@{event.receiver}")
        self.last_delivery = event.at
        if "ping" in body and body["mid"] not in self.pongs:
            # A pong: the ponger's send, and its delivery of the ping, seen through it.
            self.pongs.add(body["mid"])
            self.history.send(body["mid"], "ponger", ("pinger",), body["vc"])
            self.owed.add(f"{body['mid']}@pinger")
            self.history.deliver("ponger", body["ping"])
            self.got.add(f"{body['ping']}@ponger")
        if (
            self.kill_at is not None
            and self.first is None
            and event.server == FAILING
            and event.since > self.kill_at
        ):
            self.first = event

    def _connected(self, event: Connected) -> None:
        if not event.session and event.device in self.connected:
            self.sessions_lost.append(f"{event.device} (member {event.member})")
        self.connected[event.device] = self.connected.get(event.device, 0) + 1

    def watch(self, kill_at: float) -> None:
        self.kill_at, self.first = kill_at, None
        self.log.append(["kill", round(kill_at, 4)])

    def missing(self) -> int:
        return len(self.owed - self.got)


def _logged(event: Event) -> list[Any]:
    """One line of a run's event log: kind, time, and what the event names."""
    if isinstance(event, Sent):
        return ["sent", round(event.at, 4), event.mid]
    if isinstance(event, Delivered):
        mid = event.body.get("mid", event.body.get("probe"))
        return ["got", round(event.at, 4), event.receiver, mid, event.member]
    return ["connected", round(event.at, 4), event.device, event.member, event.session]


class Traffic:
    """The devices, the pacers and the pinger of one run (see the module's docstring)."""

    def __init__(
        self, layout: Layout, cfg: BusConfig, events: queue.SimpleQueue[Event], args: Any
    ) -> None:
        where = {
            0: Endpoints(0, ("127.0.0.1",), layout.mqtt[0]),
            FAILING: Endpoints(FAILING, layout.hosts, layout.mqtt[FAILING]),
        }
        names = tuple(name for name, _ in CAUSAL_DEVICES)
        self.devices: dict[str, Device] = {
            "sa": Device("sa", where[0], (), events),
            "ra": Device("ra", where[FAILING], (f"{STREAM}/a",), events),
            "sb": Device("sb", where[FAILING], (), events),
            "rb": Device("rb", where[0], (f"{STREAM}/b",), events),
            "pinger": Device("pinger", where[0], (PONG,), events),
        }
        for n, (name, sid) in enumerate(CAUSAL_DEVICES):
            react = Causal(names, args.ttl, 0.5, args.seed * 10 + n)
            self.devices[name] = Device(name, where[sid], (f"{CAUSAL}/#",), events, react=react)
        self.pacers = [
            Pacer(self.devices["sa"], f"{STREAM}/a", ("ra",), args.rate),
            Pacer(self.devices["sb"], f"{STREAM}/b", ("rb",), args.rate),
            *(Pacer(self.devices[n], f"{CAUSAL}/{n}", names, args.causal_rate) for n in names),
        ]
        #: Who must have received a probe of whom before the run counts anything.
        self.wanted = {"ra": {"sa"}, "rb": {"sb"}, "pinger": {"ponger"}}
        self.wanted.update({n: set(names) for n in names})
        self.cfg = cfg
        self.pinger: Pinger | None = None

    def start(self, rec: Recorder, deadline: float) -> None:
        """Connect every device, deploy the ponger, probe every path until each is in force,
        then start the publishers and the pinger."""
        from aaabus.tools.client import Client
        from perf.agents.failover import Ponger

        for device in self.devices.values():
            device.start()
        client = Client(self.cfg, 0, timeout=30.0)
        ponger = client.deploy(Ponger("ponger", PONG), server=FAILING)
        self.pinger = Pinger(self.devices["pinger"], client, ponger)
        tries = 0
        while not all(rec.probes.get(r, set()) >= s for r, s in self.wanted.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"probes not all through: wanted {self.wanted}, {rec.probes}")
            tries += 1
            for pacer in self.pacers:
                if pacer.device.member >= 0:
                    pacer.device.probe(pacer.topic)
            self.pinger.send_probe(f"probe-{tries}")
            _wait_events(rec, 0.2)
        for pacer in self.pacers:
            pacer.start()
        self.pinger.start()

    def quiesce(self) -> None:
        """Stop making new messages (what is under way goes on)."""
        for pacer in self.pacers:
            pacer.stop()
        if self.pinger is not None and self.pinger.started:
            self.pinger.stop()

    def outstanding(self) -> int:
        return sum(device.backlog() for device in self.devices.values())

    def stop(self) -> None:
        self.quiesce()
        for device in self.devices.values():
            device.stop()


def _wait_events(rec: Recorder, seconds: float) -> None:
    """Drain events for ``seconds`` (the traffic's threads produce them: nothing to wait on but
    the queue, polled at 20 ms so that a kill's first delivery is timed to that)."""
    until = time.monotonic() + seconds
    while True:
        rec.drain()
        left = until - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.02, left))


def read_book(path: Path, server: int) -> tuple[int, int] | None:
    """``(epoch, member)`` that a server's epoch book (the JSON file ``epochs`` in its store
    directory, written atomically by the server) says it accepted for ``server``; None before
    the server knows of any takeover, or when the file is not in that form."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        epoch, member = data["servers"][str(server)]["known"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(epoch, int) and isinstance(member, int):
        return epoch, member
    return None


class Primaries:
    """Finds server 1's primary by asking every member's admin port; records each answer as a
    primary accepted (observer ``tool``) when it names an epoch."""

    def __init__(self, cfg: BusConfig, layout: Layout, history: History, book: Path) -> None:
        self.cfg = cfg
        self.layout = layout
        self.history = history
        self.book = book
        self.epochs: list[int] = []

    def ask(self) -> dict[int, Any]:
        """Every member's answer (the primary's status), and server 0's epoch book read, each
        recorded as an acceptance."""
        known = read_book(self.book, FAILING)
        if known is not None:
            self.history.accept(time.monotonic(), "s0", FAILING, *known)
        answers = {}
        for member in range(self.layout.members):
            status = probe(self.cfg, self.layout, member)
            if status is None:
                continue
            answers[member] = status
            epoch = epoch_of(status)
            if epoch is not None:
                self.history.accept(time.monotonic(), "tool", FAILING, epoch, member)
                if not self.epochs or self.epochs[-1] != epoch:
                    self.epochs.append(epoch)
        return answers

    def settled(self, procs: Processes, rec: Recorder, lag: int, deadline: float) -> int:
        """Wait until exactly one member answers as primary and every other member follows it
        (at most ``lag`` commits behind); its index."""
        while True:
            for proc in procs.all():
                if not proc.running():
                    tail = " | ".join(list(proc.lines)[-5:]) or "no output"
                    raise RuntimeError(f"{proc.name} died: {tail}")
            answers = self.ask()
            if len(answers) == 1:
                (member, status), *_ = answers.items()
                if caught_up(status, self.layout.members, lag):
                    return member
            if time.monotonic() > deadline:
                seen = {m: (epoch_of(s), s.get("replication")) for m, s in answers.items()}
                raise TimeoutError(f"server 1 never settled on one caught-up primary: {seen}")
            _wait_events(rec, 0.1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument("--failovers", type=int, default=20, help="primaries killed in a row")
    parser.add_argument("--replicas", type=int, default=2, help="server 1's replicas (1 or 2)")
    parser.add_argument("--rate", type=float, default=50.0, help="each stream's messages/s")
    parser.add_argument(
        "--causal-rate", type=float, default=3.0, help="new causal messages/s per causal device"
    )
    parser.add_argument("--ttl", type=int, default=3, help="hops of a causal chain")
    parser.add_argument(
        "--delay-ms", type=int, help="aaabus.failover.delay_ms (default: the product's)"
    )
    parser.add_argument(
        "--lag", type=int, default=50, help="commits a follower may lag before a kill"
    )
    parser.add_argument(
        "--between", type=float, default=2.0, help="seconds of traffic before each kill"
    )
    parser.add_argument("--drain", type=float, default=60.0, help="seconds to finish at the end")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="deadline of the whole run (seconds)"
    )
    parser.add_argument("--seed", type=int, default=1, help="fixes every random choice")
    parser.add_argument(
        "--schedules", type=int, default=0, help="run N randomized fault schedules instead"
    )
    parser.add_argument("--faults", type=int, default=4, help="with --schedules: faults each")
    parser.add_argument(
        "--peers", action="store_true", help="RabbitMQ quorum queues' leader kill, same run"
    )
    parser.add_argument("--workdir", help="keep stores, config and evidence here")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def run(args: argparse.Namespace) -> int:
    if args.replicas not in (1, 2):
        raise SystemExit(f"perf failover: error: --replicas takes 1 or 2, got {args.replicas}")
    if args.schedules < 0 or args.faults < 1 or args.rate <= 0 or args.causal_rate <= 0:
        raise SystemExit(
            "perf failover: error: --schedules must be >= 0, --faults >= 1, "
            "--rate and --causal-rate > 0"
        )
    log: Log = (lambda _line: None) if args.json else _stderr
    if args.schedules:
        from perf.failover_schedules import run_schedules

        result = run_schedules(args, log)
    else:
        result = run_failovers(args, log)
    if args.peers:
        theirs = _quorum_kill(args, log)
        result["rabbitmq_quorum"] = theirs
        if "failover_ms" in result:
            result["beside"] = beside(result, theirs)
    if not args.json:
        log(summary(result))
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def traffic_on(
    layout: Layout, events: queue.SimpleQueue[Event], args: Any, rec: Recorder, deadline: float
) -> Iterator[Traffic]:
    traffic = Traffic(layout, load_config(layout.config), events, args)
    try:
        traffic.start(rec, deadline)
        yield traffic
    finally:
        traffic.stop()


@dataclass
class Live:
    """A running run: its bus, its processes, its traffic and what it recorded so far."""

    work: Path
    layout: Layout
    procs: Processes
    rec: Recorder
    primaries: Primaries
    traffic: Traffic
    outputs: deque[str]


@contextlib.contextmanager
def live(
    args: argparse.Namespace,
    work: Path,
    deadline: float,
    rec: Recorder,
    outputs: deque[str],
    dial_proxy: int | None = None,
    on_layout: Callable[[Layout], None] | None = None,
) -> Iterator[Live]:
    """Write the config in ``work``, start every process and the traffic (``dial_proxy``:
    server 0 dials server 1 through that port; ``on_layout`` is called with the layout before
    any process starts); stop all of it on the way out."""
    props = {} if args.delay_ms is None else {"aaabus.failover.delay_ms": str(args.delay_ms)}
    layout = write_config(work, args.replicas, props, dial_proxy)
    if on_layout is not None:
        on_layout(layout)
    book = work / "store" / "s0" / "epochs"
    primaries = Primaries(load_config(layout.config), layout, rec.history, book)
    with (
        running(layout, work / "store", outputs.append) as procs,
        traffic_on(layout, rec.events, args, rec, deadline) as traffic,
    ):
        yield Live(work, layout, procs, rec, primaries, traffic, outputs)


def run_failovers(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """The benchmark; its JSON object."""
    if args.failovers < 1:
        raise SystemExit("perf failover: error: --failovers must be >= 1")
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    rec = Recorder(queue.SimpleQueue())
    took: list[float] = []
    members: list[int] = []
    epochs: list[int] = []
    rtts: list[float] = []
    error = ""
    outputs: deque[str] = deque(maxlen=20000)
    with scratch(args.workdir) as work:
        try:
            with live(args, work, deadline, rec, outputs) as run_:
                epochs = run_.primaries.epochs
                if run_.traffic.pinger is not None:
                    rtts = run_.traffic.pinger.rtts
                for n in range(args.failovers):
                    victim = run_.primaries.settled(run_.procs, rec, args.lag, deadline)
                    _wait_events(rec, args.between)  # traffic in flight at the kill
                    ms, member = kill_and_time(run_.procs, victim, rec, deadline)
                    took.append(ms)
                    members.append(member)
                    log(
                        f"failover {n + 1}: member {victim} killed and wiped; member "
                        f"{member} delivered after {ms:.0f} ms"
                    )
                # The last takeover's epoch is seen, and its followers caught up, before the end.
                run_.primaries.settled(run_.procs, rec, args.lag, deadline)
                run_.traffic.quiesce()
                finish(run_.traffic, rec, min(deadline, time.monotonic() + args.drain))
        except (TimeoutError, RuntimeError, OSError, AaabusError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            log(f"perf failover: stopped after {len(took)} failover(s): {error}")
        rec.drain()
        verdict = judge_history(rec.history)
        if (error or not verdict.ok) and args.workdir:
            keep_evidence(work, rec, outputs)
    result = result_of(args, verdict, rec, took, members, epochs, error, t0, outputs)
    ordered = sorted(rtts)
    result["pingpong_ms"] = {
        "rounds": len(ordered),
        "p50": round(statistics.median(ordered), 2) if ordered else None,
        "p99": round(ordered[int(0.99 * (len(ordered) - 1))], 2) if ordered else None,
    }
    result["deliveries_per_s"] = round(verdict.report.deliveries / max(1e-9, result["seconds"]))
    return result


def keep_evidence(work: Path, rec: Recorder, outputs: deque[str]) -> None:
    """The history and the servers' last lines, beside a failed run's stores."""
    (work / "history.json").write_text(json.dumps(rec.history.as_json()))
    (work / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in rec.log))
    (work / "servers.log").write_text("\n".join(outputs) + "\n")


def kill_and_time(
    procs: Processes, victim: int, rec: Recorder, deadline: float
) -> tuple[float, int]:
    """SIGKILL member ``victim``, delete its store, start it again; wait for the first delivery
    by the new primary. Its delay in ms from the kill, and the member that made it."""
    rec.drain()
    rec.watch(time.monotonic())
    procs.kill_and_wipe(victim)
    procs.members[victim].start()
    assert rec.kill_at is not None
    while rec.first is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no delivery by a new primary after member {victim} was killed")
        _wait_events(rec, 0.02)
    return round(1000 * (rec.first.at - rec.kill_at), 1), rec.first.member


def finish(traffic: Traffic, rec: Recorder, deadline: float) -> None:
    """Wait until every publication is acknowledged and every message owed is delivered (or the
    deadline), then a second more for late duplicates."""
    while time.monotonic() < deadline:
        _wait_events(rec, 0.1)
        if traffic.outstanding() == 0 and rec.missing() == 0:
            break
    _wait_events(rec, 1.0)


def result_of(
    args: argparse.Namespace,
    verdict: Verdict,
    rec: Recorder,
    took: list[float],
    members: list[int],
    epochs: list[int],
    error: str,
    t0: float,
    outputs: deque[str],
) -> dict[str, Any]:
    report = verdict.report
    p50 = round(statistics.median(took), 1) if took else None
    timing = {"p50": p50, "max": max(took) if took else None, "each": took}
    ok = (
        not error
        and len(took) == args.failovers
        and verdict.ok
        and not rec.sessions_lost
        and p50 is not None
        and p50 <= P50_MS
        and max(took) <= MAX_MS
    )
    problems = verdict.problems()
    if rec.sessions_lost:
        problems.append(f"MQTT sessions lost: {rec.sessions_lost[:5]}")
    if error:
        problems.append(error)
        problems += [line for line in outputs if "WARNING" in line or "ERROR" in line][-10:]
    return {
        "failovers": len(took),
        "messages": report.messages,
        "deliveries": report.deliveries,
        "lost": len(report.lost),
        "duplicated": len(report.duplicated),
        "violations": verdict.violations,
        "split_brain": len(verdict.split_brain),
        "failover_ms": timing,
        "new_primary_members": members,
        "epochs_seen": epochs,
        "sessions_lost": len(rec.sessions_lost),
        "replicas": args.replicas,
        "delay_ms": args.delay_ms,
        "seed": args.seed,
        "seconds": round(time.monotonic() - t0, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "ok": ok,
        "problems": problems[:20],
    }


def summary(result: dict[str, Any]) -> str:
    if "schedules" in result:
        return (
            f"{result['schedules']} schedules, {result['faults']} faults: lost {result['lost']}, "
            f"duplicated {result['duplicated']}, violations {result['violations']}; "
            + ("ok" if result["ok"] else f"FAILED {result['problems'][:3]}")
        )
    t = result["failover_ms"]
    return (
        f"{result['failovers']} failovers, {result['messages']} messages: lost {result['lost']}, "
        f"duplicated {result['duplicated']}, violations {result['violations']}; failover p50 "
        f"{t['p50']} ms, max {t['max']} ms; " + ("ok" if result["ok"] else "FAILED")
    )


def beside(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The two systems' kill, side by side: time to recover, lost, duplicated."""
    kill = theirs["kill"]
    return {
        "recover_ms": {"aaabus_p50": ours["failover_ms"]["p50"], "rabbitmq": kill["recover_ms"]},
        "lost": {"aaabus": ours["lost"], "rabbitmq": kill["lost"]},
        "duplicated": {"aaabus": ours["duplicated"], "rabbitmq": kill["duplicated"]},
        "nothing_lost_where_they_lose_nothing": kill["lost"] > 0 or ours["lost"] == 0,
    }


def _quorum_kill(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """RabbitMQ quorum queues beside it (``perf/safety.py``): the same run's figures."""
    import importlib.util

    from perf.safety import measure_quorum_cluster, quorum_defaults

    if importlib.util.find_spec("pika") is None:
        raise SystemExit(
            "perf failover: error: --peers needs pika in this environment; "
            "`make peers` installs it with RabbitMQ"
        )
    log("perf failover: RabbitMQ quorum queues on three nodes, the same ping-pong, stream, kill")
    theirs = measure_quorum_cluster(quorum_defaults(args.workdir))
    return theirs


__all__ = ["add_arguments", "run", "run_failovers"]
