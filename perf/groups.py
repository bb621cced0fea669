"""``python -m perf groups``: a workload with structure, run on flat, star, tree and the planned
domains, with real server processes.

The servers are dealt into ``--groups`` groups (a seeded shuffle: group mates do not have
neighbouring ids, so the generated layouts, which cut ids in runs, know nothing of the groups).
Every server runs a talker (:mod:`perf.agents.groups`): a closed loop of hello/answer exchanges
with a peer drawn inside its group with probability ``--inside``, else outside.

1. **Observe.** The workload runs briefly on a flat bus with the traffic recorder on
   (``aaabus.traffic``), as a production bus would before it is planned.
2. **Plan.** ``aaabus plan`` (Spark, ``--master``) turns those traffic traces into domains of at
   most ``--max-domain-size`` members and predicts the cost per notification of the plan and of
   the generated layouts of the same servers.
3. **Measure.** The workload runs on every layout of ``--layouts`` (``planned`` first: its ports
   were chosen free just before), each a fresh bus of real processes with hop tracing on
   (``aaabus.trace``): one-way latency of every notification (p50, p99, mean, inside and across
   groups) and the clock bytes per notification (stamp bytes on every hop plus the clock bytes
   each commit persisted, over the end-to-end notifications of the measured part).

The table compares measured and predicted costs; the last line is one JSON object with at least
``{"layouts": {name: {"latency_ms": {"p50", "p99", "mean"}, "clock_bytes_per_note"}},
"predicted": {name: ms}, "ranking": {"measured", "predicted", "agree"}, "planned_vs_best"}``.
Everything runs on the main thread; every bus is stopped on exit, also on failure.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from aaabus.config.secret import ensure_secret
from aaabus.config.topology import generate
from aaabus.core.trace import read_hops
from aaabus.tools.launch import Bus, free_port_base
from perf.harness import REPO_ROOT, cpu_seconds, scratch, wait_for_file, with_services

#: Layouts the suite knows: the generated ones and the plan.
LAYOUTS = ("planned", "flat", "star", "tree", "bus")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=int, default=60, help="servers (default 60)")
    parser.add_argument("--groups", type=int, default=6, help="groups of servers (default 6)")
    parser.add_argument(
        "--inside", type=float, default=0.9, help="share of exchanges inside a group (0.9)"
    )
    parser.add_argument("--count", type=int, default=60, help="measured exchanges per talker")
    parser.add_argument(
        "--active",
        type=int,
        default=None,
        help="talkers that drive exchanges, spread over the groups (default: one per group; 0: "
        "every server); the others only answer",
    )
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured exchanges first")
    parser.add_argument(
        "--observe",
        type=int,
        default=20,
        help="exchanges per talker in the observation run (0: no observation, no plan)",
    )
    parser.add_argument(
        "--max-domain-size", type=int, default=12, metavar="K", help="K of the plan and layouts"
    )
    parser.add_argument(
        "--layouts",
        type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
        default=["planned", "flat", "star", "tree"],
        help=f"comma-separated, among {','.join(LAYOUTS)} (default planned,flat,star,tree)",
    )
    parser.add_argument(
        "--stamps", choices=["delta", "full"], default="delta", help="clock mode of every layout"
    )
    parser.add_argument("--master", default="local[2]", help="Spark master of the plan step")
    parser.add_argument(
        "--load",
        choices=["idle", "busy"],
        default=None,
        help="cost model the plan minimises and the ranking is checked against (default: busy "
        "with --active 0, else idle)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over every layout, interleaved (1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per bus run")
    parser.add_argument("--workdir", help="keep configs, traces and results here")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def groups_of(servers: int, groups: int, seed: int) -> dict[int, int]:
    """Server id -> group number: equal groups (up to one), members drawn by a seeded shuffle."""
    ids = list(range(servers))
    random.Random(seed).shuffle(ids)
    return {sid: i % groups for i, sid in enumerate(ids)}


def active_of(groups: dict[int, int], active: int) -> list[int]:
    """``active`` servers taken in turn from each group (all when ``active`` is 0 or more)."""
    if active <= 0 or active >= len(groups):
        return sorted(groups)
    by_group: dict[int, list[int]] = {}
    for sid in sorted(groups):
        by_group.setdefault(groups[sid], []).append(sid)
    order = [
        m[i]
        for i in range(max(map(len, by_group.values())))
        for m in by_group.values()
        if i < len(m)
    ]
    return sorted(order[:active])


def _check(args: argparse.Namespace) -> None:
    if "planned" in args.layouts and args.observe < 1:
        raise SystemExit("perf groups: error: the planned layout needs --observe 1 or more")
    unknown = [x for x in args.layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(
            f"perf groups: error: unknown layout(s) {', '.join(unknown)}; use some of "
            f"{', '.join(LAYOUTS)}"
        )
    if args.groups < 1 or args.servers < 2 * args.groups:
        raise SystemExit(
            f"perf groups: error: {args.servers} servers in {args.groups} groups: use groups "
            "of at least 2 servers"
        )
    if args.repeat < 1 or args.count < 1:
        raise SystemExit("perf groups: error: --repeat and --count must be 1 or more")
    if not 0.0 <= args.inside <= 1.0:
        raise SystemExit(f"perf groups: error: --inside {args.inside} must be between 0 and 1")


def _ports(servers: int) -> int:
    # Every server in at most two domains, plus slack for routers of a star's hub.
    return 2 * servers + servers // 2 + 4


def _generated(kind: str, args: argparse.Namespace) -> str:
    text = generate(
        kind,
        args.servers,
        domain_size=args.max_domain_size,
        base_port=free_port_base(_ports(args.servers)),
    )
    if args.stamps == "full":
        text = text.replace("<domain name=", '<domain stamps="full" name=')
    return text


def _run_bus(
    config_text: str,
    work: Path,
    args: argparse.Namespace,
    groups: dict[int, int],
    count: int,
    props: dict[str, str],
    active: int,
) -> dict[str, Any]:
    """One bus of real processes running the workload; returns the coordinator's result."""
    work.mkdir(parents=True, exist_ok=True)
    ensure_secret(work / "bus.key")
    (work / "base.xml").write_text(config_text)
    out = work / "result.json"
    spec = {
        "groups": groups,
        "inside": args.inside,
        "count": count,
        "warmup": args.warmup,
        "out": str(out),
        "seed": args.seed,
        "active": active_of(groups, active),
    }
    service = ("perf.agents.groups:groups_service", json.dumps(spec))
    config = with_services(work / "base.xml", work / "a3.xml", {0: [service]}, props)
    with Bus(config, sorted(groups), work / "store", cwd=REPO_ROOT) as bus:
        # CPU of every server from the moment all are up to the result: the work the bus did
        # for the exchanges (plus a few control notifications), whatever else ran on the machine.
        cpu_start = {sid: cpu_seconds(bus[sid].pid) for sid in groups}
        result = wait_for_file(out, bus, args.timeout)
        result["cpu_s"] = sum(cpu_seconds(bus[sid].pid) - cpu_start[sid] for sid in groups)
        result["all_notes"] = 2 * (count + args.warmup) * len(spec["active"])
        return result


def _clock_bytes_per_note(traces: Path, window: list[int], notes: int) -> float:
    """Stamp bytes of every send (first hops and routers' re-stamps) plus each commit's persisted
    clock bytes (shared by the hops of its group), in the window, per end-to-end notification."""
    start, end = window
    total = 0.0
    for rec in read_hops(traces):
        if not start <= rec["t_ns"] <= end:
            continue
        if rec["event"] == "send":
            total += rec.get("stamp_bytes") or 0
        total += rec["clock_bytes"] / max(1, rec["group_hops"])
    return total / max(1, notes)


def _summary(runs: list[tuple[dict[str, Any], Path]]) -> dict[str, Any]:
    """One layout's figures over its runs (``--repeat``): latencies pooled, bytes and CPU per
    notification over all notifications, rate over the summed measured windows."""
    legs = [(h, a, inside) for result, _ in runs for h, a, inside in result["legs_ns"]]
    every = sorted(v / 1e6 for h, a, _ in legs for v in (h, a))
    inside = sorted(v / 1e6 for h, a, i in legs if i for v in (h, a))
    across = sorted(v / 1e6 for h, a, i in legs if not i for v in (h, a))

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan"), "n": 0}
        q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values
        p50 = statistics.median(values)
        return {
            "p50": round(p50, 3),
            "p99": round(q[98] if len(values) > 1 else values[0], 3),
            "mean": round(statistics.fmean(values), 3),
            "n": len(values),
        }

    notes = len(every)
    window_s = sum((r["window_ns"][1] - r["window_ns"][0]) / 1e9 for r, _ in runs)
    clock_bytes = sum(
        _clock_bytes_per_note(traces, r["window_ns"], 2 * len(r["legs_ns"])) * 2 * len(r["legs_ns"])
        for r, traces in runs
    )
    cpu_s = sum(r["cpu_s"] for r, _ in runs)
    all_notes = sum(r["all_notes"] for r, _ in runs)
    return {
        "runs": len(runs),
        "latency_ms": stats(every),
        "inside_ms": stats(inside),
        "across_ms": stats(across),
        "clock_bytes_per_note": round(clock_bytes / max(1, notes), 1),
        "notes": notes,
        "cpu_us_per_note": round(1e6 * cpu_s / max(1, all_notes), 1),
        "notes_per_s": round(notes / window_s, 1) if window_s > 0 else None,
    }


def _plan(traces: Path, out: Path, args: argparse.Namespace, base_port: int) -> dict[str, Any]:
    from aaabus.analysis import plan as plan_suite

    parser = argparse.ArgumentParser()
    plan_suite.add_arguments(parser)
    argv = [str(traces), "--max-domain-size", str(args.max_domain_size), "--out", str(out)]
    argv += ["--master", args.master, "--base-port", str(base_port), "--stamps", args.stamps]
    argv += ["--seed", str(args.seed), "--load", args.load]
    result, _ = plan_suite.plan(parser.parse_args(argv))
    return result


def _renumber_ports(config_text: str, needed: int) -> str:
    """The plan's ``a3.xml`` with its ports numbered afresh, in document order, from a base free
    now (as ``aaabus plan`` numbers them): ports free at planning time may not be at every run."""
    ports = iter(range(free_port_base(needed), 65536))
    return re.sub(r'\bport="\d+"', lambda _: f'port="{next(ports)}"', config_text)


def _rank(costs: dict[str, float]) -> list[str]:
    return [name for name, _ in sorted(costs.items(), key=lambda kv: kv[1])]


def run(args: argparse.Namespace) -> int:
    if args.active is None:
        args.active = args.groups
    if args.load is None:
        args.load = "busy" if args.active == 0 or args.active >= args.servers else "idle"
    _check(args)
    groups = groups_of(args.servers, args.groups, args.seed)
    t0 = time.monotonic()
    with scratch(args.workdir) as work:
        # 1. Observe: a flat bus with the traffic recorder on, short windows, every talker
        #    active (the traffic of a bus in service, whatever load is measured next).
        #    Skipped (with the plan) when only generated layouts are measured.
        planned_xml = work / "planned.xml"
        plan: dict[str, Any] = {"predicted": {}}
        if args.observe > 0:
            observe = work / "observe"
            props = {"aaabus.traffic": str((observe / "traffic").resolve())}
            props["aaabus.traffic.window_ms"] = "1000"
            _run_bus(_generated("flat", args), observe, args, groups, args.observe, props, 0)
            # 2. Plan from what was observed (ports picked now: the planned bus runs next).
            base = free_port_base(_ports(args.servers))
            plan = _plan(observe / "traffic", planned_xml, args, base)
        # 3. Measure every layout, hop tracing on; with --repeat, rounds of every layout in
        #    turn, so that a change of the machine's load falls on all of them alike.
        runs: dict[str, list[tuple[dict[str, Any], Path]]] = {name: [] for name in args.layouts}
        for round_ in range(args.repeat):
            for name in args.layouts:
                run_dir = work / f"{name}-{round_}"
                traces = run_dir / "traces"
                trace_props = {"aaabus.trace": str(traces.resolve())}
                if name == "planned":
                    text = _renumber_ports(planned_xml.read_text(), _ports(args.servers))
                else:
                    text = _generated(name, args)
                print(f"perf groups: {name} (round {round_ + 1}) ...", file=sys.stderr, flush=True)
                result = _run_bus(text, run_dir, args, groups, args.count, trace_props, args.active)
                runs[name].append((result, traces))
        layouts = {name: _summary(results) for name, results in runs.items()}
    predicted = {
        name: plan["predicted"][name] for name in args.layouts if name in plan["predicted"]
    }
    by_load = {
        load: {n: costs[n] for n in args.layouts if n in costs}
        for load, costs in plan.get("predicted_by_load", {}).items()
    }
    measured = {name: s["latency_ms"]["mean"] for name, s in layouts.items()}
    others = [v for k, v in measured.items() if k != "planned"]
    summary: dict[str, Any] = {
        "suite": "groups",
        "servers": args.servers,
        "groups": args.groups,
        "inside": args.inside,
        "count": args.count,
        "repeat": args.repeat,
        "active": len(active_of(groups, args.active)),
        "load": args.load,
        "max_domain_size": args.max_domain_size,
        "stamps": args.stamps,
        "plan": {k: plan.get(k) for k in ("domains", "largest_domain", "routers", "tree")},
        "layouts": layouts,
        "predicted": predicted,
        "predicted_by_load": by_load,
        "ranking": {
            "measured": _rank(measured),
            "predicted": _rank(predicted),
            "agree": _rank(measured) == _rank(predicted),
            "agree_by_load": {load: _rank(measured) == _rank(c) for load, c in by_load.items()},
        },
        "planned_vs_best": (
            round(measured["planned"] / min(others), 3)
            if "planned" in measured and others
            else None
        ),
        "seconds": round(time.monotonic() - t0, 1),
    }
    if not args.json:
        print(_table(layouts, predicted))
    print(json.dumps(summary))
    return 0


def _table(layouts: dict[str, dict[str, Any]], predicted: dict[str, float]) -> str:
    lines = [
        "layout    p50 ms  p99 ms  mean ms  inside p50  across p50  clock B/note  predicted ms",
    ]
    for name, s in layouts.items():
        lat, ins, acr = s["latency_ms"], s["inside_ms"], s["across_ms"]
        pred = predicted.get(name)
        lines.append(
            f"{name:<8} {lat['p50']:7.2f} {lat['p99']:7.2f} {lat['mean']:8.2f} "
            f"{ins['p50']:11.2f} {acr['p50']:11.2f} {s['clock_bytes_per_note']:13,.0f} "
            f"{pred if pred is not None else float('nan'):13.3f}"
        )
    return "\n".join(lines)
