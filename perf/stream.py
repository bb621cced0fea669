"""``python -m perf stream``: one-way persistent throughput, end to end, on real processes.

The result also holds ``store_bytes``: ``{"<server id>": bytes}``, each server's storage
directory on disk when the stream has been consumed (servers still running).

With ``sample_every`` seconds and a ``samples`` file, the harness also appends there, while the
stream runs, one JSON line per sample: seconds since the bus was up, each server's store bytes
and RSS. The file is flushed per line, so a run stopped early (``--timeout``, a kill) keeps
what it sampled; the result then sums the samples up (``store_bytes_max``, first and last RSS).
Polling happens on the harness's waiting thread; a sample takes a directory walk per server."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import IO, Any

from aaabus.tools.launch import Bus
from perf.harness import (
    REPO_ROOT,
    config_of,
    cpu_seconds,
    rss_bytes,
    scratch,
    store_bytes,
    wait_for_file,
    with_services,
)


def run(
    config: str | Path,
    count: int,
    *,
    to: int | None = None,
    burst: int = 200,
    payload: int = 0,
    window: int = 0,
    workdir: str | None = None,
    timeout: float = 600.0,
    properties: dict[str, str] | None = None,
    sample_every: float = 0.0,
    samples: str | Path | None = None,
    replicas: int = 0,
) -> dict[str, Any]:
    """Stream ``count`` notifications from server 0 to server ``to`` (default: the highest).

    ``replicas``: give every server that many replicas (issue 42; how many are synchronous is
    ``aaabus.replication.sync``, default 1)."""
    cfg = config_of(config)
    ids = sorted(cfg.servers)
    target = max(ids) if to is None else to
    with scratch(workdir) as work:
        out = work / "stream.json"
        args = {"server": target, "count": count, "out": str(out), "burst": burst}
        args["payload"] = payload
        if window:
            args["window"] = window
        run_config = with_services(
            config,
            work / "a3.xml",
            {0: [("perf.agents.stream:stream_service", json.dumps(args))]},
            properties,
            replicas,
        )
        with Bus(run_config, ids, work / "store", cwd=REPO_ROOT) as bus:
            # CPU from here on: the servers are up (their imports and boot are behind them) and
            # the stream has just begun.
            cpu_start = {i: cpu_seconds(bus[i].pid) for i in ids}
            sampler = None
            if sample_every > 0 and samples is not None:
                sampler = _Sampler(bus, work / "store", ids, sample_every, Path(samples))
            try:
                result = wait_for_file(out, bus, timeout, sampler.tick if sampler else None)
            finally:
                if sampler is not None:
                    sampler.close()
            # At the end of the stream, servers still running: what a store holds in service,
            # and the CPU each server used during the stream.
            sizes = store_bytes(work / "store", ids)
            cpu = {str(i): round(cpu_seconds(bus[i].pid) - cpu_start[i], 3) for i in ids}
    result.update(servers=len(ids), to=target, config=str(config), payload=payload)
    result["replicas"] = replicas
    result["store_bytes"] = sizes
    result["cpu_s"] = cpu
    result["cpu_us_per_msg"] = round(1e6 * sum(cpu.values()) / max(1, count), 2)
    if sampler is not None:
        result["samples"] = sampler.summary()
    return result


def compare(
    config: str | Path,
    count: int,
    extra: dict[str, str],
    repeat: int,
    *,
    burst: int = 200,
    payload: int = 0,
    properties: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The stream without and with the ``extra`` properties, interleaved ``repeat`` times.

    Runs alternate (off, on, off, on...) so that both sides see the same machine load; the
    result holds each side's throughputs, their medians and the overhead of ``extra`` in percent
    of the median throughput without it.
    """
    base = dict(properties or {})
    sides = {"off": base, "on": {**base, **extra}}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeat):
        for label, props in sides.items():
            result = run(config, count, burst=burst, payload=payload, properties=props)
            rates[label].append(result["msgs_per_s"])
            cpus[label].append(result["cpu_us_per_msg"])
    medians = {label: statistics.median(values) for label, values in rates.items()}
    cpu_medians = {label: statistics.median(values) for label, values in cpus.items()}
    overhead = 100.0 * (medians["off"] - medians["on"]) / medians["off"]
    cpu_overhead = 100.0 * (cpu_medians["on"] - cpu_medians["off"]) / cpu_medians["off"]
    return {
        "extra": extra,
        "count": count,
        "repeat": repeat,
        "msgs_per_s": rates,
        "median_msgs_per_s": medians,
        "overhead_pct": overhead,
        "cpu_us_per_msg": cpus,
        "median_cpu_us_per_msg": cpu_medians,
        "cpu_overhead_pct": cpu_overhead,
    }


class _Sampler:
    """Store bytes and RSS of every server, every ``every`` seconds, one JSON line each."""

    def __init__(self, bus: Bus, root: Path, ids: list[int], every: float, path: Path) -> None:
        self._bus, self._root, self._ids, self._every = bus, root, ids, every
        self._file: IO[str] = path.open("w", encoding="utf-8")
        self._start = time.monotonic()
        self._next = self._start
        self._lines: list[dict[str, Any]] = []

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self._every
        line = {
            "t_s": round(now - self._start, 1),
            "store_bytes": store_bytes(self._root, self._ids),
            "rss_bytes": {str(i): rss_bytes(self._bus[i].pid) for i in self._ids},
        }
        self._lines.append(line)
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def summary(self) -> dict[str, Any]:
        """How many samples, the largest store of each server, first and last RSS."""
        if not self._lines:
            return {"count": 0}
        first, last = self._lines[0], self._lines[-1]
        return {
            "count": len(self._lines),
            "store_bytes_max": {
                str(i): max(s["store_bytes"][str(i)] for s in self._lines) for i in self._ids
            },
            "rss_first": first["rss_bytes"],
            "rss_last": last["rss_bytes"],
        }
