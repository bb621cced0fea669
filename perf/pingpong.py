"""``python -m perf pingpong``: the report's round-trip measurement on real server processes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from aaabus.config.domains import Topology
from aaabus.core.store import STORE_KINDS
from aaabus.core.trace import STAGES, read_hops, replica_stages
from aaabus.errors import ConfigError
from aaabus.tools.launch import Bus
from perf.harness import REPO_ROOT, config_of, scratch, wait_for_file, with_services

TESTS = ("local", "remote", "broadcast")


def responders_for(test: str, server_ids: list[int]) -> list[int]:
    """Where the responders live: the report's three tests."""
    if test == "local":
        return [0]
    if test == "remote":
        return [max(server_ids)]
    if test == "broadcast":
        return sorted(server_ids)
    raise ValueError(f"unknown test {test!r}; expected one of {', '.join(TESTS)}")


def run(
    config: str | Path,
    test: str,
    rounds: int,
    *,
    payload: int = 0,
    warmup: int = 50,
    workdir: str | None = None,
    timeout: float = 600.0,
    properties: dict[str, str] | None = None,
    breakdown: bool = False,
    replicas: int = 0,
) -> dict[str, Any]:
    """Launch every server of ``config``, run one ping-pong test, stop everything.

    ``replicas``: give every server that many replicas (their own processes; how many are
    synchronous is ``aaabus.replication.sync``, default 1).

    With ``breakdown``, the servers trace every hop (``aaabus.trace``) and the result gets
    ``breakdown_us`` (see :func:`hop_breakdown`); tracing costs a few µs per hop."""
    cfg = config_of(config)
    ids = sorted(cfg.servers)
    if 0 not in cfg.servers:
        raise ValueError(f"{config}: the driver runs on server 0, which this config lacks")
    responders = responders_for(test, ids)
    with scratch(workdir) as work:
        out = work / "result.json"
        args: dict[str, Any] = {
            "test": test,
            "rounds": rounds,
            "warmup": warmup,
            "payload": payload,
            "responders": responders,
            "out": str(out),
        }
        props = dict(properties or {})
        if breakdown:
            props["aaabus.trace"] = "trace"  # relative to the run's a3.xml: work/trace
        run_config = with_services(
            config,
            work / "a3.xml",
            {0: [("perf.agents.pingpong:bench_service", json.dumps(args))]},
            props,
            replicas,
        )
        with Bus(run_config, ids, work / "store", cwd=REPO_ROOT) as bus:
            result = wait_for_file(out, bus, timeout)
        if breakdown:  # the servers have stopped: their trace files are complete
            result["breakdown_us"] = hop_breakdown(work / "trace", result["rtt_ms"]["p50"])
    topology = Topology.from_config(cfg)
    # Network hops one way to the farthest responder: 1 inside a domain, +1 per router crossed.
    result["hops"] = max((len(topology.route(0, r)) for r in responders), default=0)
    result["servers"] = len(ids)
    result["replicas"] = replicas
    result["config"] = str(config)
    return result


def hop_breakdown(trace_dir: Path, rtt_p50_ms: float) -> dict[str, Any]:
    """Where one hop's time goes, in µs, from the servers' hop traces.

    ``hop`` is half the round trip's p50. Each stage of :data:`aaabus.core.trace.STAGES`
    (``decode_mac`` on the I/O thread, ``handoff`` to the engine thread, ``clock_test``,
    ``reaction``, ``stamp``, ``commit_prepare`` (ZODB), ``write``, ``sync``, ``commit_finish``,
    ``send``, ...) is the p50 over the hops that passed it, on every server; ``wire`` is ``hop``
    minus the sum of those on the frame's path (``path``): TCP over loopback and the reading I/O
    thread's wake-up, i.e. what happens between one server's socket send and the other's socket
    read. With early frames (``aaabus.link.early``) the path ends at ``send_early``, as the
    commit starts; the stages after it (ZODB's preparation, the wait for the peer's durability
    notice, the write, the sync, the notice sent) run while the frame travels and the peer
    works, and show in the next hop's ``handoff`` when a group is still busy with them as its
    next frame arrives. Without, every stage is on the path. With replicas, ``replica``: the
    p50 of each stage of a replicated commit from the primary's ship to its wait's return
    (:data:`aaabus.core.trace.REPLICA_STAGES`), and ``waited``, from the primary's own sync to
    that return. Also ``clock_stamp`` (the
    sender's clock work inside ``stamp``), ``commit`` (the engine's whole commit call, from
    ``commit`` to after ``send``) and ``group_hops`` (hops per commit), as p50s."""
    stamps: list[float] = []
    commits: list[float] = []
    groups: list[float] = []
    stages: dict[str, list[float]] = {stage: [] for _mark, stage in STAGES}
    stages["commit_io"] = []
    for rec in read_hops(trace_dir):
        if rec["event"] == "send":
            stamps.append(rec["clock_ns"] / 1000)
        commits.append(rec["commit_ns"] / 1000)
        groups.append(rec["group_hops"])
        for stage, ns in rec.get("stages", {}).items():
            stages.setdefault(stage, []).append(ns / 1000)

    def p50(values: list[float]) -> float:
        return round(statistics.median(values), 1) if values else 0.0

    hop = rtt_p50_ms * 1000 / 2
    replicated = {
        name: p50([ns / 1000 for ns in values])
        for name, values in replica_stages(trace_dir).items()
    }
    parts = {stage: p50(values) for stage, values in stages.items() if values}
    path = list(parts)
    if "send_early" in parts:
        order = [stage for _mark, stage in STAGES]
        path = [s for s in order[: order.index("send_early") + 1] if s in parts]
    wire = round(hop - sum(parts[stage] for stage in path), 1)
    return {
        "hop": round(hop, 1),
        **parts,
        "path": path,
        "wire": wire,
        "clock_stamp": p50(stamps),
        "commit": p50(commits),
        "group_hops": p50(groups),
        # With replicas: where a replicated commit's wait goes (aaabus.core.trace.REPLICA_STAGES).
        **({"replica": replicated} if any(replicated.values()) else {}),
    }


def compare_stores(
    config: str | Path,
    test: str,
    rounds: int,
    stores: list[str],
    repeat: int,
    *,
    properties: dict[str, str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The same test once per store kind (property ``aaabus.store``), ``repeat`` times
    interleaved (kind A, kind B, kind A, ...) so that a busy spell of the machine hits both;
    per kind, the median of the repetitions' p50s; ``<first>_vs_<kind>``: ratios of p50s."""
    unknown = [kind for kind in stores if kind not in STORE_KINDS]
    if unknown or len(stores) < 2:
        raise ConfigError(
            f"--stores {','.join(stores)}: expected two or more of {', '.join(STORE_KINDS)}"
        )
    p50s: dict[str, list[float]] = {kind: [] for kind in stores}
    for _ in range(repeat):
        for kind in stores:
            result = run(
                config,
                test,
                rounds,
                properties={**(properties or {}), "aaabus.store": kind},
                **options,
            )
            p50s[kind].append(result["rtt_ms"]["p50"])
    medians = {kind: statistics.median(values) for kind, values in p50s.items()}
    first = stores[0]
    return {
        "test": test,
        "rounds": rounds,
        "repeat": repeat,
        "p50_ms": {kind: round(value, 4) for kind, value in medians.items()},
        "p50_ms_runs": p50s,
        **{f"{first}_vs_{kind}": round(medians[first] / medians[kind], 3) for kind in stores[1:]},
    }
