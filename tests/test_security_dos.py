"""No cheap denial of service: slowloris on the admin port, a connection flood on a network port.

Real server processes on 127.0.0.1; the attackers are threads of the test holding raw sockets.
Each test prints its latency figures (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentId, AgentServer
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import load_secret
from aaabus.testing.workload import Bounce, Echo
from aaabus.tools.buswide import bus_status
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, Inbox

pytestmark = pytest.mark.slow  # real server processes and tool subprocesses


class Attacker:
    """Opens connections to ``address`` from a named thread until :meth:`stop`.

    ``rate``: new connections per second; ``trickle``: every ``trickle`` seconds each open
    connection sends one byte (0: never sends). At most ``hold`` connections stay open: once
    there, a flood (``churn``) closes the oldest to open more, a slowloris just holds them.
    """

    def __init__(
        self, address: tuple[str, int], *, rate: float, trickle: float, hold: int, churn: bool
    ) -> None:
        self.churn = churn
        self.address = address
        self.rate = rate
        self.trickle = trickle
        self.hold = hold
        self.opened = 0
        self._stop = threading.Event()
        self._socks: deque[socket.socket] = deque()
        self._thread = threading.Thread(target=self._run, name="attacker", daemon=True)

    def __enter__(self) -> Attacker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self._socks:
            sock.close()

    def _run(self) -> None:
        interval = 1.0 / self.rate
        next_open = next_trickle = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_open and (self.churn or len(self._socks) < self.hold):
                next_open += interval
                try:
                    sock = socket.create_connection(self.address, timeout=1.0)
                except OSError:
                    continue
                sock.setblocking(False)
                self._socks.append(sock)
                self.opened += 1
                while len(self._socks) > self.hold:
                    self._socks.popleft().close()
            if self.trickle and now >= next_trickle:
                next_trickle += self.trickle
                for sock in self._socks:
                    with contextlib.suppress(OSError):
                        sock.send(b"\0")
            wake = min(next_open, next_trickle) if self.trickle else next_open
            self._stop.wait(min(0.1, max(0.0, wake - time.monotonic())))


def status_latency(cfg: BusConfig, server: int, secret: bytes) -> float:
    started = time.monotonic()
    [status] = bus_status(cfg, [server], secret, timeout=5.0)
    assert status["up"] is True, status
    return time.monotonic() - started


def round_trip(server0: AgentServer, inbox: Inbox, echo: Any, i: int) -> float:
    started = time.monotonic()
    server0.send(echo, Bounce(i))
    assert inbox.get(timeout=5.0) == Bounce(i)
    return time.monotonic() - started


def test_slowloris_on_the_admin_port_leaves_status_and_ping_pong_working(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(servers=2)
    cfg = load_config(config)
    secret = load_secret(tmp_path / "bus.key")
    admin, _ = admin_address(cfg, 1)
    assert admin is not None
    with Bus(config, [1], tmp_path / "store", cwd=REPO_ROOT):
        server0 = AgentServer(cfg, 0, storage=tmp_path / "s0")
        server0.start()
        inbox = Inbox()
        server0.add_listener(inbox)
        try:
            echo = server0.deploy(Echo(), 1)
            figures: dict[str, list[float]] = {"before": [], "during": [], "after": []}
            rtt: dict[str, list[float]] = {"before": [], "during": [], "after": []}
            for i in range(3):
                figures["before"].append(status_latency(cfg, 1, secret))
                rtt["before"].append(round_trip(server0, inbox, echo, i))
            # 40 connections, one byte every 0.5 s each: more than every admin slot of the old
            # endpoint, held open for as long as the attack lasts.
            with Attacker(admin, rate=200, trickle=0.5, hold=40, churn=False):
                deadline = time.monotonic() + 3.0
                i = 100
                while time.monotonic() < deadline:
                    figures["during"].append(status_latency(cfg, 1, secret))
                    rtt["during"].append(round_trip(server0, inbox, echo, i))
                    i += 1
                tool = subprocess.run(
                    [sys.executable, "-m", "aaabus", "status", str(config), "--id", "1"],
                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert tool.returncode == 0 and " up " in tool.stdout, (tool.stdout, tool.stderr)
            for i in range(3):
                figures["after"].append(status_latency(cfg, 1, secret))
                rtt["after"].append(round_trip(server0, inbox, echo, 200 + i))
        finally:
            server0.stop()
    for phase in figures:
        print(
            f"{phase}: status max {max(figures[phase]) * 1000:.1f} ms, "
            f"ping-pong max {max(rtt[phase]) * 1000:.1f} ms ({len(rtt[phase])} round trips)"
        )
    assert max(figures["during"]) < 2.0 and len(figures["during"]) >= 3


def test_a_restarted_peer_relinks_within_two_seconds_under_a_connection_flood(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(servers=2)
    cfg = load_config(config)
    secret = load_secret(tmp_path / "bus.key")
    victim = ("127.0.0.1", cfg.server(1).networks[0].port)

    def linked() -> bool:
        [status] = bus_status(cfg, [1], secret, timeout=5.0)
        return bool(status["up"] and status["links"]["0"])

    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT) as bus:
        deadline = time.monotonic() + 10
        while not linked():
            assert time.monotonic() < deadline, "the bus never linked"
            time.sleep(0.02)
        # 300 idle connections a second: the old 256 unauthenticated slots stay full.
        with Attacker(victim, rate=300, trickle=0, hold=2000, churn=True) as attack:
            # Let the flood fill the table (400 connections > 256 slots) before the restart.
            deadline = time.monotonic() + 10
            while attack.opened < 400:
                assert time.monotonic() < deadline, "the flood did not get going"
                time.sleep(0.02)
            bus[0].kill()
            bus[0].start()
            bus[0].wait_ready(30)
            ready = time.monotonic()
            while not linked():
                waited = time.monotonic() - ready
                assert waited < 2.0, f"server 0 not re-linked {waited:.1f}s after restart"
                time.sleep(0.02)
            relinked = time.monotonic() - ready
            opened = attack.opened
        print(f"re-linked {relinked * 1000:.0f} ms after restart, under {opened} connections")
        log = "\n".join(bus[1].lines)
        # The log summarises the flood instead of writing a line per refused connection.
        assert log.count("refused connection from") <= 20, log[-2000:]


def test_tools_report_busy_with_a_non_zero_exit_when_a_server_drops_them(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config()
    address, _ = admin_address(load_config(config), 0)
    assert address is not None
    # What a server drowning in connections does to a tool: accept, then hang up at once.
    with socket.create_server(address) as listener:
        stop = threading.Event()

        def drop() -> None:
            listener.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    listener.accept()[0].close()

        dropper = threading.Thread(target=drop, name="dropper", daemon=True)
        dropper.start()
        try:
            for command in (["status"], ["stop"]):
                run = subprocess.run(
                    [sys.executable, "-m", "aaabus", *command, str(config), "--id", "0",
                     "--timeout", "2"],
                    cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                assert run.returncode == 1, (command, run.stdout, run.stderr)
                assert "busy" in run.stdout and "down" not in run.stdout, run.stdout
                assert "not running" not in run.stdout
        finally:
            stop.set()
            dropper.join(5)


class CorruptingRelay:
    """Forwards connections to ``target``, passes each direction's first ``clean`` bytes (the
    handshake) intact, then flips the last bit of every chunk: handshakes succeed, sessions
    fail their first MAC. Counts the connections it relayed."""

    CLEAN = {"up": 82, "down": 88}  # ANSWER frame; CHALLENGE and PROOF frames

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(
                    target=self._pump, args=(src, dst, self.CLEAN[way]), name=f"relay-{way}",
                    daemon=True,
                ).start()  # fmt: skip

    def _pump(self, src: socket.socket, dst: socket.socket, clean: int) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if clean <= 0:
                    data = data[:-1] + bytes([data[-1] ^ 1])
                elif len(data) > clean:
                    tail = data[clean:]
                    data = data[:clean] + tail[:-1] + bytes([tail[-1] ^ 1])
                clean -= len(data)
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        for sock in self._socks:
            sock.close()


def test_a_corrupting_relay_does_not_earn_fast_redials(tmp_path: Path, make_config: Any) -> None:
    config = make_config(servers=2)
    relay = CorruptingRelay(("127.0.0.1", load_config(config).server(1).networks[0].port))
    try:
        # Server 0 dials server 1 through the relay.
        text = config.read_text()
        at = text.index("</server>", text.index('<server id="0"'))
        dial = f'<property name="aaabus.dial.1" value="127.0.0.1:{relay.port}"/>\n  '
        config.write_text(text[:at] + dial + text[at:])
        cfg = load_config(config)
        with Bus(config, [1], tmp_path / "store", cwd=REPO_ROOT):
            server0 = AgentServer(cfg, 0, storage=tmp_path / "s0")
            server0.start()
            try:
                # A message for server 1: every link that comes up resends it, and the relay
                # corrupts it, so every session dies at its first frame.
                server0.send(AgentId(1, 1, 999), Bounce(1))
                deadline = time.monotonic() + 10
                while relay.connections < 2:
                    assert time.monotonic() < deadline, "server 0 never dialled through the relay"
                    time.sleep(0.02)
                first = relay.connections
                time.sleep(3.0)  # the observation window itself, not a synchronisation
                redials = relay.connections - first
            finally:
                server0.stop()
    finally:
        relay.stop()
    print(f"\n{redials} redials in 3 s through a relay that corrupts every session")
    # Backoff 0.02 s doubling to 1 s (x0.5..1 jitter): about 8 in 3 s. The old reset on each
    # handshake redialled every 20 ms or so: about 150.
    assert 1 <= redials <= 15, redials
