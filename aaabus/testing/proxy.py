"""A fault-injecting TCP proxy on 127.0.0.1, placed between two servers by the tests.

It forwards bytes both ways and can, on command: delay them (each direction on its own, with an
optional seeded jitter, as a WAN link does), stall them, cut every connection (optionally in the
middle of a frame), and partition (refuse connections) until healed. Each direction of each
connection has a reader thread and a writer thread joined by a bounded queue, so that a delay
shifts the byte stream in time without reordering it, and a receiver that stops reading stops the
sender through TCP flow control instead of growing the proxy's memory.

Threads: one acceptor, and a reader and a writer per direction of each connection, all named after
the proxy and daemonic; :meth:`FaultProxy.stop` (or leaving the ``with`` block) closes every socket
and joins them. Socket errors end the connection they happened on, never the proxy.
"""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

#: Chunks (of at most ``_CHUNK`` bytes) a direction holds before its reader stops reading: a
#: delayed link holds at most ``_MAX_CHUNKS * _CHUNK`` bytes (4 MiB) per direction.
_CHUNK = 65536
_MAX_CHUNKS = 64

Direction = Literal["up", "down", "both"]


@dataclass
class _Pipe:
    src: socket.socket
    dst: socket.socket
    direction: Literal["up", "down"]
    q: queue.Queue[tuple[float, bytes] | None] = field(
        default_factory=lambda: queue.Queue(_MAX_CHUNKS)
    )
    #: Set by the writer when it gives up, so that a reader blocked on a full queue stops too.
    closed: threading.Event = field(default_factory=threading.Event)
    #: Due time of the last chunk queued: jitter never lets a chunk overtake the previous one.
    last_due: float = 0.0


class FaultProxy:
    """Listens on a free port of 127.0.0.1 and forwards to ``target`` (host, port)."""

    def __init__(
        self,
        target: tuple[str, int],
        name: str = "proxy",
        seed: int = 0,
        alternates: tuple[tuple[str, int], ...] = (),
    ) -> None:
        """``alternates``: addresses tried in turn, after ``target``, by each new connection
        (a server with members listens only where its primary runs)."""
        self.target = target
        self.alternates = alternates
        self.name = name
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(16)
        self._lsock.settimeout(0.1)
        self.port: int = self._lsock.getsockname()[1]
        self._lock = threading.Condition()
        # Seconds added to each chunk, per direction ("up": client to target), plus a uniform
        # random extra in [0, jitter) drawn from a seeded generator (runs are reproducible).
        self._delay = {"up": 0.0, "down": 0.0}
        self._jitter = {"up": 0.0, "down": 0.0}
        self._random = random.Random(seed)
        self._stalled = {"up": False, "down": False}
        self._partitioned = False
        self._cut_after: int | None = None
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.connections = 0
        self.forwarded = 0
        self.received = 0
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    # -- faults --------------------------------------------------------------------------------

    def set_delay(self, seconds: float, direction: Direction = "both", jitter: float = 0.0) -> None:
        """Delay the bytes read from now on by ``seconds`` plus a random ``[0, jitter)``, in one
        direction ("up": from the connecting client to the target; "down": back) or both."""
        if seconds < 0 or jitter < 0:
            raise ValueError(f"{self.name}: delay and jitter must be >= 0, got {seconds}, {jitter}")
        with self._lock:
            for d in ("up", "down") if direction == "both" else (direction,):
                self._delay[d] = seconds
                self._jitter[d] = jitter

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stall(self, direction: Direction = "both") -> None:
        """Stop forwarding in one direction or both (bytes pile up in the proxy) until
        :meth:`resume`."""
        with self._lock:
            for d in ("up", "down") if direction == "both" else (direction,):
                self._stalled[d] = True

    def holding(self) -> int:
        """Bytes read from one side and not yet written to the other (any thread): what a
        stall or a delay holds right now."""
        with self._lock:
            return self.received - self.forwarded

    def resume(self) -> None:
        with self._lock:
            self._stalled = {"up": False, "down": False}
            self._lock.notify_all()

    def cut(self, after_bytes: int | None = None) -> None:
        """Close every connection now, or after forwarding ``after_bytes`` more bytes (which
        lands in the middle of a frame for most values)."""
        with self._lock:
            if after_bytes is None:
                self._close_all()
            else:
                self._cut_after = after_bytes

    def partition(self) -> None:
        """Close every connection and refuse new ones until :meth:`heal`."""
        with self._lock:
            self._partitioned = True
            self._close_all()

    def heal(self) -> None:
        with self._lock:
            self._partitioned = False
            self._stalled = {"up": False, "down": False}
            self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._close_all()
            self._lock.notify_all()
        self._lsock.close()
        self._acceptor.join(5)
        for t in self._threads:
            t.join(5)

    # -- internals -----------------------------------------------------------------------------

    def _close_all(self) -> None:
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._socks.clear()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if self._partitioned or self._stopping:
                    client.close()
                    continue
            upstream = self._dial()
            if upstream is None:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._socks.update((client, upstream))
                self.connections += 1
            pipes = (_Pipe(client, upstream, "up"), _Pipe(upstream, client, "down"))
            for pipe in pipes:
                tag = pipe.direction
                for fn, role in ((self._read, "r"), (self._write, "w")):
                    t = threading.Thread(
                        target=fn, args=(pipe,), name=f"{self.name}-{tag}-{role}", daemon=True
                    )
                    t.start()
                    self._threads.append(t)
            self._threads = [t for t in self._threads if t.is_alive()]

    def _dial(self) -> socket.socket | None:
        for address in (self.target, *self.alternates):
            try:
                return socket.create_connection(address, timeout=2)
            except OSError:
                continue
        return None

    def _read(self, pipe: _Pipe) -> None:
        try:
            while not pipe.closed.is_set():
                data = pipe.src.recv(_CHUNK)
                if not data:
                    break
                with self._lock:
                    self.received += len(data)
                    delay = self._delay[pipe.direction]
                    jitter = self._jitter[pipe.direction]
                    if jitter:
                        delay += self._random.uniform(0.0, jitter)
                pipe.last_due = max(pipe.last_due, time.monotonic() + delay)
                self._put(pipe, (pipe.last_due, data))
        except OSError:
            pass
        self._put(pipe, None)

    @staticmethod
    def _put(pipe: _Pipe, item: tuple[float, bytes] | None) -> None:
        """Queue ``item``, waiting while the queue is full unless the writer has given up."""
        while not pipe.closed.is_set():
            try:
                pipe.q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _write(self, pipe: _Pipe) -> None:
        try:
            while True:
                item = pipe.q.get()
                if item is None:
                    break
                due, data = item
                with self._lock:
                    while not self._stopping:
                        wait = due - time.monotonic()
                        if self._stalled[pipe.direction]:
                            self._lock.wait(0.1)
                        elif wait > 0:
                            self._lock.wait(wait)
                        else:
                            break
                    if self._stopping:
                        break
                    if self._cut_after is not None:
                        if len(data) >= self._cut_after:
                            data = data[: self._cut_after]
                            pipe.dst.sendall(data)
                            self._cut_after = None
                            self._close_all()
                            break
                        self._cut_after -= len(data)
                pipe.dst.sendall(data)
                with self._lock:
                    self.forwarded += len(data)
        except OSError:
            pass
        pipe.closed.set()
        for s in (pipe.src, pipe.dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
