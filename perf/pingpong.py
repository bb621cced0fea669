"""``python -m perf pingpong``: the report's round-trip measurement on real server processes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from aaabus.domains import Topology
from aaabus.errors import ConfigError
from aaabus.launch import Bus
from aaabus.store import STORE_KINDS
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
) -> dict[str, Any]:
    """Launch every server of ``config``, run one ping-pong test, stop everything."""
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
        run_config = with_services(
            config,
            work / "a3.xml",
            {0: [("agents.pingpong:bench_service", json.dumps(args))]},
            properties,
        )
        with Bus(run_config, ids, work / "store", cwd=REPO_ROOT) as bus:
            result = wait_for_file(out, bus, timeout)
    topology = Topology.from_config(cfg)
    # Network hops one way to the farthest responder: 1 inside a domain, +1 per router crossed.
    result["hops"] = max((len(topology.route(0, r)) for r in responders), default=0)
    result["servers"] = len(ids)
    result["config"] = str(config)
    return result


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
