"""A fault-injecting TCP proxy on 127.0.0.1, placed between two servers by the tests.

It forwards bytes both ways and can, on command: delay them, stall them, cut every connection
(optionally in the middle of a frame), and partition (refuse connections) until healed. Each
direction of each connection has a reader thread and a writer thread joined by a queue, so that a
delay shifts the byte stream in time without reordering it.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Pipe:
    src: socket.socket
    dst: socket.socket
    q: queue.Queue[tuple[float, bytes] | None] = field(default_factory=queue.Queue)


class FaultProxy:
    """Listens on a free port of 127.0.0.1 and forwards to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int], name: str = "proxy") -> None:
        self.target = target
        self.name = name
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(16)
        self._lsock.settimeout(0.1)
        self.port: int = self._lsock.getsockname()[1]
        self._lock = threading.Condition()
        self._delay = 0.0
        self._stalled = False
        self._partitioned = False
        self._cut_after: int | None = None
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.connections = 0
        self.forwarded = 0
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    # -- faults --------------------------------------------------------------------------------

    def set_delay(self, seconds: float) -> None:
        with self._lock:
            self._delay = seconds

    def stall(self) -> None:
        """Stop forwarding (bytes pile up in the proxy) until :meth:`resume`."""
        with self._lock:
            self._stalled = True

    def resume(self) -> None:
        with self._lock:
            self._stalled = False
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
            self._stalled = False
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
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._socks.update((client, upstream))
                self.connections += 1
            for a, b, tag in ((client, upstream, "up"), (upstream, client, "down")):
                pipe = _Pipe(a, b)
                for fn, role in ((self._read, "r"), (self._write, "w")):
                    t = threading.Thread(
                        target=fn, args=(pipe,), name=f"{self.name}-{tag}-{role}", daemon=True
                    )
                    t.start()
                    self._threads.append(t)
            self._threads = [t for t in self._threads if t.is_alive()]

    def _read(self, pipe: _Pipe) -> None:
        try:
            while True:
                data = pipe.src.recv(65536)
                if not data:
                    break
                with self._lock:
                    delay = self._delay
                pipe.q.put((time.monotonic() + delay, data))
        except OSError:
            pass
        pipe.q.put(None)

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
                        if self._stalled:
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
                self.forwarded += len(data)
        except OSError:
            pass
        for s in (pipe.src, pipe.dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
