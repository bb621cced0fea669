"""``aaabus plan TRACES --max-domain-size K --out a3.xml``: causality domains planned from
observed traffic (also ``python -m perf plan`` in a checkout: the same code).

1. The traffic traces under TRACES (``traffic/``, else the perf suites' ``hops/``) are checked
   with pyarrow, then Spark (``local[2]`` unless ``--master`` says otherwise) sums notifications
   and bytes per (src, dst): :mod:`aaabus.analysis.traffic_matrix`. Only that matrix reaches
   the driver.
2. :func:`aaabus.analysis.planner.plan_domains` cuts the servers into domains of at most K
   members joined by routers into a tree.
3. :mod:`aaabus.analysis.costmodel` predicts the cost per notification of the plan and of the
   generated layouts of the same servers with the same K (``aaabus.config.topology``: flat, star,
   tree, bus); the table is printed and the plan written as ``a3.xml``, checked by
   :meth:`aaabus.config.domains.Topology.from_config` before it is written.

Server ids are the ones in the traces, or every server of ``--servers-from CONFIG`` (whose names
and hostnames are kept; ports are numbered afresh from ``--base-port``). The last line printed is
one JSON object (with ``--json``, the only one). Bad input, and a missing ``aaabus[spark]``
extra, raise an :class:`~aaabus.errors.AaabusError`: the command line prints its one line and
exits with status 2. Everything runs on the main thread.
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

from aaabus.analysis.costmodel import LOADS, STAMPS, CostModel, LayoutCost, evaluate
from aaabus.analysis.planner import plan_domains
from aaabus.analysis.sparkjob import add_spark_arguments, command_session, local_path
from aaabus.analysis.traffic_matrix import aggregate, validate
from aaabus.config.domains import Topology
from aaabus.config.reader import load_config, parse_config
from aaabus.config.topology import check_port_span, domain_memberships, layout
from aaabus.errors import ConfigError, TraceError
from aaabus.extras import require

#: Generated layouts the plan is compared with (aaabus.config.topology's generators).
COMPARED = ("flat", "star", "tree", "bus")
#: What the command imports from the ``spark`` extra: footers and Spark's results (pyarrow),
#: the aggregation (pyspark), the matrices (numpy), the communities (networkx).
NEEDS = ("pyarrow", "pyspark", "numpy", "networkx")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``aaabus plan``."""
    parser.add_argument("traces", help="traces directory holding traffic/ (or hops/) Parquet files")
    parser.add_argument(
        "--max-domain-size",
        type=int,
        required=True,
        metavar="K",
        help="members per domain at most, routers included (2 or more)",
    )
    parser.add_argument("--out", required=True, help="the planned a3.xml (written by the driver)")
    add_spark_arguments(parser, default_master="local[2]", log="spark-plan.log beside --out")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--servers-from",
        metavar="CONFIG",
        help="a3.xml whose servers (ids, names, hostnames) the plan lays out, traffic or not",
    )
    parser.add_argument(
        "--base-port", type=int, default=16300, help="first port of the plan (default 16300)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="hostname of every server without --servers-from"
    )
    parser.add_argument(
        "--stamps",
        choices=STAMPS,
        default="delta",
        help="clock mode the cost model assumes and the plan's domains use (default delta)",
    )
    parser.add_argument(
        "--load",
        choices=LOADS,
        default="idle",
        help="what the cost model predicts and the planner minimises: idle (latency of a "
        "notification on a quiet bus, default) or busy (CPU per notification when every server "
        "sends; delta stamps only)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the community detection")


def run(args: argparse.Namespace) -> int:
    """The command: the table (unless ``--json``), then the JSON line; exit status 0."""
    require("planning from traces", "spark", *NEEDS)
    t0 = time.monotonic()
    try:
        result, table = plan(args)
    except OSError as exc:  # --out cannot be written, say
        raise TraceError(str(exc)) from None
    result["seconds"] = round(time.monotonic() - t0, 3)
    if not args.json:
        print(table)
    print(json.dumps(result))
    return 0


def plan(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The whole command but printing: returns the JSON summary and the human table."""
    t_start = time.monotonic()
    k = args.max_domain_size
    if k < 2:
        raise ConfigError(
            f"--max-domain-size {k}: a domain holds a router and at least one other server; "
            "use 2 or more"
        )
    if args.load == "busy" and args.stamps != "delta":
        # Refused before Spark starts: the model is known from the arguments alone.
        raise ConfigError("--load busy is calibrated for delta stamps only; use --stamps delta")
    out = local_path(args.out)
    if out is None:
        raise TraceError(f"--out must be a local file, got {args.out}")
    config = load_config(args.servers_from) if args.servers_from else None
    source = validate(args.traces, args.master)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / "spark-plan.log"
    t0 = time.monotonic()
    with command_session(args, log_path, "aaabus-plan") as spark:
        t_jvm = time.monotonic()
        matrix = aggregate(
            spark, args.traces, source, log_path, list(config.servers) if config else None
        )
    t_agg = time.monotonic()
    if config is not None:
        unknown = sorted(set(matrix.ids) - set(config.servers))
        if unknown:
            raise ConfigError(
                f"the traces name server(s) {', '.join(map(str, unknown[:5]))} that "
                f"{args.servers_from} does not declare; plan without --servers-from or give "
                "the bus's own a3.xml"
            )
    model = CostModel(args.stamps, args.load)
    planned = plan_domains(matrix.notes, k, model, seed=args.seed)
    n = len(matrix.ids)
    layouts = {kind: layout(kind, n, k) for kind in COMPARED}
    costs = [planned.cost]
    costs += [evaluate(kind, members, matrix.notes, model) for kind, members in layouts.items()]
    # The same layouts under every model the clock mode has: which one a bus is closer to
    # depends on its load, and the plan is only as good as the ranking it gets under both.
    by_load: dict[str, dict[str, float]] = {}
    for load in LOADS if args.stamps == "delta" else ("idle",):
        other = CostModel(args.stamps, load)
        by_load[load] = {
            "planned": round(
                evaluate("planned", planned.domains, matrix.notes, other).ms_per_note, 4
            )
        }
        for kind, members in layouts.items():
            by_load[load][kind] = round(evaluate(kind, members, matrix.notes, other).ms_per_note, 4)
    domains = [[matrix.ids[i] for i in members] for members in planned.domains]
    servers = (
        {sid: (srv.name, srv.hostname) for sid, srv in config.servers.items()}
        if config is not None
        else {sid: (f"s{sid}", args.host) for sid in matrix.ids}
    )
    predicted = {c.name: round(c.ms_per_note, 4) for c in costs}
    recipe = (
        f"aaabus plan {args.traces} (K={k}, {args.stamps} stamps, {args.load} load, "
        f"seed {args.seed}, "
        f"{matrix.rows} {matrix.kind} rows); predicted ms per notification: "
        + ", ".join(f"{name} {ms}" for name, ms in predicted.items())
    )
    text = render_plan(domains, servers, args.base_port, args.stamps, recipe)
    Topology.from_config(parse_config(text, str(out)))  # the plan is a tree by construction
    out.write_text(text)
    t_plan = time.monotonic()
    total_notes = int(matrix.notes.sum())
    result: dict[str, Any] = {
        "out": str(out),
        "rows": matrix.rows,
        "source": matrix.kind,
        "servers": n,
        "notes": total_notes,
        "max_domain_size": k,
        "stamps": args.stamps,
        "master": args.master,
        "tree": planned.tree,
        "domains": planned.cost.domains,
        "largest_domain": planned.cost.largest,
        "routers": planned.cost.routers,
        "load": args.load,
        "predicted": predicted,
        "predicted_by_load": by_load,
        "layouts": {c.name: c.as_dict() for c in costs},
        "timings": {
            "validate": round(t0 - t_start, 3),
            "jvm_start": round(t_jvm - t0, 3),
            "aggregate": round(t_agg - t_jvm, 3),
            "plan": round(t_plan - t_agg, 3),
        },
    }
    notes = [*source.notes]
    header = (
        f"aaabus plan: {matrix.rows:,} {matrix.kind} rows, {n} servers, {total_notes:,} "
        f"notifications; K = {k}, {args.stamps} stamps"
    )
    footer = (
        f"wrote {out}: {planned.cost.domains} domain(s) joined as a {planned.tree}; check it "
        f"with: aaabus check {out}\n"
        f"time: footers checked {t0 - t_start:.1f} s, JVM start {t_jvm - t0:.1f} s, read + "
        f"aggregate {t_agg - t_jvm:.1f} s, plan {t_plan - t_agg:.1f} s"
    )
    table = "\n".join([header, *notes, _table(costs), footer])
    return result, table


def _table(costs: Sequence[LayoutCost]) -> str:
    base = costs[0].ms_per_note
    lines = [
        f"{'layout':<8} {'domains':>7} {'largest':>7} {'routers':>7} {'links':>9} "
        f"{'legs/note':>9} {'clock B/note':>12} {'ms/note':>8} {'x planned':>9}"
    ]
    for c in costs:
        lines.append(
            f"{c.name:<8} {c.domains:>7} {c.largest:>7} {c.routers:>7} {c.links:>9,} "
            f"{c.legs_per_note:>9.3f} {c.clock_bytes_per_note:>12,.0f} {c.ms_per_note:>8.3f} "
            f"{c.ms_per_note / base if base else 1.0:>9.2f}"
        )
    return "\n".join(lines)


def render_plan(
    domains: Sequence[Sequence[int]],
    servers: Mapping[int, tuple[str, str]],
    base_port: int,
    stamps: str,
    recipe: str,
) -> str:
    """The ``a3.xml`` of a plan: ``domains[d]`` lists the server ids of ``Dd``; ``servers`` maps
    every id to its (name, hostname). Ports are numbered from ``base_port`` in document order.

    Not :func:`aaabus.config.topology.render`: that one numbers servers 0..N-1 on one host, a
    plan keeps the traced ids and, from ``--servers-from``, each server's name and host.
    """
    memberships = domain_memberships(domains, servers)
    check_port_span(domains, base_port, "--base-port")
    root = ET.Element("config")
    # "--" may not appear in an XML comment: the traces path could hold one.
    root.append(ET.Comment(f" planned by {recipe} ".replace("--", "- -")))
    for d in range(len(domains)):
        attrs = {"name": f"D{d}"}
        if stamps != "delta":  # delta is the bus's default
            attrs["stamps"] = stamps
        ET.SubElement(root, "domain", attrs)
    port = base_port
    for sid in sorted(servers):
        name, host = servers[sid]
        server = ET.SubElement(root, "server", {"id": str(sid), "name": name, "hostname": host})
        if len(memberships[sid]) > 1:
            server.append(ET.Comment(f" router: {', '.join(f'D{d}' for d in memberships[sid])} "))
        for d in memberships[sid]:
            ET.SubElement(server, "network", {"domain": f"D{d}", "port": str(port)})
            port += 1
    ET.indent(root, space="  ")
    return "<?xml version='1.0' encoding='utf-8'?>\n" + ET.tostring(root, "unicode") + "\n"
