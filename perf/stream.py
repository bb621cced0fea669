"""``python -m perf stream``: one-way persistent throughput, end to end, on real processes.

The result also holds ``store_bytes``: ``{"<server id>": bytes}``, each server's storage
directory on disk when the stream has been consumed (servers still running)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aaabus.launch import Bus
from perf.harness import (
    REPO_ROOT,
    config_of,
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
    workdir: str | None = None,
    timeout: float = 600.0,
    properties: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Stream ``count`` notifications from server 0 to server ``to`` (default: the highest)."""
    cfg = config_of(config)
    ids = sorted(cfg.servers)
    target = max(ids) if to is None else to
    with scratch(workdir) as work:
        out = work / "stream.json"
        args = {"server": target, "count": count, "out": str(out), "burst": burst}
        args["payload"] = payload
        run_config = with_services(
            config,
            work / "a3.xml",
            {0: [("agents.stream:stream_service", json.dumps(args))]},
            properties,
        )
        with Bus(run_config, ids, work / "store", cwd=REPO_ROOT) as bus:
            result = wait_for_file(out, bus, timeout)
            # At the end of the stream, servers still running: what a store holds in service.
            sizes = store_bytes(work / "store", ids)
    result.update(servers=len(ids), to=target, config=str(config), payload=payload)
    result["store_bytes"] = sizes
    return result
