"""Credentials that mean what they say: a tool key or another pair's key cannot pass for a server.

A real three-server bus on 127.0.0.1, each server holding only its own key file (``aaabus secret
--server ID``). The attacker is the test holding raw sockets and one credential: the tool key
(what every tool user holds), or each key of server 0's key file (what a captured server 0
holds). With it, it claims to be server 1 to server 2. Before pairwise keys every tool and
server held the one bus key, and the same claim replaced the real server 1's link.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.reader import BusConfig, load_config
from aaabus.config.scopes import Scope
from aaabus.config.secret import (
    admin_key,
    link_key,
    load_credential,
    load_secret,
    load_server_keys,
    tool_key,
)
from aaabus.tools.buswide import bus_status
from aaabus.tools.launch import Bus
from aaabus.wire.frames import HANDSHAKE_MAX_FRAME, ConnectorHandshake, FrameDecoder, encode_epoch
from tests.support.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # real server processes

ATTACKED, CLAIMED = 2, 1


def claim(address: tuple[str, int], key: bytes, me: int, peer: int) -> tuple[bool, str]:
    """Run the connector's side of the handshake with ``key``, claiming id ``me``.

    Returns whether the server proved itself back (the claim was accepted) and our address.
    """
    with socket.create_connection(address, timeout=10) as sock:
        local = f"{sock.getsockname()[0]}:{sock.getsockname()[1]}"
        decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        handshake = ConnectorHandshake(key, me, peer)

        def message() -> bytes | None:
            while True:
                payload = decoder.pop()
                if payload is not None:
                    return payload
                data = sock.recv(4096)
                if not data:
                    return None
                decoder.push(data)

        challenge = message()
        assert challenge is not None, "no challenge"
        sock.sendall(handshake.receive(challenge))
        proof = message()  # None: the server hung up on our answer
        if proof is None:
            return False, local
        handshake.receive(proof)
        if handshake.done:  # as a server does: its link's first frame names its epoch
            sock.sendall(handshake.cipher().wrap_frame(encode_epoch(1, 0)))
        return handshake.done, local


def make_key(directory: Path, *args: str) -> None:
    """Run ``aaabus secret ARGS`` in ``directory``; the file it writes must be private."""
    made = subprocess.run(
        [sys.executable, "-m", "aaabus", "secret", *args],
        cwd=directory, capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    out = directory / args[args.index("--out") + 1]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def links_of(cfg: BusConfig, server: int, secret: bytes) -> dict[str, bool]:
    [status] = bus_status(cfg, [server], secret, timeout=5.0)
    return dict(status["links"]) if status["up"] else {}


def test_a_tool_key_or_another_pairs_key_cannot_pass_for_a_server(
    tmp_path: Path, make_config: Any
) -> None:
    own = {sid: f'<property name="aaabus.secret" value="s{sid}.key"/>' for sid in range(3)}
    config = make_config(servers=3, extra=own)
    cfg = load_config(config)
    bus_key = load_secret(tmp_path / "bus.key")
    target = ("127.0.0.1", cfg.server(ATTACKED).networks[0].port)
    for sid in range(3):  # each server gets its links' keys, never the bus key
        make_key(tmp_path, "--server", str(sid), "--config", str(config), "--out", f"s{sid}.key")
        assert bus_key.hex().encode() not in (tmp_path / f"s{sid}.key").read_bytes()
    captured = load_server_keys(tmp_path / "s0.key", 0, range(3))

    # The tool key comes from the bus key, in a private file, and is enough for the tools.
    make_key(tmp_path, "--tool", "--out", "tool.key")
    tool = load_credential(tmp_path / "tool.key")
    operate = tool_key(bus_key, Scope.OPERATE)
    assert tool.is_tool and tool.scope is Scope.OPERATE
    assert tool.admin_key(ATTACKED) == admin_key(operate, ATTACKED)
    assert b"aaabus-tool-key-v2 operate " in (tmp_path / "tool.key").read_bytes()
    assert bus_key.hex().encode() not in (tmp_path / "tool.key").read_bytes()

    with Bus(config, [0, 1, 2], tmp_path / "store", cwd=REPO_ROOT) as bus:
        deadline = time.monotonic() + 20
        while links_of(cfg, ATTACKED, bus_key) != {"0": True, "1": True}:
            assert time.monotonic() < deadline, "the bus never linked"
            time.sleep(0.05)
        status = subprocess.run(
            [sys.executable, "-m", "aaabus", "status", str(config), "--key",
             str(tmp_path / "tool.key")],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert status.returncode == 0 and " up " in status.stdout, (status.stdout, status.stderr)

        # The tool key (and the admin key it gives for server 2) on a network port, and every
        # link key of server 0's file: all refused.
        for name, key in (
            ("tool key", operate),
            ("server 2's admin key", tool.admin_key(ATTACKED)),
            ("server 0's key of its link to 1", captured.link_key(1)),
            ("server 0's key of its link to 2", captured.link_key(ATTACKED)),
        ):
            accepted, local = claim(target, key, CLAIMED, ATTACKED)
            assert not accepted, f"{name} passed for server {CLAIMED}"
        deadline = time.monotonic() + 10  # the server's lines reach us through a pipe
        while "\n".join(bus[ATTACKED].lines).count("failed authentication") < 4:
            assert time.monotonic() < deadline, list(bus[ATTACKED].lines)
            time.sleep(0.05)
        server_log = "\n".join(bus[ATTACKED].lines)
        assert "replaced" not in server_log, server_log
        assert links_of(cfg, ATTACKED, bus_key) == {"0": True, "1": True}

        # The pair's own key (the real server 1, restarted or stolen) does take the link over,
        # and server 2 says so as a WARNING naming both ends.
        real = [line for line in server_log.splitlines() if "server 1 at" in line]
        accepted, local = claim(target, link_key(bus_key, CLAIMED, ATTACKED), CLAIMED, ATTACKED)
        assert accepted
        deadline = time.monotonic() + 10
        while not any("replaced" in line for line in bus[ATTACKED].lines):
            assert time.monotonic() < deadline, "no line about the replaced link"
            time.sleep(0.05)
        [line] = [line for line in bus[ATTACKED].lines if "replaced" in line]
        assert "WARNING" in line and f"from {local} claiming the same server id" in line, line
        assert f"server {CLAIMED} at 127.0.0.1:" in line, (line, real)


def test_a_server_given_a_tool_key_refuses_to_start(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    (tmp_path / "bus.key").rename(tmp_path / "real.key")
    made = subprocess.run(
        [sys.executable, "-m", "aaabus", "secret", "--tool", "--out", "bus.key",
         "--from", "real.key"],
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    run = subprocess.run(
        [sys.executable, "-m", "aaabus", "server", "--id", "0", "--config", str(config),
         "--storage", str(tmp_path / "s0")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "this is a tool key" in lines[0] and "a server needs the bus key" in lines[0]
