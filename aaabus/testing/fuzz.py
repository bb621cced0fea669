"""Wire fuzzing against live servers: garbage, mutated frames and forged handshakes.

Shared by ``tests/test_fuzz.py`` (short runs) and ``python -m perf torture --fuzz-frames N``
(the long one). :class:`FuzzTarget` starts two real servers playing a rally and logs in to one
of them as a server that is declared but never started (:class:`FakePeer`, holding the bus
secret), so that mutated frames land in its channel exactly like a real peer's; unauthenticated
bytes go to the listening ports as an intruder's would. The verdict: no server crashed, every bad
input was dropped, and the rally went on exactly.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aaabus import AgentId
from aaabus.config.reader import load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.testing.bankload import Start
from aaabus.testing.crash import (
    read_progress,
    stop_all,
    wait_progress,
)
from aaabus.tools.launch import Bus, free_port_base


class FakePeer:
    """A client that authenticates to a live server as server ``me``, holding the bus secret.

    It then owns a real session: :meth:`send` MACs each payload with the session cipher, so the
    server's channel receives it exactly as if a real peer had sent it. A reader thread discards
    whatever the server sends back (acks, resends), so the server never blocks writing to us.
    """

    def __init__(self, addr: tuple[str, int], secret: bytes, me: int, peer: int) -> None:
        from aaabus.config.secret import link_key
        from aaabus.wire.frames import (
            HANDSHAKE_MAX_FRAME,
            ConnectorHandshake,
            FrameDecoder,
            encode_epoch,
        )

        self.sock = socket.create_connection(addr, timeout=5)
        decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        # The key of the pair (me, peer), derived from the bus key as a real server does.
        handshake = ConnectorHandshake(link_key(secret, me, peer), me, peer)

        def next_message() -> bytes:
            while True:
                payload = decoder.pop()
                if payload is not None:
                    return payload
                data = self.sock.recv(4096)
                if not data:
                    raise ConnectionError("the server closed the connection in the handshake")
                decoder.push(data)

        self.sock.sendall(handshake.receive(next_message()))  # challenge -> answer
        handshake.receive(next_message())  # proof
        self.cipher = handshake.cipher()
        # A link's first session frame says which epoch of its server id it speaks for.
        self.sock.sendall(self.cipher.wrap_frame(encode_epoch(1, 0)))
        self.sock.settimeout(None)
        self._reader = threading.Thread(target=self._drain, daemon=True, name="fake-peer-drain")
        self._reader.start()

    def _drain(self) -> None:
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass

    def send(self, payload: bytes) -> None:
        self.sock.sendall(self.cipher.wrap_frame(payload))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5)


def raw_poke(addr: tuple[str, int], data: bytes) -> None:
    """Connect, send ``data`` unauthenticated, close: what an intruder or a port scanner does."""
    try:
        with socket.create_connection(addr, timeout=5) as sock:
            sock.sendall(data)
    except OSError:
        pass  # the server may refuse or reset us first: that is its right


def template_frames(domain: str, target: AgentId, sender: AgentId) -> list[bytes]:
    """Well-formed channel payloads to mutate: a data frame with a real stamp, and an ack."""
    from aaabus.core.clock import DomainClock
    from aaabus.wire.codec import Codec
    from aaabus.wire.linkframes import ACK, encode_data
    from aaabus.wire.message import Message

    clock = DomainClock(2, 0)
    stamp = clock.prepare_send(1)
    data = encode_data(1, domain, stamp, Message(sender, target, Codec().encode(Start(0, 0))))
    ack = ACK + (5).to_bytes(8, "big") + domain.encode()
    return [data, ack]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four random byte-level edits: flip, overwrite, insert, delete, truncate, splice."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(buf) + 1) if buf else 0
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 4:
            del buf[pos:]
        else:
            buf[pos:pos] = buf[rng.randrange(len(buf) + 1) :][: rng.randint(1, 32)]
    return bytes(buf)


class FuzzTarget:
    """Two real servers with a rally between them, and the means to throw garbage at them.

    Layout ``D0 [s0 s2]  D1 [s1 s2]``: s1 and s2 run and play the rally over D1; s0 is declared
    but never started, so a fuzzer that holds the bus secret can log in to s2 as s0 (s2 accepts
    its lower-id neighbours) without displacing a real connection. Whatever it sends then lands
    in s2's channel exactly like traffic from a real peer, in D0, while the rally uses D1.
    """

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.progress = workdir / "rally.json"
        text = render([[0, 2], [1, 2]], 3, base_port=free_port_base(4))
        spec = {"echo": 2, "n": 10**9, "done": str(self.progress), "every": 10}
        args = json.dumps(spec)
        service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
        start = text.index('<server id="1"')
        end = text.index("</server>", start)
        text = text[:end] + "  " + service + "\n  " + text[end:]
        self.config = workdir / "a3.xml"
        self.config.write_text(text)
        ensure_secret(workdir / "bus.key")
        from aaabus.config.secret import load_secret

        self.secret = load_secret(workdir / "bus.key")
        cfg = load_config(self.config)
        self.s2_d0 = ("127.0.0.1", cfg.servers[2].port_in("D0"))
        self.s2_d1 = ("127.0.0.1", cfg.servers[2].port_in("D1"))
        self.s1_d1 = ("127.0.0.1", cfg.servers[1].port_in("D1"))
        self.dropped = 0  # log lines of the engine dropping a bad input or a dead letter
        self.drop_lines: list[str] = []  # those lines
        self._dropped_changed = threading.Condition()
        self.bus = Bus(self.config, [1, 2], workdir / "stores", sink=self._line)
        self._peer: FakePeer | None = None
        self.sessions = 0
        # The rally (a Bouncer and its Echo) plays Bounce; fuzzed frames carry Start to a
        # missing agent, a notification nobody handles, so a mutated frame that reaches a real
        # agent is an error report, never a counted bounce.
        self.templates = template_frames("D0", AgentId(2, 2, 999), AgentId(0, 0, 20))

    def _line(self, line: str) -> None:
        # An input refused where it arrives (a frame that fails the link's checks), or a body
        # the engine consumed unread (a dead letter: it does not decode).
        if "dropping an input" in line or "dead letter from" in line:
            with self._dropped_changed:
                self.dropped += 1
                self.drop_lines.append(line)
                self._dropped_changed.notify_all()

    def wait_dropped(self, at_least: int, timeout: float, containing: str = "") -> bool:
        """Wait until the servers have logged ``at_least`` dropped inputs in all (only those
        whose line holds ``containing``, when given: the drops of one sender's own frames)."""

        def count() -> int:
            if not containing:
                return self.dropped
            return sum(containing in line for line in self.drop_lines)

        with self._dropped_changed:
            return self._dropped_changed.wait_for(lambda: count() >= at_least, timeout)

    def __enter__(self) -> FuzzTarget:
        self.bus.start(timeout=60)
        wait_progress(self.progress, 20, self.procs)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._peer is not None:
            self._peer.close()
        self.codes = stop_all(self.bus)

    @property
    def procs(self) -> list[Any]:
        return list(self.bus.servers.values())

    def alive(self) -> bool:
        return all(p.running() for p in self.procs)

    def peer(self) -> FakePeer:
        """The authenticated session as s0, (re)opened when the server dropped the last one."""
        if self._peer is None:
            self._peer = FakePeer(self.s2_d0, self.secret, 0, 2)
            self.sessions += 1
        return self._peer

    def send_authenticated(self, payload: bytes, *, tamper: bool = False) -> None:
        """One payload in the session; ``tamper`` breaks its MAC (the server must cut us)."""
        for _attempt in range(3):
            peer = self.peer()
            try:
                if tamper:
                    frame = bytearray(peer.cipher.wrap_frame(payload))
                    frame[-1] ^= 0xFF
                    peer.send_raw(bytes(frame))
                    self.drop_session()
                else:
                    peer.send(payload)
                return
            except OSError:
                self.drop_session()  # cut by the server after an earlier bad frame: reconnect
        raise AssertionError("could not keep an authenticated session to s2")

    def drop_session(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def send_raw(self, data: bytes, to_s1: bool = False) -> None:
        raw_poke(self.s1_d1 if to_s1 else self.s2_d1, data)

    def rally(self) -> dict[str, int]:
        return read_progress(self.progress)


def _random_object(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-(2**70), 2**70)
    if kind == 1:
        return rng.randbytes(rng.randint(0, 40))
    if kind == 2:
        return rng.choice(["D0", "D1", "", "X", "D0" * 50])
    if kind == 3:
        return None
    if kind == 4:
        return rng.random()
    return tuple(_random_object(rng, depth + 1) for _ in range(rng.randint(0, 7)))


def _protected_mutation(rng: random.Random, data: bytes, body: bytes) -> bytes:
    """Mutate everything but the notification body (see ``tests/test_fuzz.py`` for why)."""
    assert data.endswith(body)
    return mutate(rng, data[: -len(body)]) + body


def random_authenticated_payload(rng: random.Random, templates: list[bytes]) -> bytes:
    """One garbage payload for an authenticated session (several shapes, chosen at random)."""
    import pickle

    from aaabus.wire.codec import Codec
    from aaabus.wire.linkframes import ACK, DATA

    data, ack = templates
    body = Codec().encode(Start(0, 0))
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        return _protected_mutation(rng, data, body)
    if kind == 2:
        return mutate(rng, ack)
    if kind == 3:  # a well-formed frame whose body is a mutated data body
        return data[: -len(body)] + mutate(rng, body)
    if kind == 4:
        return DATA + pickle.dumps(_random_object(rng), pickle.HIGHEST_PROTOCOL)
    if kind == 5:
        upto = rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
        return ACK + upto.to_bytes(8, "big") + rng.choice([b"D0", b"D1", b"", b"\xff\xfe"])
    return rng.choice([DATA, ACK, b"", b"X"]) + rng.randbytes(rng.randint(0, 20))


def random_raw_bytes(rng: random.Random, secret: bytes) -> bytes:
    """Bytes for an unauthenticated connection: noise, bad frames, forged handshakes."""
    from aaabus.wire.frames import MAGIC, VERSION, encode_frame

    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 400))
    if kind == 1:  # a length prefix far over the pre-authentication limit
        return rng.randint(257, 2**32 - 1).to_bytes(4, "big") + rng.randbytes(20)
    if kind == 2:  # an ANSWER-shaped frame with a forged MAC
        answer = MAGIC + bytes([VERSION, 2]) + (0).to_bytes(4, "big") + (2).to_bytes(4, "big")
        return encode_frame(mutate(rng, answer + rng.randbytes(64)))
    if kind == 3:  # a well-framed garbage message
        return encode_frame(rng.randbytes(rng.randint(0, 256)))
    return encode_frame(MAGIC + bytes([VERSION, rng.randrange(256)]) + rng.randbytes(72))


def fuzz_live_server(
    workdir: Path, frames: int, *, seed: int = 1, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Send ``frames`` fuzzed frames to a live server, half unauthenticated, half inside an
    authenticated session; then check the servers live and the rally goes on, exactly."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    raw = authenticated = tampered = 0
    with FuzzTarget(workdir) as target:
        before = target.rally()
        for i in range(frames):
            if i % 2 == 0:
                target.send_raw(random_raw_bytes(rng, target.secret), to_s1=rng.random() < 0.2)
                raw += 1
            elif rng.random() < 0.002:
                target.send_authenticated(b"D", tamper=True)
                tampered += 1
            else:
                target.send_authenticated(random_authenticated_payload(rng, target.templates))
                authenticated += 1
            if i % 2000 == 1999:
                if not target.alive():
                    break
                if log is not None:
                    log(f"fuzz: {i + 1} frames, rally {target.rally()}, {target.dropped} dropped")
        alive = target.alive()
        after: dict[str, int] = target.rally()
        if alive:
            try:
                after = wait_progress(target.progress, before["count"] + 100, target.procs)
            except AssertionError as exc:
                after = {"count": -1, "errors": -1}
                if log is not None:
                    log(f"fuzz: {exc}")
        result: dict[str, Any] = {
            "frames": raw + authenticated + tampered,
            "raw": raw,
            "authenticated": authenticated,
            "tampered": tampered,
            "sessions": target.sessions,
            "dropped_inputs": target.dropped,
            "crashes": sum(not p.running() for p in target.procs),
            "rally_before": before["count"],
            "rally_after": after["count"],
            "rally_errors": after["errors"],
        }
    result["exit_codes"] = target.codes
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["ok"] = (
        result["crashes"] == 0
        and result["rally_errors"] == 0
        and result["rally_after"] >= result["rally_before"] + 100
        and all(code == 0 for code in target.codes.values())
    )
    return result
