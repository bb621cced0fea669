"""Shared fixtures: free ports, generated configs, in-process servers that always stop."""

from __future__ import annotations

import queue
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentServer, Notification
from aaabus.config import BusConfig, load_config
from aaabus.ids import AgentId
from aaabus.launch import free_port_base
from aaabus.secret import ensure_secret
from aaabus.topology import generate, render

REPO_ROOT = Path(__file__).resolve().parent.parent
#: What the servers of test buses trust (aaabus.trust): the suite's, the agents' and examples'.
TEST_TRUST = "tests,agents,examples,perf"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def contiguous_free_base(count: int) -> int:
    """A base port such that base .. base+count-1 are all free now (generated configs need it)."""
    return free_port_base(count)


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a generated a3.xml with free ports; ``extra`` XML is spliced into servers."""

    def make(
        kind: str = "flat",
        servers: int = 1,
        domain_size: int = 10,
        *,
        name: str = "a3.xml",
        extra: dict[int, str] | None = None,
        properties: dict[str, str] | None = None,
        domain_attrs: str = "",
        layout: list[list[int]] | None = None,
    ) -> Path:
        base = contiguous_free_base(servers * 3)
        # The servers of a test bus construct the test suite's own classes (aaabus.trust).
        properties = {"aaabus.trust": TEST_TRUST, **(properties or {})}
        if layout is not None:
            servers = 1 + max(max(members) for members in layout)
            text = render(layout, servers, base_port=base, properties=properties)
        else:
            text = generate(
                kind, servers, domain_size=domain_size, base_port=base, properties=properties
            )
        for sid, xml in (extra or {}).items():
            start = text.index(f'<server id="{sid}"')
            end = text.index("</server>", start)
            text = text[:end] + "  " + xml + "\n  " + text[end:]
        if domain_attrs:
            text = text.replace("<domain name=", f"<domain {domain_attrs} name=")
        path = tmp_path / name
        path.write_text(text)
        ensure_secret(tmp_path / "bus.key")
        return path

    return make


class Inbox:
    """What agents send to ``#s.s.0``, collected for the test (listener on the engine thread)."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[AgentId, Any]] = queue.Queue()

    def __call__(self, sender: AgentId, note: Notification) -> None:
        self.q.put((sender, note))

    def get(self, timeout: float = 10.0) -> Any:
        try:
            return self.q.get(timeout=timeout)[1]
        except queue.Empty:
            raise AssertionError(f"nothing reached the server inbox within {timeout}s") from None

    def empty(self) -> bool:
        return self.q.empty()


@pytest.fixture
def single_server(
    tmp_path: Path, make_config: Callable[..., Path]
) -> Iterator[tuple[AgentServer, Inbox, BusConfig]]:
    """A started in-process server 0 on a FileStorage in tmp_path, with an inbox listener."""
    cfg = load_config(make_config())
    server = AgentServer(cfg, 0, storage=tmp_path / "s0")
    server.start()
    inbox = Inbox()
    server.add_listener(inbox)
    try:
        yield server, inbox, cfg
    finally:
        server.stop()
