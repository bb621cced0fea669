"""The floor of a durable ping-pong: what any bus of two processes pays with one sync per hop.

Two processes, no bus: the ping side (the suite's process) and a pong process joined by one TCP
connection on 127.0.0.1 (``TCP_NODELAY``). Each side, on receiving the ball, appends a
``RECORD_BYTES`` record to a preallocated, zero-filled file of its own with one ``os.pwrite``
and one ``os.fdatasync`` -- the durable write that aaabus's receiver does at each hop, and the
same record as ``perf commit``'s floor -- then sends the ball back. A round trip is therefore
two TCP hops, two syncs and the Python loop around them: aaabus's hop minus the bus (frames,
MAC, hand-off to the engine thread, clock, reaction, ZODB). ``perf peers`` runs it interleaved
with the systems it compares, so that "how far from the floor" is a ratio of one run.

``replicated=True`` is the floor of the same ping-pong when each side has one synchronous
replica (issue 42, ``perf safety``): each side has a mirror process of its own, and each append
first sends the record to its mirror, then writes and syncs its own copy, then waits for the
mirror's one-byte acknowledgement, sent after the mirror's own write and sync -- the order of a
replicated commit in aaabus (records shipped before the local write, so that the two syncs
overlap). On one machine the four syncs share one disk, as aaabus's servers and replicas do in
``perf safety``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECORD_BYTES = 600
BALL_BYTES = 64
#: The preallocated file wraps around: big enough that a run never syncs a metadata change.
FILE_BYTES = 8 << 20

Child = Callable[[str, dict[str, Any], float], contextlib.AbstractContextManager[Any]]


class Journal:
    """A preallocated file taking one record + ``fdatasync`` per call, wrapping around."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        block = b"\0" * (1 << 20)
        for _ in range(FILE_BYTES // len(block)):
            os.write(self.fd, block)
        os.fsync(self.fd)  # the size and the blocks are on disk: later syncs write data only
        self.offset = 0
        self.record = b"r" * RECORD_BYTES

    def append(self) -> None:
        os.pwrite(self.fd, self.record, self.offset)
        os.fdatasync(self.fd)
        self.offset = (self.offset + RECORD_BYTES) % (FILE_BYTES - RECORD_BYTES)

    def close(self) -> None:
        os.close(self.fd)


class _Mirrored:
    """A journal each append of which is also on a mirror's disk before it returns."""

    def __init__(self, journal: Journal, sock: socket.socket) -> None:
        self.journal = journal
        self.sock = sock

    def append(self) -> None:
        self.sock.sendall(self.journal.record)
        self.journal.append()
        _recv_exact(self.sock, 1)

    def close(self) -> None:
        self.sock.close()
        self.journal.close()


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side of the floor ping-pong closed the connection")
        data += chunk
    return data


def _recv_ball(sock: socket.socket) -> bytes:
    return _recv_exact(sock, BALL_BYTES)


def _connect(port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _journal(path: Path, mirror_port: int | None, timeout: float) -> Journal | _Mirrored:
    journal = Journal(path)
    return journal if mirror_port is None else _Mirrored(journal, _connect(mirror_port, timeout))


def mirror_child(p: dict[str, Any]) -> dict[str, Any]:
    """A side's mirror (``replicated``): listen, then write and sync each record it is sent and
    acknowledge it with one byte, until its side closes the connection."""
    journal = Journal(Path(p["dir"]) / f"mirror-{p['port']}.journal")
    served = 0
    with socket.create_server(("127.0.0.1", p["port"])) as listener:
        listener.settimeout(p["timeout"])
        print("ready", flush=True)
        conn, _addr = listener.accept()
    conn.settimeout(None)  # a round may wait as long as the run lasts
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                _recv_exact(conn, RECORD_BYTES)
            except ConnectionError:
                break  # its side is done
            journal.append()
            conn.sendall(b"a")
            served += 1
    finally:
        conn.close()
        journal.close()
    return {"served": served}


def pong_child(p: dict[str, Any]) -> dict[str, Any]:
    """The pong process: connect, then sync and send back each ball until a stop ball."""
    journal = _journal(Path(p["dir"]) / "pong.journal", p.get("mirror_port"), p["timeout"])
    sock = _connect(p["port"], p["timeout"])
    served = 0
    try:
        print("ready", flush=True)
        while True:
            ball = _recv_ball(sock)
            if ball.startswith(b"stop"):
                break
            journal.append()
            sock.sendall(ball)
            served += 1
    finally:
        sock.close()
        journal.close()
    return {"served": served}


def pingpong(
    child: Child,
    work: Path,
    rounds: int,
    warmup: int,
    timeout: float,
    *,
    replicated: bool = False,
    ports: Callable[[int], list[int]] | None = None,
) -> list[int]:
    """Round-trip times (ns) of ``rounds`` measured balls after ``warmup`` unmeasured ones.
    ``replicated``: each side with a mirror (module docstring); ``ports(2)`` gives the two
    mirrors' free ports."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        listener.settimeout(timeout)
        params: dict[str, Any] = {
            "port": listener.getsockname()[1],
            "dir": str(work),
            "timeout": timeout,
        }
        mine: int | None = None
        if replicated:
            assert ports is not None
            mine, theirs = ports(2)
            for port in (mine, theirs):
                mirror = {"port": port, "dir": str(work), "timeout": timeout}
                stack.enter_context(child("floor-mirror", mirror, timeout))
            params["mirror_port"] = theirs
        pong = stack.enter_context(child("floor-pong", params, timeout))
        conn, _addr = listener.accept()
        stack.enter_context(conn)
        conn.settimeout(timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        journal = _journal(work / "ping.journal", mine, timeout)
        stack.callback(journal.close)
        ball = b"b" * BALL_BYTES
        rtts: list[int] = []
        for n in range(warmup + rounds):
            t0 = time.perf_counter_ns()
            conn.sendall(ball)
            _recv_ball(conn)
            journal.append()  # the ping side's hop: durable before the next send
            if n >= warmup:
                rtts.append(time.perf_counter_ns() - t0)
        conn.sendall(b"stop".ljust(BALL_BYTES, b" "))
        with contextlib.suppress(subprocess.TimeoutExpired):
            pong.wait(timeout)  # it exits after the stop ball; stopped by PID otherwise
    return rtts
