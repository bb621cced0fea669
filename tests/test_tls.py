"""A bus configured for TLS (``aaabus.tls.cert``/``key``), end to end: links between servers and
the admin port run inside TLS, clients built from the same config get in, and a client without
TLS or with a certificate the bus does not trust is refused while the bus goes on serving."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentServer
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import load_secret
from aaabus.errors import AdminError, ServerBusy
from aaabus.io.adminlink import AdminLink
from aaabus.tools.client import Client
from tests.support.agents import Marker, Probe, Seen
from tests.support.harness import Inbox, free_ports
from tests.support.tls import make_certificate


@pytest.fixture
def tls_bus(tmp_path: Path, make_config: Any) -> Iterator[tuple[BusConfig, Inbox]]:
    make_certificate(tmp_path, "bus")
    props = {"aaabus.tls.cert": "bus.pem", "aaabus.tls.key": "bus-key.pem"}
    admin = f'<property name="aaabus.admin.port" value="{free_ports(1)[0]}"/>'
    cfg = load_config(make_config(servers=2, properties=props, extra={0: admin}))
    servers = [
        AgentServer(cfg, sid, storage=tmp_path / f"s{sid}", endpoints=(sid == 0)) for sid in (0, 1)
    ]
    inbox = Inbox()
    try:
        for server in servers:
            server.start()
        servers[1].add_listener(inbox)
        yield cfg, inbox
    finally:
        for server in servers:
            server.stop()


def test_servers_and_clients_talk_over_tls(tls_bus: tuple[BusConfig, Inbox]) -> None:
    cfg, inbox = tls_bus
    with Client(cfg, 0) as client:
        assert client._tls is not None  # the config asked for TLS: the client uses it
        probe = client.deploy(Probe(), 1)  # creation request and reply cross the s0-s1 link
        client.send(probe, Marker("over tls"))
        seen = inbox.get()
        assert isinstance(seen, Seen) and seen.note == Marker("over tls")
        assert client.status()["up"]


def test_clients_without_the_bus_certificate_are_refused(
    tls_bus: tuple[BusConfig, Inbox], tmp_path: Path
) -> None:
    cfg, _inbox = tls_bus
    address, _ = admin_address(cfg, 0)
    assert address is not None
    secret = load_secret(tmp_path / "bus.key")
    # The secret alone is not enough: without TLS the server never sends its challenge, and
    # drops the connection at its handshake deadline.
    with pytest.raises(ServerBusy, match="expects TLS"):
        AdminLink.connect(address, secret, 0, timeout=8.0)
    # A certificate of another authority: the TLS handshake fails.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    cert, key = make_certificate(stranger, "other")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cert))
    context.load_cert_chain(str(cert), str(key))
    context.check_hostname = False
    with pytest.raises(AdminError, match="TLS handshake failed"):
        AdminLink.connect(address, secret, 0, timeout=8.0, tls=context)
    with Client(cfg, 0) as client:  # and the bus's own clients still get in
        assert client.status()["up"]
