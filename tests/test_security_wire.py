"""Notifications travel as data: the attack review's payloads, aimed at real server processes.

Each payload (tests/support/hostile.py) ran code in, stopped, bloated or rewrote the server that
loaded it with the allow-list unpickler the bus had before its data codec. Here they arrive by
every door a key holder has -- the admin port's send, publish and deploy, a peer's frames, the
answers a tool reads from whoever completes its handshake -- and each must be refused with one
line while nothing runs: the marker files stay absent, the server keeps its process, its memory
and its classes.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus import AdminError, AgentId, AgentServer, Client, RequestRefused
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import load_config
from aaabus.config.secret import admin_key, load_secret, tool_key
from aaabus.io.adminlink import AdminLink
from aaabus.tools.launch import Bus
from aaabus.wire.codec import encode_note
from aaabus.wire.message import Message
from tests.support.agents import Marker
from tests.support.harness import REPO_ROOT
from tests.support.hostile import runs_code_under_stock_pickle, walking_pickle, whole_pickle
from tests.support.records import (
    BOMBS,
    MAIN_MODULE,
    PARSE_BY_INT,
    walk_through_a_trusted_module,
    walk_to_function,
)


def _walks(tmp_path: Path) -> dict[str, bytes]:
    """The two walks, each first shown to run code under stock ``pickle.loads`` (in a child
    process): their marker staying absent later is then the bus's doing."""
    markers = {"walk": tmp_path / "pwned-walk", "module-walk": tmp_path / "pwned-module"}
    walks = {
        "walk": walking_pickle(walk_to_function(markers["walk"])),
        "module-walk": walking_pickle(walk_through_a_trusted_module(markers["module-walk"])),
    }
    for name, payload in walks.items():
        assert runs_code_under_stock_pickle(payload, markers[name]), (
            f"{name}: stock pickle runs no code with it, so its absent marker proves nothing"
        )
    return walks


def _payloads(tmp_path: Path) -> dict[str, bytes]:
    return {
        **_walks(tmp_path),
        "__main__": whole_pickle(MAIN_MODULE),
        "bytearray": whole_pickle(BOMBS["bytearray(2e9)"]),
        "build-on-class": whole_pickle(PARSE_BY_INT),
        "garbage": b"\x92\xa5nope:\xc1",
        "unregistered": encode_note(Marker("x")).replace(b"agents:Marker", b"agents:Makrer"),
    }


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _wait_for(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a wait that cannot be cut short
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            return value
        pause.wait(0.05)  # the server works on its own: poll its status until the deadline


@pytest.mark.slow
def test_admin_requests_carry_data_only(tmp_path: Path, make_config: Any) -> None:
    config = make_config(servers=1)
    payloads = _payloads(tmp_path)
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT), Client(config, 0) as client:
        before = client.status()
        for name, payload in payloads.items():
            text = base64.b64encode(payload).decode()
            requests = [
                {"op": "send", "to": "#0.0.1", "note": text},
                {"op": "publish", "topic": "t", "payload": text},
                {"op": "request", "to": "#0.0.1", "note": text},
                {"op": "deploy", "agent": text},
            ]
            for request in requests:
                if name == "unregistered" and request["op"] == "publish":
                    continue  # a payload is any data: that one is a list, and publishable
                with pytest.raises(RequestRefused) as refused:
                    client._request({**request, "id": f"{name}-{request['op']}"})
                line = str(refused.value)
                assert "\n" not in line and line.startswith("server 0: "), (name, request, line)
        # Nothing ran, the server is the same process with its memory and its classes intact.
        after = client.status()
        assert after["pid"] == before["pid"] and after["boots"] == before["boots"]
        assert client.send("#0.0.0", Marker("AgentId.parse still parses"))
        assert _peak_rss_mb(after["pid"]) < 500
    assert not list(tmp_path.glob("pwned-*"))


@pytest.mark.slow
def test_peer_frames_carry_data_only_and_a_bad_one_is_a_dead_letter(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(servers=2)
    payloads = _payloads(tmp_path)
    with Bus(config, [1], tmp_path / "store", cwd=REPO_ROOT), Client(config, 1) as client:
        pid = client.status()["pid"]
        # Server 0 holds the key and links to the real server 1: what it routes is a peer
        # frame, exactly what a stolen key file or a compromised peer can produce.
        server0 = AgentServer(load_config(config), 0, storage=tmp_path / "s0")
        server0.start()
        try:
            engine = server0.engine
            assert engine is not None
            sender = AgentId(0, 0, 16)
            messages = [
                Message(sender, target, payload)
                for payload in payloads.values()
                for target in (AgentId.factory(1), AgentId(1, 1, 99))
            ]
            messages.append(Message(sender, AgentId.server_of(1), encode_note(Marker("after"))))

            def route_all() -> None:
                for message in messages:
                    engine.route(message)

            server0.call(route_all)
            expected = 2 * len(payloads)
            status = _wait_for(
                lambda: (s := client.status())["dead_letters"]["count"] >= expected and s
            )
            assert status and status["dead_letters"]["count"] == expected, client.status()
            last = status["dead_letters"]["last"]
            assert "\n" not in last and "from #0.0.16" in last, last
            # The link is not stalled: the frame after them was delivered, once.
            assert _wait_for(lambda: client.status()["messages"]["delivered"] >= 1)
            assert status["pid"] == pid and status["boots"] == 1
            assert _peak_rss_mb(pid) < 500
        finally:
            server0.stop()
    assert not list(tmp_path.glob("pwned-*"))


class _AnsweringEndpoint:
    """A fake admin port that completes the handshake -- it holds the tool key, as any tool of
    that scope does -- and answers a subscription's fetch with ``item`` (its body's bytes)."""

    def __init__(self, address: tuple[str, int], bus_key: bytes, item: bytes) -> None:
        self._listener = socket.create_server(address)
        self._bus_key, self._item = bus_key, item
        self.served: list[str] = []
        self._thread = threading.Thread(target=self._serve, name="fake-admin", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return  # closed by stop()
        with sock:
            link, _, _ = AdminLink.accept(
                sock,
                lambda scope: admin_key(tool_key(self._bus_key, scope), 0),
                0,
                1 << 20,
                time.monotonic() + 10,
            )
            item = base64.b64encode(self._item).decode()
            answers = {
                "subscribe": {"ok": True, "existed": False},
                "fetch": {"ok": True, "items": [[1, item]], "dropped": 0, "exists": True},
            }
            with contextlib.suppress(OSError):
                while True:
                    op = link.receive()["op"]
                    self.served.append(op)
                    link.send(answers.get(op, {"ok": True}))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the fake endpoint did not stop"


def test_a_tool_reads_answers_as_data_whoever_answers(tmp_path: Path, make_config: Any) -> None:
    config = make_config(servers=1)
    cfg = load_config(config)
    address, _ = admin_address(cfg, 0)
    assert address is not None
    marker = tmp_path / "pwned-tool"
    answer = walking_pickle(walk_to_function(marker))
    assert runs_code_under_stock_pickle(answer, marker), "the answer runs no code under pickle"
    fake = _AnsweringEndpoint(address, load_secret(tmp_path / "bus.key"), answer)
    try:
        with (
            Client(cfg, 0) as client,
            client.subscribe("t") as subscription,
            pytest.raises(AdminError) as refused,
        ):
            subscription.get(5)
        line = str(refused.value)
        assert "\n" not in line and "carries data only" in line, line
        assert "fetch" in fake.served
    finally:
        fake.stop()
    assert not marker.exists()
