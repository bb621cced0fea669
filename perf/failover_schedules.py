"""``python -m perf failover --schedules N --seed S``: randomized fault schedules against the
failover, judged by the invariant checker (issue 42, point 5).

Each schedule is a fresh run of ``perf failover``'s bus and traffic (``perf/failover.py``) with
server 0 dialling server 1 through an :class:`~aaabus.testing.proxy.FaultProxy` (which connects
to whichever member of server 1 listens), and ``--faults`` faults drawn from the schedule's
seed, one after the other, each after a random stretch of traffic:

* ``kill``: the primary SIGKILLed, started again on its store after a random time;
* ``wipe``: the same, its store deleted;
* ``follower``: a follower SIGKILLed (its store deleted one time in two), started again;
* ``pause``: the primary SIGSTOPped, SIGCONTed after 0.5 to 4 s (on either side of the failover
  delay: sometimes a follower takes over meanwhile, and the woken primary must be fenced);
* ``cut``: the link between the servers cut both ways (connections closed and refused);
* ``cut_up``, ``cut_down``: one direction of that link stalled (server 0 to 1, or 1 to 0), then
  its connections closed.

After each fault the schedule waits until server 1 has one primary whose followers caught up
(the next fault would otherwise test a loss the design allows: more members down than it
survives). Throughout, every member's admin port is asked who is primary at which epoch: each
answer is an acceptance in the history. At the end the traffic stops and drains, and
:func:`aaabus.testing.failhistory.judge` checks: one primary per (server, epoch), no epoch going
back, nothing lost, nothing duplicated, causal order. A schedule is fixed by its seed (the
faults, their times, the traffic's choices); which messages a fault catches in flight is not.
"""

from __future__ import annotations

import argparse
import queue
import random
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.errors import AaabusError
from aaabus.testing.crash import schedule_seed
from aaabus.testing.failhistory import judge_history
from aaabus.testing.proxy import FaultProxy
from perf.failover import Live, Log, Recorder, _wait_events, finish, keep_evidence, live
from perf.failover_bus import FAILING, Layout
from perf.harness import scratch

KINDS = ("kill", "wipe", "follower", "pause", "cut", "cut_up", "cut_down")


@dataclass(frozen=True)
class Fault:
    """``kind`` (see the module's docstring) after ``after`` seconds of traffic, lasting
    ``hold`` seconds; ``pick`` chooses a follower, ``wipe`` whether a follower's store goes."""

    kind: str
    after: float
    hold: float
    pick: int
    wipe: bool


@dataclass(frozen=True)
class Schedule:
    seed: int
    faults: tuple[Fault, ...]


def make_schedule(seed: int, count: int) -> Schedule:
    rng = random.Random(seed)
    faults = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        long = kind in ("pause", "cut", "cut_up", "cut_down")
        faults.append(
            Fault(
                kind,
                after=round(rng.uniform(0.2, 2.0), 3),
                hold=round(rng.uniform(0.5, 4.0) if long else rng.uniform(0.0, 0.5), 3),
                pick=rng.randrange(2),
                wipe=rng.random() < 0.5,
            )
        )
    return Schedule(seed, tuple(faults))


def _observe(run: Live, seconds: float) -> None:
    """Let ``seconds`` pass asking the members who is primary every quarter second."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        run.primaries.ask()
        _wait_events(run.rec, min(0.25, max(0.0, until - time.monotonic())))


def apply(run: Live, proxy: FaultProxy, fault: Fault, primary: int) -> None:
    """Apply ``fault`` to a settled bus whose primary is member ``primary``; undo it."""
    procs = run.procs
    if fault.kind in ("kill", "wipe", "follower"):
        others = [m for m in range(run.layout.members) if m != primary]
        victim = primary if fault.kind != "follower" else others[fault.pick % len(others)]
        wipe = fault.kind == "wipe" or (fault.kind == "follower" and fault.wipe)
        procs.kill_and_wipe(victim, wipe)
        _observe(run, fault.hold)
        procs.members[victim].start()
    elif fault.kind == "pause":
        procs.pause(primary)
        _observe(run, fault.hold)
        procs.resume(primary)
    elif fault.kind == "cut":
        proxy.partition()
        _observe(run, fault.hold)
        proxy.heal()
    else:
        proxy.stall("up" if fault.kind == "cut_up" else "down")
        _observe(run, fault.hold)
        proxy.cut()  # what was held goes with its connections: no frame arrives cut in two
        proxy.resume()


def run_schedule(
    schedule: Schedule, work: Path, args: argparse.Namespace, log: Log
) -> dict[str, Any]:
    """One schedule in ``work``; its verdict as a JSON object."""
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    rec = Recorder(queue.SimpleQueue())
    outputs: deque[str] = deque(maxlen=20000)
    error = ""
    applied: list[str] = []
    proxy = FaultProxy(("127.0.0.1", 1), name=f"fo-{schedule.seed}", seed=schedule.seed)

    def aim(layout: Layout) -> None:
        port = layout.network[FAILING]
        proxy.target = (layout.hosts[0], port)
        proxy.alternates = tuple((host, port) for host in layout.hosts[1:])

    try:
        with live(args, work, deadline, rec, outputs, proxy.port, aim) as run:
            for fault in schedule.faults:
                primary = run.primaries.settled(run.procs, rec, args.lag, deadline)
                _observe(run, fault.after)
                apply(run, proxy, fault, primary)
                applied.append(fault.kind)
            run.primaries.settled(run.procs, rec, args.lag, deadline)
            run.traffic.quiesce()
            finish(run.traffic, rec, min(deadline, time.monotonic() + args.drain))
    except (TimeoutError, RuntimeError, OSError, AaabusError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        proxy.stop()
    rec.drain()
    verdict = judge_history(rec.history)
    problems = verdict.problems()
    if rec.sessions_lost:
        problems.append(f"MQTT sessions lost: {rec.sessions_lost[:5]}")
    if error:
        problems.append(error)
    ok = verdict.ok and not error and not rec.sessions_lost
    if not ok:
        keep_evidence(work, rec, outputs)
    outcome = {
        "seed": schedule.seed,
        "faults": applied,
        "messages": verdict.report.messages,
        "lost": len(verdict.report.lost),
        "duplicated": len(verdict.report.duplicated),
        "violations": verdict.violations,
        "split_brain": len(verdict.split_brain),
        "accepted": len(rec.history.accepted),
        "ok": ok,
        "problems": problems[:10],
        "seconds": round(time.monotonic() - t0, 1),
    }
    log(
        f"schedule seed={schedule.seed} faults={','.join(applied)} "
        + ("ok" if ok else f"FAILED: {'; '.join(problems[:3])}")
        + f" {outcome['seconds']}s"
    )
    return outcome


def run_schedules(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """``args.schedules`` schedules from base seed ``args.seed``; the totals as a JSON object."""
    t0 = time.monotonic()
    totals: dict[str, Any] = {
        "schedules": 0,
        "faults": 0,
        "messages": 0,
        "lost": 0,
        "duplicated": 0,
        "violations": 0,
        "split_brain": 0,
        "accepted": 0,
        "base_seed": args.seed,
        "failed_seeds": [],
        "problems": [],
    }
    with scratch(args.workdir) as root:
        for index in range(args.schedules):
            seed = schedule_seed(args.seed, index)
            work = root / f"schedule-{index:04d}-{seed}"
            work.mkdir(parents=True, exist_ok=True)
            outcome = run_schedule(make_schedule(seed, args.faults), work, args, log)
            totals["schedules"] += 1
            totals["faults"] += len(outcome["faults"])
            for key in ("messages", "lost", "duplicated", "violations", "split_brain", "accepted"):
                totals[key] += outcome[key]
            if outcome["ok"]:
                if not args.workdir:
                    shutil.rmtree(work, ignore_errors=True)
            else:
                totals["failed_seeds"].append(seed)
                totals["problems"].append({str(seed): outcome["problems"]})
    totals["seconds"] = round(time.monotonic() - t0, 1)
    totals["ok"] = not totals["failed_seeds"]
    return totals
