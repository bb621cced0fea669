"""``python -m perf torture``: crash schedules judged by the independent checker, and wire fuzzing.

Each schedule runs a workload on a bus of real server processes in several causality domains
while servers and routers are SIGKILLed and restarted at moments fixed by the schedule's seed
(``aaabus/testing/crash.py``). Two workloads (``--workload``):

* ``bank`` (default, ``aaabus/testing/torture.py``): transfers between accounts on every server;
  afterwards the money must be conserved and the checker must find no loss, no duplicate and no
  causal violation among the credits;
* ``topics`` (``aaabus/testing/topictorture.py``): publishers and subscribers on every server
  with overlapping wildcard filters, republishing part of what they receive; the checker judges
  every subscription: no owed publication lost, none duplicated, no causal violation.

``--fuzz-frames N`` adds a wire-fuzzing run of N frames against a live server (half before
authentication, half after).

The last line printed is one JSON object (``--json``: the only one); the exit status is 1 if any
schedule failed a judge or any fuzzing frame crashed a server or broke its real traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.testing.crash import schedule_seed
from aaabus.testing.topictorture import make_topic_schedule, run_topic_schedule
from aaabus.testing.torture import make_schedule, run_schedule

Log = Callable[[str], None]

#: The verdict counts: every one must be 0 for a run to pass.
PROBLEM_COUNTS = ("lost", "duplicated", "misdelivered", "causal_violations", "fifo_violations")


@dataclass(frozen=True)
class Workload:
    """How to run one schedule of a workload, and which of its outcome's counts to add up."""

    run: Callable[[int, Path, argparse.Namespace, Log], Any]
    counts: tuple[str, ...]
    default_ttl: int


def _bank(seed: int, workdir: Path, args: argparse.Namespace, log: Log) -> Any:
    schedule = make_schedule(seed, kills=args.kills, span=args.span, ttl=args.ttl)
    return run_schedule(schedule, workdir, log=log)


def _topics(seed: int, workdir: Path, args: argparse.Namespace, log: Log) -> Any:
    schedule = make_topic_schedule(seed, kills=args.kills, span=args.span, ttl=args.ttl)
    return run_topic_schedule(schedule, workdir, log=log)


WORKLOADS = {
    "bank": Workload(_bank, ("kills", "router_kills", "messages", "finished_in_process"), 40),
    "topics": Workload(
        _topics,
        (
            "kills",
            "router_kills",
            "starts",
            "publications",
            "owed",
            "deliveries",
            "finished_in_process",
        ),
        8,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="bank")
    parser.add_argument("--schedules", type=int, default=10, help="crash schedules to run")
    parser.add_argument("--seed", type=int, default=1, help="base seed: fixes every schedule")
    parser.add_argument("--kills", type=int, default=5, help="faults per schedule")
    parser.add_argument("--span", type=float, default=4.0, help="seconds the faults spread over")
    parser.add_argument(
        "--ttl", type=int, help="length of causal chains (default: bank 40 transfers, topics 8)"
    )
    parser.add_argument(
        "--minutes", type=float, default=0.0, help="stop starting schedules after this (0: none)"
    )
    parser.add_argument("--fuzz-frames", type=int, default=0, help="wire-fuzzing frames to send")
    parser.add_argument("--workdir", help="keep every schedule's stores and config here")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--quiet", action="store_true", help="the same as --json")


def _log(quiet: bool) -> Log:
    def log(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return log


def run(args: argparse.Namespace) -> int:
    quiet = args.json or args.quiet
    log = _log(quiet)
    workload = WORKLOADS[args.workload]
    if args.ttl is None:
        args.ttl = workload.default_ttl
    t0 = time.monotonic()
    totals: dict[str, Any] = {"workload": args.workload, "schedules": 0}
    totals.update({key: 0 for key in (*workload.counts, *PROBLEM_COUNTS)})
    # Why each failed schedule failed, in the JSON line too: with --json/--quiet nothing else
    # would say it, and a schedule that fails once under load may pass when run again alone.
    totals.update({"failed_seeds": [], "failures": {}, "base_seed": args.seed})
    if args.workload == "bank":
        totals["invariant_ok"] = True
    with tempfile.TemporaryDirectory(prefix="aaabus-torture-") as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        for index in range(args.schedules):
            if args.minutes and time.monotonic() - t0 > args.minutes * 60:
                log(f"time budget of {args.minutes} min reached after {index} schedules")
                break
            seed = schedule_seed(args.seed, index)
            workdir = root / f"schedule-{index:04d}-{seed}"
            totals["schedules"] += 1
            try:
                outcome = workload.run(seed, workdir, args, log)
            except Exception as exc:  # a server died or would not start: a failed schedule
                log(f"schedule seed={seed} FAILED: {type(exc).__name__}: {exc}")
                totals["failed_seeds"].append(seed)
                totals["failures"][str(seed)] = [f"{type(exc).__name__}: {exc}"]
                continue
            for key in (*workload.counts, *PROBLEM_COUNTS):
                totals[key] += getattr(outcome, key)
            if "invariant_ok" in totals:
                totals["invariant_ok"] = totals["invariant_ok"] and outcome.invariant_ok
            if not outcome.ok:
                totals["failed_seeds"].append(seed)
                totals["failures"][str(seed)] = list(outcome.problems)
        if args.fuzz_frames > 0:
            from aaabus.testing.fuzz import fuzz_live_server

            try:
                fuzz = fuzz_live_server(root / "fuzz", args.fuzz_frames, seed=args.seed, log=log)
            except Exception as exc:  # the fuzzer could not go on: the server stopped serving
                log(f"fuzzing FAILED: {type(exc).__name__}: {exc}")
                fuzz = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            totals["fuzz"] = fuzz
    totals["seconds"] = round(time.monotonic() - t0, 1)
    fuzz_ok = "fuzz" not in totals or totals["fuzz"]["ok"]
    totals["ok"] = (
        not totals["failed_seeds"]
        and totals.get("invariant_ok", True)
        and fuzz_ok
        and all(totals[k] == 0 for k in PROBLEM_COUNTS)
    )
    if not quiet:
        print(_summary(totals))
    print(json.dumps(totals), flush=True)
    return 0 if totals["ok"] else 1


def _summary(totals: dict[str, Any]) -> str:
    if totals["workload"] == "topics":
        traffic = (
            f"{totals['publications']} publications, {totals['deliveries']} deliveries "
            f"({totals['owed']} owed)"
        )
    else:
        traffic = f"{totals['messages']} credits"
    return (
        f"{totals['workload']}: {totals['schedules']} schedules, {traffic}, "
        f"{totals['kills']} kills ({totals['router_kills']} of routers); "
        f"lost {totals['lost']}, duplicated {totals['duplicated']}, "
        f"causal violations {totals['causal_violations']}, "
        f"misdelivered {totals['misdelivered']}, fifo violations {totals['fifo_violations']}; "
        f"{totals['seconds']} s; "
        + ("ok" if totals["ok"] else f"FAILED, seeds {totals['failed_seeds']}")
    )
