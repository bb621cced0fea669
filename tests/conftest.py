"""Shared fixtures: generated configs, in-process servers that always stop.

Helpers the tests import live in ``tests/support/``, not here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import AgentServer
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import generate, render
from tests.support.harness import TEST_TRUST, Inbox, claim_worker_ports, contiguous_free_base
from tests.support.stores import Stores


def pytest_configure(config: pytest.Config) -> None:
    # Two xdist workers that chose ports from one shared range could both pick a free one, and a
    # client of one test then reached the other's server: each worker gets its own range.
    claim_worker_ports()


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


# Stores of one test, opened and reopened, closed at its end (tests/support/stores.py): of
# both durable kinds (a checker run against each), or the log store alone.
@pytest.fixture(params=["log", "file"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stores]:
    opened = Stores(request.param, tmp_path)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def log_stores(tmp_path: Path) -> Iterator[Stores]:
    opened = Stores("log", tmp_path)
    try:
        yield opened
    finally:
        opened.close()
