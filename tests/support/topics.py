"""Helpers of the topic tests: in-process buses on a layout of domains, reading agents' records."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from aaabus import AgentId, AgentServer
from aaabus.config.reader import BusConfig, parse_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.model.ids import TOPICS_STAMP
from aaabus.node.inprocess import InProcessBus
from tests.support.harness import TEST_TRUST, contiguous_free_base

T = TypeVar("T")


def layout_config(
    tmp_path: Path, layout: list[list[int]], properties: dict[str, str] | None = None
) -> BusConfig:
    """A config of ``layout`` (a list of domains, each a list of server ids) with free ports,
    in-memory stores and ``properties``."""
    servers = 1 + max(max(m) for m in layout)
    text = render(
        layout,
        servers,
        base_port=contiguous_free_base(sum(len(m) for m in layout)),
        properties={
            "aaabus.store": "memory",
            "aaabus.secret": "bus.key",
            "aaabus.trust": TEST_TRUST,
            **(properties or {}),
        },
    )
    path = tmp_path / "a3.xml"
    path.write_text(text)
    ensure_secret(tmp_path / "bus.key")
    return parse_config(text, str(path))


@contextlib.contextmanager
def inprocess(
    tmp_path: Path, layout: list[list[int]], properties: dict[str, str] | None = None
) -> Iterator[InProcessBus]:
    with InProcessBus(layout_config(tmp_path, layout, properties)) as bus:
        yield bus


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    """``probe()``'s first true value; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still not true after {timeout}s (last: {value!r})")
        pause.wait(0.02)  # other threads (engines, the network) do the work: poll its result


def agent_attr(server: AgentServer, agent_id: AgentId, attr: str) -> Any:
    """A copy of attribute ``attr`` of an agent, read on its server's engine thread."""

    def read() -> Any:
        assert server.store is not None
        value = getattr(server.store.agents[(agent_id.origin, agent_id.stamp)], attr)
        return list(value) if hasattr(value, "__iter__") and not isinstance(value, str) else value

    return server.call(read)


def remote_filters(server: AgentServer) -> dict[str, list[int]]:
    """What ``server``'s topic representative knows of the other servers' filters."""

    def read() -> dict[str, list[int]]:
        assert server.store is not None
        rep = server.store.agents[(server.server_id, TOPICS_STAMP)]
        return {f: sorted(where) for f, where in rep.remote.items()}

    return server.call(read)


def retained_topics(server: AgentServer) -> list[str]:
    """The topics whose retained publication ``server``'s representative holds."""

    def read() -> list[str]:
        assert server.store is not None
        return list(server.store.agents[(server.server_id, TOPICS_STAMP)].retained.keys())

    return server.call(read)


def wait_interest(bus: InProcessBus, expected: dict[str, set[int]]) -> None:
    """Wait until every server's representative knows ``expected`` (filter -> servers)."""
    for sid, server in bus.servers.items():
        want = {f: sorted(where - {sid}) for f, where in expected.items() if where - {sid}}

        def known(server: AgentServer = server, want: dict[str, list[int]] = want) -> bool:
            return remote_filters(server) == want

        wait_until(f"interest known at server {sid}", known)
