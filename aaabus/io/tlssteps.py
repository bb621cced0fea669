"""TLS handshake steps of a network's new connections, off its I/O thread.

A TLS handshake costs milliseconds of CPU (key exchange, signatures) that anyone who can connect
can make a server spend, so its steps never run on the I/O thread: each step (a non-blocking
``do_handshake``, which never waits for the network) runs on one ``{name}-tls`` worker thread at
a lower scheduling priority, OpenSSL releasing the GIL meanwhile, while the I/O thread goes on
serving established links. The connection leaves the selector during a step and comes back with
its result, posted to the loop; a connection closed meanwhile (deadline, eviction) has its
socket closed when the step returns, never under the worker's feet.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aaabus.io.connection import Connection
from aaabus.io.loop import Loop
from aaabus.io.states import ConnState

__all__ = ["TlsSteps"]

#: Threads running TLS handshake steps (CPU-bound, off the I/O thread): one bounds what a flood
#: of handshakes can take to one core, at a lower scheduling priority (see _lower_priority).
_TLS_WORKERS = 1
#: How much nicer than the rest of the process a TLS worker runs (Linux: per-thread nice).
_TLS_NICE = 10

#: What a step gives back: None (handshake done), the selector event it waits for, or an error.
Outcome = int | Exception | None


class TlsSteps:
    """The worker that runs TLS handshake steps for ``loop``'s connections; each step's outcome
    goes to ``on_result(conn, outcome)`` on the I/O thread (not called for a connection that was
    closed meanwhile: its socket is closed then)."""

    def __init__(
        self, loop: Loop, on_result: Callable[[Connection, Outcome], None], *, name: str
    ) -> None:
        self._loop = loop
        self._on_result = on_result
        self._pool = ThreadPoolExecutor(
            _TLS_WORKERS, thread_name_prefix=f"{name}-tls", initializer=_lower_priority
        )
        # The connections out in the worker (I/O thread only): theirs is the worker's socket.
        self._in_worker: set[Connection] = set()

    def __contains__(self, conn: Connection) -> bool:
        """Whether ``conn``'s socket is in the worker now (the I/O thread must not touch it)."""
        return conn in self._in_worker

    def step(self, conn: Connection) -> None:
        """I/O thread: hand the next handshake step of ``conn`` to the worker."""
        self._loop.forget(conn)
        self._in_worker.add(conn)
        self._pool.submit(self._work, conn)

    def stop(self) -> None:
        """I/O thread, at its end: wait for the step under way, then close the sockets of the
        connections still out in the worker."""
        # Steps are short (non-blocking); after this no worker holds a socket.
        self._pool.shutdown(wait=True, cancel_futures=True)
        for conn in self._in_worker:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._in_worker.clear()

    def _work(self, conn: Connection) -> None:
        """The worker: one non-blocking handshake step; the outcome goes to the I/O thread."""
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        outcome: Outcome
        try:
            sock.do_handshake()
            outcome = None
        except ssl.SSLWantReadError:
            outcome = selectors.EVENT_READ
        except ssl.SSLWantWriteError:
            outcome = selectors.EVENT_WRITE
        except (OSError, ValueError) as exc:
            outcome = exc
        self._loop.post(self._returned, conn, outcome)

    def _returned(self, conn: Connection, outcome: Outcome) -> None:
        self._in_worker.discard(conn)
        if conn.state is ConnState.TLS:
            self._on_result(conn, outcome)
        else:  # closed while in the worker: its socket is ours to close
            with contextlib.suppress(OSError):
                conn.sock.close()


def _lower_priority() -> None:
    """Run the calling thread (a TLS worker) at a lower priority: when strangers' handshakes and
    established links compete for a core, the kernel serves the links first. Linux applies
    ``setpriority`` to one thread given its native id; elsewhere this is a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _TLS_NICE)
