"""The floor of a durable ping-pong: what any bus of two processes pays with one sync per hop.

Two processes, no bus: the ping side (the suite's process) and a pong process joined by one TCP
connection on 127.0.0.1 (``TCP_NODELAY``). Each side, on receiving the ball, appends a
``RECORD_BYTES`` record to a preallocated, zero-filled file of its own with one ``os.pwrite``
and one ``os.fdatasync`` -- the durable write that aaabus's receiver does at each hop, and the
same record as ``perf commit``'s floor -- then sends the ball back. A round trip is therefore
two TCP hops, two syncs and the Python loop around them: aaabus's hop minus the bus (frames,
MAC, hand-off to the engine thread, clock, reaction, ZODB). ``perf peers`` runs it interleaved
with the systems it compares, so that "how far from the floor" is a ratio of one run.
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


class _Journal:
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


def _recv_ball(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < BALL_BYTES:
        chunk = sock.recv(BALL_BYTES - len(data))
        if not chunk:
            raise ConnectionError("the other side of the floor ping-pong closed the connection")
        data += chunk
    return data


def pong_child(p: dict[str, Any]) -> dict[str, Any]:
    """The pong process: connect, then sync and send back each ball until a stop ball."""
    journal = _Journal(Path(p["dir"]) / "pong.journal")
    sock = socket.create_connection(("127.0.0.1", p["port"]), timeout=p["timeout"])
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def pingpong(child: Child, work: Path, rounds: int, warmup: int, timeout: float) -> list[int]:
    """Round-trip times (ns) of ``rounds`` measured balls after ``warmup`` unmeasured ones."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        listener.settimeout(timeout)
        params = {"port": listener.getsockname()[1], "dir": str(work), "timeout": timeout}
        pong = stack.enter_context(child("floor-pong", params, timeout))
        conn, _addr = listener.accept()
        stack.enter_context(conn)
        conn.settimeout(timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        journal = _Journal(work / "ping.journal")
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
