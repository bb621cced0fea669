"""``python -m perf torture``: crash schedules judged by the independent checker, and wire fuzzing.

Each schedule (see ``aaabus/testing/torture.py``) runs the bank-and-gossip workload on a bus of
real server processes in several causality domains while servers and routers are SIGKILLed and
restarted at moments fixed by the schedule's seed; afterwards the money must be conserved and
the checker must find no loss, no duplicate and no causal violation. ``--fuzz-frames N`` adds a
wire-fuzzing run of N frames against a live server (half before authentication, half after).

The last line printed is one JSON object; the exit status is 1 if any schedule failed a judge or
any fuzzing frame crashed a server or broke its real traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aaabus.testing.torture import make_schedule, run_schedule, schedule_seed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument("--schedules", type=int, default=10, help="crash schedules to run")
    parser.add_argument("--seed", type=int, default=1, help="base seed: fixes every schedule")
    parser.add_argument("--kills", type=int, default=5, help="faults per schedule")
    parser.add_argument("--span", type=float, default=4.0, help="seconds the faults spread over")
    parser.add_argument("--ttl", type=int, default=40, help="length of each chain of transfers")
    parser.add_argument(
        "--minutes", type=float, default=0.0, help="stop starting schedules after this (0: none)"
    )
    parser.add_argument("--fuzz-frames", type=int, default=0, help="wire-fuzzing frames to send")
    parser.add_argument("--workdir", help="keep every schedule's stores and config here")
    parser.add_argument("--quiet", action="store_true", help="print only the JSON line")


def _log(quiet: bool) -> Any:
    def log(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    return log


def run(args: argparse.Namespace) -> int:
    log = _log(args.quiet)
    t0 = time.monotonic()
    totals: dict[str, Any] = {
        "schedules": 0,
        "kills": 0,
        "messages": 0,
        "lost": 0,
        "duplicated": 0,
        "misdelivered": 0,
        "causal_violations": 0,
        "fifo_violations": 0,
        "invariant_ok": True,
        "finished_in_process": 0,
        "failed_seeds": [],
        "base_seed": args.seed,
    }
    with tempfile.TemporaryDirectory(prefix="aaabus-torture-") as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        for index in range(args.schedules):
            if args.minutes and time.monotonic() - t0 > args.minutes * 60:
                log(f"time budget of {args.minutes} min reached after {index} schedules")
                break
            seed = schedule_seed(args.seed, index)
            schedule = make_schedule(seed, kills=args.kills, span=args.span, ttl=args.ttl)
            workdir = root / f"schedule-{index:04d}-{seed}"
            try:
                outcome = run_schedule(schedule, workdir, log=log)
            except Exception as exc:  # a server died or would not start: a failed schedule
                log(f"schedule seed={seed} FAILED: {type(exc).__name__}: {exc}")
                totals["schedules"] += 1
                totals["invariant_ok"] = False
                totals["failed_seeds"].append(seed)
                continue
            totals["schedules"] += 1
            for key in (
                "kills",
                "messages",
                "lost",
                "duplicated",
                "misdelivered",
                "causal_violations",
                "fifo_violations",
                "finished_in_process",
            ):
                totals[key] += getattr(outcome, key)
            totals["invariant_ok"] = totals["invariant_ok"] and outcome.invariant_ok
            if not outcome.ok:
                totals["failed_seeds"].append(seed)
        if args.fuzz_frames > 0:
            from aaabus.testing.torture import fuzz_live_server

            try:
                fuzz = fuzz_live_server(root / "fuzz", args.fuzz_frames, seed=args.seed, log=log)
            except Exception as exc:  # the fuzzer could not go on: the server stopped serving
                log(f"fuzzing FAILED: {type(exc).__name__}: {exc}")
                fuzz = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            totals["fuzz"] = fuzz
    totals["seconds"] = round(time.monotonic() - t0, 1)
    fuzz_ok = "fuzz" not in totals or totals["fuzz"]["ok"]
    ok = (
        not totals["failed_seeds"]
        and totals["invariant_ok"]
        and fuzz_ok
        and all(
            totals[k] == 0
            for k in ("lost", "duplicated", "misdelivered", "causal_violations", "fifo_violations")
        )
    )
    totals["ok"] = ok
    print(json.dumps(totals), flush=True)
    return 0 if ok else 1
