"""Many agent servers in one process: the simulation mode.

Each server keeps its own engine thread, store (in memory by default, or on disk) and network
over loopback TCP, exactly as in its own process; only the process is shared. Used by the
property tests and by ``perf --inprocess`` to reach hundreds of servers on one machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from aaabus.config.domains import Topology
from aaabus.config.reader import BusConfig
from aaabus.node.server import AgentServer


class InProcessBus:
    """Starts every server of ``config`` (or ``server_ids``) in this process; stops them all."""

    def __init__(
        self,
        config: BusConfig,
        server_ids: Iterable[int] | None = None,
        *,
        store_kind: str = "memory",
        storage_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if store_kind != "memory" and storage_root is None:
            raise ValueError(f"a {store_kind} store needs storage_root")
        root = Path(storage_root) if storage_root is not None else None
        ids = sorted(config.servers) if server_ids is None else list(server_ids)
        # One validated topology for all (each server would otherwise build the same graph).
        topology = Topology.from_config(config, allow_cycles=_allows_cycles(config, ids))
        self.servers: dict[int, AgentServer] = {
            sid: AgentServer(
                config,
                sid,
                storage=(root / f"s{sid}") if root is not None else None,
                store_kind=store_kind,
                topology=topology,
            )
            for sid in ids
        }

    def __getitem__(self, server_id: int) -> AgentServer:
        return self.servers[server_id]

    def start(self) -> InProcessBus:
        started: list[AgentServer] = []
        try:
            for server in self.servers.values():
                server.start()
                started.append(server)
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        errors: list[BaseException] = []
        for server in self.servers.values():
            try:
                server.stop(timeout)
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> InProcessBus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _allows_cycles(config: BusConfig, ids: list[int]) -> bool:
    # The test-only switch is a server property; a server that differs builds its own topology.
    return bool(ids) and bool(config.setting(ids[0], "aaabus.test.allow_cycles"))
