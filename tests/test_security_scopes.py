"""Credentials that confine, against real server processes on 127.0.0.1.

* A server's key file opens no other server's admin port: holding ``s1.key`` (``aaabus secret
  --server 1``), every key in it is refused by server 0's admin port, however it is used. (On
  the code before scoped tools, ``s1.key`` held the tool key, and server 0 took it.)
* A tool key has a scope: a read key can look (status, subscribe), not touch (send, deploy,
  stop); an operate key cannot deploy code; each refusal is one line naming the op, the scope
  needed and the scope held.
* A tool authenticates the server it talks to: an endpoint holding another server's key file, a
  key of a lower scope, or no key, posing as server 0, cannot complete the handshake; the tool
  fails with one line and has sent nothing.
* Another wire version is refused at every door, in one line naming both versions: a server's
  network port and admin port (a version-2 ANSWER), a server dialling a peer and a tool
  connecting (a version-2 CHALLENGE).

The attacker (raw sockets, a fake endpoint) is built here, holding only the files it names.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus import Agent
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.scopes import Scope
from aaabus.config.secret import Credential, load_credential, load_secret, load_server_keys
from aaabus.errors import AdminError, RequestRefused
from aaabus.io.adminlink import CLIENT_ID_BASE, AdminLink
from aaabus.tools.buswide import bus_status
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from aaabus.wire import frames as wire
from tests.support.agents import Probe
from tests.support.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # real server processes

TOOL = CLIENT_ID_BASE + 7


def aaabus(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aaabus", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def one_line_error(run: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a tool that failed (non-zero exit, no traceback)."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1, (run.returncode, run.stdout, run.stderr)
    return lines[0]


def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` (it reads another process) until it holds, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        pause.wait(0.05)
    return value


def all_up(cfg: BusConfig, credential: Any) -> bool:
    return all(st["up"] for st in bus_status(cfg, sorted(cfg.servers), credential))


def read_frame(sock: socket.socket, decoder: wire.FrameDecoder) -> bytes | None:
    """The next handshake message, or ``None`` once the other end hung up."""
    while (payload := decoder.pop()) is None:
        data = sock.recv(4096)
        if not data:
            return None
        decoder.push(data)
    return payload


def claim_admin(address: tuple[str, int], key: bytes, server: int, role: int) -> bool:
    """Prove ``key`` as the admin key of ``server`` with ``role``; whether the server proved
    itself back (that is, let us in)."""
    with socket.create_connection(address, timeout=10) as sock:
        decoder = wire.FrameDecoder(wire.HANDSHAKE_MAX_FRAME)
        handshake = wire.ConnectorHandshake(key, TOOL, server, role)
        challenge = read_frame(sock, decoder)
        assert challenge is not None, "no challenge"
        sock.sendall(handshake.receive(challenge))
        proof = read_frame(sock, decoder)
        if proof is None:
            return False
        handshake.receive(proof)
        return handshake.done


def old_answer(challenge: bytes, me: int) -> bytes:
    """A version-2 ANSWER to ``challenge`` (78 bytes: no role byte), as a release of that
    version sends it; its MAC does not matter, the version is refused first."""
    _, _, _, acceptor, _ = wire._CHALLENGE.unpack(challenge)
    answer = struct.pack(">4sBBII32s32s", wire.MAGIC, 2, 2, me, acceptor, bytes(32), bytes(32))
    return wire.encode_frame(answer)


class FakeEndpoint:
    """A listener at ``address`` that answers handshakes as server ``claims`` would, holding
    only what ``key_for(role)`` gives it (``None``: no key at all), in wire ``version``.

    It does its best: it sends a PROOF computed with its key over the real nonces. It records
    every connection's bytes after that PROOF: what a tool that was fooled would have sent.
    """

    def __init__(
        self,
        address: tuple[str, int],
        claims: int,
        key_for: Callable[[int], bytes] | None,
        version: int = wire.VERSION,
    ) -> None:
        self._listener = socket.create_server(address)
        self._listener.settimeout(30)
        self.claims, self.key_for, self.version = claims, key_for, version
        self.after_proof: list[bytes] = []
        self.answers = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with conn:
                conn.settimeout(10)
                self._handshake(conn)

    def _handshake(self, conn: socket.socket) -> None:
        nonce_a = secrets.token_bytes(wire.NONCE_BYTES)
        challenge = wire._CHALLENGE.pack(wire.MAGIC, self.version, 1, self.claims, nonce_a)
        conn.sendall(wire.encode_frame(challenge))
        answer = read_frame(conn, wire.FrameDecoder(wire.HANDSHAKE_MAX_FRAME))
        if answer is None:
            return  # the tool refused our challenge
        self.answers += 1
        _, _, _, tool, me, role, nonce_c, _ = wire._ANSWER.unpack(answer)
        key = self.key_for(role) if self.key_for else secrets.token_bytes(32)
        context = wire._CONTEXT.pack(wire.VERSION, tool, me, role)
        mac = wire._mac(key, wire._LABEL_ACCEPTOR, nonce_c, nonce_a, context)
        conn.sendall(wire.encode_frame(wire._PROOF.pack(wire.MAGIC, wire.VERSION, 3, mac)))
        received = b""
        try:
            while data := conn.recv(65536):
                received += data
        except OSError:
            pass
        self.after_proof.append(received)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
        self._listener.close()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the fake endpoint did not stop"


def own_key_files(make_config: Callable[..., Path], tmp_path: Path, servers: int) -> Path:
    """A config whose servers each read their own key file, made with ``aaabus secret``."""
    own = {sid: f'<property name="aaabus.secret" value="s{sid}.key"/>' for sid in range(servers)}
    config = make_config(servers=servers, extra=own)
    for sid in range(servers):
        made = aaabus(
            "secret", "--server", str(sid), "--config", str(config), "--out", f"s{sid}.key",
            cwd=tmp_path,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
    return config


def test_a_server_key_file_opens_no_other_servers_admin_port(
    tmp_path: Path, make_config: Any
) -> None:
    config = own_key_files(make_config, tmp_path, 2)
    cfg = load_config(config)
    bus_key = load_secret(tmp_path / "bus.key")
    admin0, _ = admin_address(cfg, 0)
    admin1, _ = admin_address(cfg, 1)
    assert admin0 is not None and admin1 is not None
    # Everything the holder of s1.key has: every 32-byte value in the file, whatever its line.
    captured = [
        bytes.fromhex(word)
        for word in re.findall(r"\b[0-9a-f]{64}\b", (tmp_path / "s1.key").read_text())
    ]
    own = load_server_keys(tmp_path / "s1.key", 1, cfg.servers)
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT):
        until(lambda: all_up(cfg, bus_key), 30, "the bus never came up")
        for key in captured:
            for scope in Scope:
                # As a tool key (the admin key of server 0 derived from it) ...
                with pytest.raises(AdminError, match="refused the authentication"):
                    AdminLink.connect(admin0, Credential(key, scope, tool=True), 0, timeout=10)
                # ... or as server 0's admin key itself.
                assert not claim_admin(admin0, key, 0, scope)
            # Nor as a server on the admin port (link keys are for network ports).
            assert not claim_admin(admin0, key, 0, wire.ROLE_SERVER)
        # Its own admin keys are server 1's: that server is already theirs, nothing more.
        assert claim_admin(admin1, own.admin_key(Scope.READ), 1, Scope.READ)
        # The shell tools refuse a server key file outright.
        refused = aaabus("status", str(config), "--id", "0", "--key", str(tmp_path / "s1.key"))
        assert "this is one server's key file" in one_line_error(refused)
        assert all_up(cfg, bus_key)


def test_each_scope_gets_its_requests_and_no_more(tmp_path: Path, make_config: Any) -> None:
    by_value = '<property name="aaabus.trust.by_value" value="true"/>'
    config = make_config(servers=2, extra={1: by_value})
    cfg = load_config(config)
    for scope in Scope:
        made = aaabus("secret", "--tool", "--scope", scope.label, "--out", f"{scope.label}.key",
                      cwd=tmp_path)  # fmt: skip
        assert made.returncode == 0, made.stderr
    read, operate, code = (load_credential(tmp_path / f"{s.label}.key") for s in Scope)
    key = {s: ("--key", str(tmp_path / f"{s.label}.key")) for s in Scope}

    class Local(Agent):  # defined in a function: it can only travel by value, as code
        pass

    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT):
        until(lambda: all_up(cfg, read), 30, "the bus never came up for a read key")
        assert " up " in aaabus("status", str(config), *key[Scope.READ]).stdout

        # read: looks, never touches; the request never reaches the server.
        for args, op in (
            (("stop", str(config), "--id", "0"), "stop"),
            (("send", str(config), "--to", "#0.0.16", "--notification",
              "tests.support.agents:Marker"), "send"),
        ):  # fmt: skip
            line = one_line_error(aaabus(*args, *key[Scope.READ]))
            assert f"{op} needs scope operate, this session holds read" in line, line
            assert "aaabus secret --tool --scope operate" in line, line
        with Client(cfg, 0, secret=read) as client:
            with pytest.raises(RequestRefused, match="deploy needs scope operate, this session "
                               "holds read"):  # fmt: skip
                client.deploy(Probe())
            subscription = client.subscribe("news/#")  # read may subscribe ...
            subscription.close()  # ... and close what it opened (an unsubscribe)
            with pytest.raises(RequestRefused, match="unsubscribe needs scope operate"):
                client.unsubscribe("someone-elses")

        # operate: everything but code, even where the server would load code.
        with Client(cfg, 1, secret=operate) as client:
            assert client.deploy(Probe(), server=1).server == 1
            with pytest.raises(RequestRefused) as refused:
                client.deploy(Local(), server=1, by_value=True)
            line = str(refused.value)
            assert "deploy of a pickle (code, e.g. an agent by value) needs scope code, this " \
                "session holds operate" in line and "--scope code" in line, line  # fmt: skip

        # code: deploys code where the server's operator allowed it (server 1), nowhere else.
        with Client(cfg, 1, secret=code) as client:
            assert client.deploy(Local(), server=1, by_value=True).server == 1
        refused_here = pytest.raises(RequestRefused, match=r"aaabus\.trust\.by_value")
        with Client(cfg, 0, secret=code) as client, refused_here:
            client.deploy(Local(), by_value=True)
        # A bus key held by a tool claims operate, unless the program asks for code.
        bus_key = load_secret(tmp_path / "bus.key")
        not_code = pytest.raises(RequestRefused, match="this session holds operate")
        with Client(cfg, 1, secret=bus_key) as client, not_code:
            client.deploy(Local(), server=1, by_value=True)
        with Client(cfg, 1, secret=Credential(bus_key, Scope.CODE)) as client:
            assert client.deploy(Local(), server=1, by_value=True).server == 1
        assert all_up(cfg, read)  # nothing was stopped


@pytest.mark.parametrize(
    "holding", ["server 1's key file", "a read key", "no key", "server 1's admin port"]
)
def test_a_fake_admin_endpoint_cannot_complete_the_handshake(
    tmp_path: Path, make_config: Any, holding: str
) -> None:
    config = own_key_files(make_config, tmp_path, 2)
    cfg = load_config(config)
    bus_key = load_secret(tmp_path / "bus.key")
    made = aaabus("secret", "--tool", "--out", "tool.key", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    made = aaabus("secret", "--tool", "--scope", "read", "--out", "read.key", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    address, _ = admin_address(cfg, 0)
    assert address is not None
    s1 = load_server_keys(tmp_path / "s1.key", 1, cfg.servers)
    fakes: dict[str, tuple[int, Callable[[int], bytes] | None]] = {
        # It has server 1's admin keys and claims to be server 0 ...
        "server 1's key file": (0, lambda role: s1.admin_key(Scope(role))),
        # ... or a read key, from which it derives server 0's admin key of scope read ...
        "a read key": (0, lambda _role: load_credential(tmp_path / "read.key").admin_key(0)),
        "no key": (0, None),
        # ... or it is server 1 itself, listening where the tool expects server 0.
        "server 1's admin port": (1, lambda role: s1.admin_key(Scope(role))),
    }
    claims, key_for = fakes[holding]
    fake = FakeEndpoint(address, claims, key_for)
    try:
        tool = load_credential(tmp_path / "tool.key")
        with pytest.raises(AdminError) as failed, Client(cfg, 0, secret=tool) as client:
            client.status()
        line = str(failed.value)
        expected = "failed to prove it is server 0" if claims == 0 else "server 1 answered"
        assert "\n" not in line and expected in line, line
        run = aaabus("status", str(config), "--id", "0", "--key", str(tmp_path / "tool.key"))
        assert expected in one_line_error(run)
        with pytest.raises(AdminError, match=expected):
            bus_status(cfg, [0], Credential(bus_key))
    finally:
        fake.stop()
    # The tool sent nothing after the fake's proof: no request, so nothing to learn or to
    # answer with. (The fake claiming server 1 got no ANSWER at all: refused at its challenge.)
    assert fake.after_proof == [b""] * fake.answers
    assert fake.answers == (3 if claims == 0 else 0)


def test_another_wire_version_is_refused_at_every_door(tmp_path: Path, make_config: Any) -> None:
    config = make_config(servers=2)
    cfg = load_config(config)
    network0 = ("127.0.0.1", cfg.server(0).networks[0].port)
    network1 = ("127.0.0.1", cfg.server(1).networks[0].port)
    admin0, _ = admin_address(cfg, 0)
    admin1, _ = admin_address(cfg, 1)
    assert admin0 is not None and admin1 is not None
    both = f"wire version 2, this side wire version {wire.VERSION}"
    # Server 1 is an older release: it challenges in version 2, on its network and admin ports.
    old_peer = FakeEndpoint(network1, 1, None, version=2)
    old_admin = FakeEndpoint(admin1, 1, None, version=2)
    try:
        with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT) as bus:

            def logged(*parts: str) -> bool:
                return any(all(p in line for p in parts) for line in bus[0].lines)

            # An older server (or tool) answering server 0's challenges, on both ports.
            for address, door in ((network0, "refused connection"), (admin0, "admin port")):
                with socket.create_connection(address, timeout=10) as sock:
                    me = f"127.0.0.1:{sock.getsockname()[1]}"
                    decoder = wire.FrameDecoder(wire.HANDSHAKE_MAX_FRAME)
                    challenge = read_frame(sock, decoder)
                    assert challenge is not None and challenge[4] == wire.VERSION
                    sock.sendall(old_answer(challenge, TOOL))
                    assert read_frame(sock, decoder) is None  # hung up, no proof
                until(lambda: logged(door, me, both), 20, f"no refusal of {me} logged")  # noqa: B023
            # Server 0 dialling the older server 1 refuses it too, and logs why.
            until(lambda: logged("dialling server 1", both), 20, "no refused dial logged")
            # A tool talking to the older server 1: one line, non-zero exit.
            assert both in one_line_error(aaabus("status", str(config), "--id", "1"))
    finally:
        old_peer.stop()
        old_admin.stop()
    assert old_admin.answers == 0  # the tool refused its challenge: it answered nothing
