"""The console's board (what the page shows, from the pollers' readings) and its extra."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aaabus import AgentServer
from aaabus.config.domains import Topology
from aaabus.config.reader import load_config
from aaabus.config.scopes import Scope
from aaabus.config.secret import Credential, load_secret
from aaabus.console.board import Board
from aaabus.console.poller import Poller, Reading
from tests.support.harness import REPO_ROOT, free_ports
from tests.test_packaging import WITHOUT


def _status(sent: int, delivered: int, links: dict[str, bool], **mqtt: Any) -> dict[str, Any]:
    return {
        "uptime_s": 5.0,
        "storage_bytes": 4096,
        "queues": {"input": 2, "held_back": 1, "outgoing": {"1": 3}},
        "messages": {"sent": sent, "delivered": delivered},
        "dead_letters": {"count": 0},
        "clocks": {"D0": 3},
        "links": links,
        "mqtt": mqtt,
        "detail": {
            "filters": ["a/#"],
            "roaming": [{"client": "d1", "anchor": 0, "holder": 2, "moving": False}],
            "clients": [{"client": "d1", "protocol": "5.0", "keep_alive": 30}],
            "truncated": False,
        },
    }


def test_figures_rates_and_a_server_going_down(make_config: Callable[..., Path]) -> None:
    config = load_config(make_config(layout=[[0, 1, 2], [2, 3]]))
    board = Board(config, Topology.from_config(config), {})
    assert [s["state"] for s in board.servers_json()] == ["unknown"] * 4
    links = {"1": True, "2": True}
    board.update(Reading(0, 10.0, "up", _status(100, 50, links, connected=1, publications_in=7)))
    board.update(Reading(0, 12.0, "up", _status(140, 60, links, connected=1, publications_in=9)))
    zero = board.servers_json()[0]
    assert zero["up"] and zero["figures"]["msgs_out_per_s"] == 20.0
    assert zero["figures"]["msgs_in_per_s"] == 5.0
    assert zero["figures"]["publications_in_per_s"] == 1.0
    assert zero["figures"]["queued"] == 5 and zero["figures"]["clock_size"] == 3
    assert zero["history"] == [[5.0, 20.0]]
    assert board.topics_json()["topics"] == [{"filter": "a/#", "servers": [0]}]
    assert board.clients_json()["clients"][0]["server"] == 0
    assert board.roaming_json()["sessions"][0]["holder"] == 2
    edges = {(e["server"], e["domain"]): e["up"] for e in board.graph_json()["edges"]}
    assert edges[(0, "D0")] is True and edges[(3, "D1")] is None  # 3 not read yet
    assert edges[(2, "D0")] is None and (2, "D1") in edges  # the router is in both

    board.update(Reading(0, 13.0, "down", error="server 0 does not answer"))
    zero = board.servers_json()[0]
    assert not zero["up"] and zero["figures"] is None and zero["error"].endswith("answer")
    assert board.clients_json()["clients"] == []  # nothing stale from a server that is down
    # Back up after a restart: counters start again, no negative rate, none until two readings.
    board.update(Reading(0, 20.0, "up", _status(3, 1, {"1": False, "2": True})))
    zero = board.servers_json()[0]
    assert zero["figures"]["msgs_out_per_s"] == 0.0
    edges = {(e["server"], e["domain"]): e["up"] for e in board.graph_json()["edges"]}
    assert edges[(0, "D0")] is False


def test_the_console_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT, "aiohttp", "console", str(tmp_path / "a3.xml")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "aaabus console: error: aaabus console needs aiohttp, not installed here: "
        "pip install 'aaabus[console]'\n"
    )


def test_the_grafana_dashboard_queries_only_metrics_the_servers_export() -> None:
    from aaabus.node import metrics

    source = Path(metrics.__file__).read_text()
    counters = {name for _path, name, _help in metrics._COUNTERS}
    exported = set(re.findall(r'"(aaabus_[a-z_]+)"', source)) - counters
    exported |= {f"{name}_total" for name in counters}
    board = json.loads((REPO_ROOT / "docs" / "grafana" / "aaabus-dashboard.json").read_text())
    queried = {
        name
        for panel in board["panels"]
        for target in panel["targets"]
        for name in re.findall(r"aaabus_[a-z_]+", target["expr"])
    }
    assert queried and queried <= exported, queried - exported
    assert "aaabus_up" in queried and "aaabus_link_up" in queried


def test_a_poller_reads_on_across_the_end_of_its_admin_session(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """The server ends an admin session at its lifetime (aaabus.admin.lifetime): the poller's
    next reading fails at once on the old session, and is taken again on a new one rather than
    showing a running server down."""
    (port,) = free_ports(1)
    props = (
        f'<property name="aaabus.admin.port" value="{port}"/>'
        '<property name="aaabus.admin.lifetime" value="1"/>'
    )
    config = load_config(make_config(extra={0: props}))
    server = AgentServer(config, 0, storage=tmp_path / "s0", endpoints=True)
    server.start()
    try:
        read = Credential(load_secret(tmp_path / "bus.key")).claiming(Scope.READ)
        poller = Poller(config, 0, read, lambda _reading: None)
        first = poller.read()
        assert first.state == "up", first.error
        session = poller._link
        readings = []
        # Until the poller had to open a new session (the first one reached its lifetime).
        deadline = time.monotonic() + 20
        while poller._link is session and time.monotonic() < deadline:
            readings.append(poller.read())
        assert poller._link is not session, "the session was never ended by the server"
        assert [r.state for r in readings] == ["up"] * len(readings), readings[-1].error
    finally:
        server.stop()
