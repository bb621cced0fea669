"""The admin endpoint: status, stop, send and deploy from outside the bus, metrics, thread dumps."""

from __future__ import annotations

import base64
import json
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentId, AgentServer
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import load_config
from aaabus.config.secret import Credential, load_secret
from aaabus.errors import AdminError, RequestRefused
from aaabus.io.adminlink import AdminLink
from aaabus.tools.buswide import bus_status
from aaabus.tools.cli import main
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from aaabus.wire.frames import ConnectorHandshake, FrameDecoder
from tests.support.agents import Counter, Inc, Marker, Probe, Seen
from tests.support.bus import wait_json
from tests.support.harness import REPO_ROOT, Inbox, aaabus_cli, free_ports

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

N = 100


def status_json(config: Path, *extra: str) -> dict[int, dict[str, Any]]:
    run = aaabus_cli("status", str(config), "--json", *extra)
    assert run.returncode == 0, run.stderr
    return {st["id"]: st for st in json.loads(run.stdout)["servers"]}


def until(condition: Any, timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something true (it reads another process)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.02)


def test_status_is_consistent_before_and_after_traffic_on_three_domains(
    tmp_path: Path, make_config: Any
) -> None:
    # D0 = {0, 1}, D1 = {1, 2, 3}, D2 = {3, 4}: servers 1 and 3 are routers, and a message from
    # server 0 to server 4 crosses all three domains: 0 -D0- 1 -D1- 3 -D2- 4.
    ports = free_ports(6)
    extra = {sid: f'<property name="aaabus.admin.port" value="{ports[sid]}"/>' for sid in range(5)}
    extra[0] += f'<property name="aaabus.metrics.port" value="{ports[5]}"/>'
    extra[2] += '<property name="aaabus.gc.thresholds" value="20000,15,50"/>'
    config = make_config(layout=[[0, 1], [1, 2, 3], [3, 4]], extra=extra)
    done = tmp_path / "done.json"
    with Bus(config, range(5), tmp_path / "store", cwd=REPO_ROOT) as bus:
        before = status_json(config)
        assert sorted(before) == [0, 1, 2, 3, 4]
        assert all(st["up"] for st in before.values())
        assert [sid for sid, st in before.items() if st["router"]] == [1, 3]
        assert before[1]["domains"] == ["D0", "D1"] and before[1]["clocks"] == {"D0": 2, "D1": 3}
        assert before[1]["clock_cells"] == 4 + 9
        # Each server process tunes its cycle collector and freezes what boot built.
        assert before[2]["gc"]["thresholds"] == [20000, 15, 50]
        assert before[0]["gc"]["thresholds"] == [50000, 20, 100]
        assert all(st["gc"]["frozen"] > 0 for st in before.values())
        for st in before.values():
            assert st["queues"]["input"] == st["queues"]["held_back"] == st["queues"]["parked"] == 0
            assert set(st["queues"]["outgoing"].values()) == {0}
            assert st["messages"] == {
                "sent": 0,
                "delivered": 0,
                "sent_remote": 0,
                "received_remote": 0,
                "tentative_dropped": 0,
            }
            assert st["storage_bytes"] > 0 and st["uptime_s"] >= 0

        with Client(config, server=0) as client:
            counter = client.deploy(Counter(expect=N, done=str(done)), server=4)
            assert counter.server == 4
            for i in range(1, N + 1):
                client.send(counter, Inc(i))
        assert wait_json(done, bus.servers.values(), 60) == {"count": N, "errors": 0}

        def settled() -> dict[int, dict[str, Any]] | None:
            # Acknowledgements ride along with later work (50 ms at most when idle).
            statuses = {st["id"]: st for st in bus_status(load_config(config), range(5), secret)}
            busy = any(
                sum(st["queues"]["outgoing"].values()) or st["queues"]["input"]
                for st in statuses.values()
            )
            return None if busy else statuses

        secret = load_secret(tmp_path / "bus.key")
        after = until(settled, 20, "every queue empty")
        hops = N + 1  # the creation request, then N increments
        assert after[0]["messages"]["sent"] == after[0]["messages"]["sent_remote"] == hops
        for router in (1, 3):
            msgs = after[router]["messages"]
            assert msgs["received_remote"] == msgs["sent_remote"] == hops
            assert msgs["sent"] == msgs["delivered"] == 0  # forwarded, never delivered here
        assert after[2]["messages"]["received_remote"] == 0  # D1 links 1 and 3 directly
        assert after[4]["messages"]["received_remote"] == after[4]["messages"]["delivered"] == hops
        assert all(st["queues"]["held_back"] == 0 for st in after.values())
        # The default log store: files are preallocated, live bytes follow the new agent.
        assert after[4]["storage_live_bytes"] > before[4]["storage_live_bytes"] > 0
        assert after[4]["storage_bytes"] >= after[4]["storage_live_bytes"]

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports[5]}/metrics", timeout=10)
        text = metrics.read().decode()
        assert f'aaabus_notifications_sent_total{{server="0"}} {hops}.0' in text
        assert 'aaabus_link_up{peer="1",server="0"} 1.0' in text

        # SIGUSR1: every thread's stack on stderr, and the server goes on.
        bus[2].proc.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
        until(lambda: any("most recent call first" in ln for ln in bus[2].lines), 10, "dump")
        assert bus[2].running()

        stopped = aaabus_cli("stop", str(config), "--id", "4")
        assert stopped.returncode == 0 and "server 4: stopped" in stopped.stdout
        assert bus[4].proc.wait(10) == 0  # type: ignore[union-attr]
        assert status_json(config, "--id", "4") == {4: {"id": 4, "up": False}}
        table = aaabus_cli("status", str(config))
        assert table.returncode == 0
        assert [ln.split()[:3] for ln in table.stdout.splitlines()[1:]][-1] == ["4", "down"]

        everything = aaabus_cli("stop", str(config))
        assert everything.returncode == 0, everything.stderr
        assert "server 4: not running" in everything.stdout
        for sid in range(4):
            assert bus[sid].proc.wait(10) == 0  # type: ignore[union-attr]


def test_client_requests_are_idempotent_and_remembered_across_restarts(
    tmp_path: Path, make_config: Any
) -> None:
    port = free_ports(1)[0]
    props = (
        f'<property name="aaabus.admin.port" value="{port}"/>'
        '<property name="aaabus.client.remember" value="3"/>'
    )
    cfg = load_config(make_config(extra={0: props}))

    def boot() -> tuple[AgentServer, Inbox]:
        server = AgentServer(cfg, 0, storage=tmp_path / "s0", endpoints=True)
        server.start()
        inbox = Inbox()
        server.add_listener(inbox)
        return server, inbox

    server, inbox = boot()
    try:
        with Client(cfg, 0) as client:
            probe = client.deploy(Probe(), request_id="deploy")
            assert client.deploy(Probe(), request_id="deploy") == probe  # the first one's id
            assert client.send(probe, Marker("first"), request_id="r1") is True
            # A retry whose first answer was lost: acknowledged, not sent again.
            assert client.send(probe, Marker("retry"), request_id="r1") is False
            seen = inbox.get()
            assert isinstance(seen, Seen) and seen.note == Marker("first")
            assert seen.sender == AgentId.server_of(0)
            # Not sent again: the next the probe saw is a marker sent after the retry (one
            # client's sends reach the probe in order, so a second "retry" would come first).
            assert client.send(probe, Marker("marker 1"), request_id="m1") is True
            assert inbox.get().note == Marker("marker 1")
            with pytest.raises(RequestRefused, match="server 9, which is not in the bus"):
                client.send(AgentId(0, 9, 16), Marker())
        server.stop()
        server, inbox = boot()
        with Client(cfg, 0) as client:
            assert client.send(probe, Marker("after restart"), request_id="r1") is False
            for key in ("r2", "r3", "r4"):
                assert client.send(probe, Marker(key), request_id=key) is True
            # Only the last three ids are kept (aaabus.client.remember=3): r1 is forgotten.
            assert client.send(probe, Marker("r1 again"), request_id="r1") is True
            assert client.send(probe, Marker("marker 2"), request_id="m2") is True
            labels = [inbox.get().note.label for _ in range(5)]
            assert labels == ["r2", "r3", "r4", "r1 again", "marker 2"]  # and nothing between
    finally:
        server.stop()


def test_the_admin_port_admits_only_clients_holding_the_secret(
    tmp_path: Path, make_config: Any
) -> None:
    port = free_ports(1)[0]
    cfg = load_config(
        make_config(extra={0: f'<property name="aaabus.admin.port" value="{port}"/>'})
    )
    server = AgentServer(cfg, 0, storage=tmp_path / "s0", endpoints=True)
    server.start()
    try:
        address, explicit = admin_address(cfg, 0)
        assert address == ("127.0.0.1", port) and explicit
        with pytest.raises(AdminError, match="does not use this bus secret"):
            AdminLink.connect(address, b"another bus" * 3, 0)
        # The right secret, but a server's id: servers have no business on the admin port.
        with socket.create_connection(address, timeout=10) as sock:
            credential = Credential(load_secret(tmp_path / "bus.key"))
            handshake = ConnectorHandshake(credential.admin_key(0), 1, 0, credential.scope)
            decoder = FrameDecoder(1024)
            frames: list[bytes] = []
            while not frames:
                frames = decoder.feed(sock.recv(1024))
            sock.sendall(handshake.receive(frames[0]))
            assert sock.recv(1024) == b""  # closed without a proof
        link = AdminLink.connect(address, load_secret(tmp_path / "bus.key"), 0)
        try:
            assert link.request({"op": "nonsense"}) == {
                "ok": False,
                "error": "unknown request 'nonsense'",
            }
            status = link.request({"op": "status"})["status"]
            assert status["id"] == 0 and status["up"] and status["router"] is False
            # A client holds the secret, but what it sends is decoded as data: bytes that are
            # not a notification are refused in one line, that connection ends, and the
            # server goes on answering the next one.
            garbage = base64.b64encode(b")r\x99\n\xd6L.").decode()
            answer = link.request({"op": "send", "id": "x", "to": "#0.0.1", "note": garbage})
            assert answer["ok"] is False and "does not decode" in answer["error"], answer
            assert answer["close"] is True and link.wait_closed(10)
        finally:
            link.close()
        link = AdminLink.connect(address, load_secret(tmp_path / "bus.key"), 0)
        try:
            assert link.request({"op": "status"})["status"]["up"]
        finally:
            link.close()
    finally:
        server.stop()


def test_command_line_errors_are_one_line_with_status_2(
    tmp_path: Path, make_config: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(make_config(servers=2))

    def fails(*args: str) -> str:
        assert main(list(args)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    assert "server id 7 is not in" in fails("status", config, "--id", "7")
    assert "server id 7 is not in" in fails("stop", config, "--id", "7")
    send = ("send", config, "--notification", "tests.support.agents:Marker")
    assert "bad agent id" in fails(*send, "--to", "#0.1")
    assert "server 5 is not in" in fails(*send, "--to", "#0.5.16")
    assert "--args is not JSON" in fails(*send, "--to", "#0.1.16", "--args", "{label")
    assert "do not make a Marker" in fails(*send, "--to", "0.1.16", "--args", '{"nope": 1}')
    no_class = ("send", config, "--to", "#0.1.16", "--notification")
    assert "cannot be imported" in fails(*no_class, "tests.support.agents:Nothing")
    assert "cannot be imported" in fails(*no_class, "no_such_module:Marker")
    assert "is not a Notification class" in fails(*no_class, "tests.support.agents:Probe")
    (tmp_path / "bus.key").unlink()
    assert "bus key file not found" in fails("status", config)

    # A bus that is down is not an error for status and stop: it is what they report.
    (tmp_path / "bus.key").write_text("aaabus-secret-v1 " + "ab" * 32 + "\n")
    # A key others may read is refused, with the chmod that fixes it.
    assert "run `chmod 600 " in fails("status", config)
    (tmp_path / "bus.key").chmod(0o600)
    assert main(["status", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "servers": [{"id": 0, "up": False}, {"id": 1, "up": False}]
    }
    assert main(["stop", config]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "server 0: not running",
        "server 1: not running",
    ]
    assert main([*send, "--to", "#0.1.16", "--timeout", "0.3"]) == 1
    assert "server 1 did not answer" in capsys.readouterr().err
