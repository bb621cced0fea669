"""Several real server processes over 127.0.0.1: causal order, recovery, authentication."""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.secret import load_secret
from aaabus.testing.proxy import FaultProxy
from aaabus.tools.launch import Bus
from aaabus.wire.frames import AcceptorHandshake, ConnectorHandshake, FrameDecoder
from tests.support.bus import add_to_server, listen_port, wait_json
from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow


def figure13(tmp_path: Path, make_config: Callable[..., Path], order: str) -> list[str]:
    """A1 on s1 sends n1 to A3 on s3, then n2 to A2 on s2, which forwards n3 to A3; the s1->s3
    link is slowed down by a proxy. Returns the order in which A3 received n1 and n3."""
    config = make_config(servers=4, domain_attrs=f'order="{order}"')
    out = tmp_path / "order.json"
    proxy = FaultProxy(("127.0.0.1", listen_port(config, 3)), name="s1-s3")
    try:
        proxy.set_delay(0.3)
        # s1 dials s3 (lower ids dial higher ones): through the proxy.
        add_to_server(config, 1, f'<property name="aaabus.dial.3" value="127.0.0.1:{proxy.port}"/>')
        args = json.dumps({"a2": 2, "a3": 3, "out": str(out)})
        add_to_server(
            config, 1, f"<service class=\"tests.support.agents:fig13_setup\" args='{args}'/>"
        )
        with Bus(config, range(4), tmp_path / "store", cwd=REPO_ROOT) as bus:
            labels = wait_json(out, bus.servers.values(), 60)
        assert proxy.connections >= 1, "the s1-s3 link did not go through the proxy"
        return labels
    finally:
        proxy.stop()


def test_figure13_causal_order_holds_despite_a_slow_link(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    assert figure13(tmp_path, make_config, "causal") == ["n1", "n3"]


def test_figure13_fifo_domain_shows_the_delay_reorders(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    # Same traffic with per-link order only: n3 overtakes n1, so the test above is not vacuous.
    assert figure13(tmp_path, make_config, "fifo") == ["n3", "n1"]


def bounce_config(
    make_config: Callable[..., Path], tmp_path: Path, n: int, **kw: Any
) -> tuple[Path, Path]:
    done = tmp_path / "done.json"
    args = json.dumps({"echo": 1, "n": n, "done": str(done)})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    return make_config(servers=2, extra={0: service}, **kw), done


@pytest.mark.parametrize("stamps", ["delta", "full"])
def test_pingpong_survives_five_sigkills_of_the_pong_server(
    tmp_path: Path, make_config: Callable[..., Path], stamps: str
) -> None:
    rng = random.Random(7 if stamps == "delta" else 8)
    config, done = bounce_config(make_config, tmp_path, 2000, domain_attrs=f'stamps="{stamps}"')
    kills = 0
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT) as bus:
        pong = bus[1]
        for _ in range(5):
            threading.Event().wait(rng.uniform(0.05, 0.4))  # a random moment: the fault schedule
            if done.exists():
                break
            pong.kill()
            kills += 1
            pong.start().wait_ready(30)
        result = wait_json(done, bus.servers.values(), 120)
    assert kills >= 3, f"only {kills} kills landed before the run ended"
    assert result == {"count": 2000, "errors": 0}


# -- authentication -------------------------------------------------------------------------------


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Read until the server closes the connection (True) or the deadline passes (False)."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def read_frame(sock: socket.socket) -> bytes:
    decoder = FrameDecoder(1 << 16)
    sock.settimeout(10)
    while True:
        frames = decoder.feed(sock.recv(4096))
        if frames:
            return frames[0]


def test_intruders_are_refused_and_logged_while_peers_keep_working(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, done = bounce_config(make_config, tmp_path, 3000)
    secret = load_secret(tmp_path / "bus.key")
    port = listen_port(config, 1)
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT, log_level="INFO") as bus:
        # 1. garbage bytes
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(bytes(random.Random(1).randrange(256) for _ in range(300)))
            assert closed_by_peer(s)
        # 2. a wrong secret, claiming to be server 0
        with socket.create_connection(("127.0.0.1", port)) as s:
            hs = ConnectorHandshake(b"not the secret" * 3, 0, 1)
            s.sendall(hs.start())
            s.sendall(hs.receive(read_frame(s)))
            assert closed_by_peer(s)
        # 3. a replayed handshake: a valid answer, but to another challenge than this one
        rogue = AcceptorHandshake(secret, 1, None)
        recorded = ConnectorHandshake(secret, 0, 1)
        recorded.start()
        answer = recorded.receive(FrameDecoder(1 << 16).feed(rogue.start())[0])
        with socket.create_connection(("127.0.0.1", port)) as s:
            read_frame(s)  # the fresh challenge, ignored
            s.sendall(answer)
            assert closed_by_peer(s)
        # 4. an oversized frame
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(struct.pack(">I", 1 << 30) + b"x" * 1000)
            assert closed_by_peer(s)
        result = wait_json(done, bus.servers.values(), 120)
        log = "\n".join(bus[1].lines)
    assert result == {"count": 3000, "errors": 0}
    assert log.count("WARNING") >= 4, log
