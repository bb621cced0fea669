"""The selector loop of a network's I/O thread: the owner of its selector, timers and wake-up.

One :class:`Loop` per :class:`~aaabus.io.network.Network`, turned by that network's I/O thread.
A turn (:meth:`Loop.turn`) fires the timers that are due, waits on the selector at most until
the next one, hands each ready connection to the network (``on_event``), each ready listening
socket to its callback, and then runs the work other threads posted for the I/O thread
(:meth:`Loop.post`: writes the kernel did not take at once, resets, TLS steps that returned).

Other threads never touch the selector nor a registered socket: they post work and wake the
loop through a socketpair, at most once per batch of posts (the first post after a turn wakes it;
the next ones find it awake), and the I/O thread itself never wakes itself (it runs what was
posted at the end of every turn).

Timers are ``(when, seq, callback, argument)`` in a heap; a timer is never cancelled: its
callback tells a stale one from a live one (a dial whose peer is up again, a deadline of a
connection already authenticated).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from aaabus.io.connection import Connection

__all__ = ["MAX_SELECT", "Loop"]

#: Longest the I/O thread sleeps without a timer; it is woken by the socketpair anyway, so this
#: only bounds the damage of a lost wake-up.
MAX_SELECT = 1.0


class Loop:
    """Selector, timers and posted work of one I/O thread (see the module docstring).

    ``on_event(conn, events)``: a registered connection is ready; ``on_error(conn, exc)``: that
    call raised (called inside the ``except`` block, so it may log the traceback).
    """

    def __init__(
        self,
        on_event: Callable[[Connection, int], None],
        on_error: Callable[[Connection, Exception], None],
    ) -> None:
        self._on_event = on_event
        self._on_error = on_error
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._timers: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._timer_seq = itertools.count()
        # ``_lock`` guards the posted work and the wake-up flag.
        self._lock = threading.Lock()
        self._posted: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._woken = False
        self._ident: int | None = None
        #: Set by the owner to end :meth:`run` (and to tell timers not to start anything new).
        self.stopping = False
        #: ``perf_counter_ns`` until which :meth:`run` polls rather than sleeps (I/O thread).
        self.poll_until_ns = 0

    # -- set-up and tear-down (the owner's thread) ---------------------------------------------

    def open(self) -> None:
        """Create the selector and the wake-up socketpair."""
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    def listen(self, lsock: socket.socket, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` on every turn where ``lsock`` has connections to accept."""
        assert self._sel is not None
        self._sel.register(lsock, selectors.EVENT_READ, on_ready)

    def close(self) -> None:
        """Close the wake-up socketpair and the selector (I/O thread, at its end)."""
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if self._sel is not None:
            self._sel.close()

    # -- the I/O thread ------------------------------------------------------------------------

    def run(self) -> None:
        """Turn until :attr:`stopping` (the I/O thread's body). Until :attr:`poll_until_ns`,
        poll instead of sleeping, yielding the CPU after each turn that found nothing: what is
        awaited then comes within microseconds, and a thread asleep in the selector wakes tens
        of µs after it."""
        self._ident = threading.get_ident()
        clock = time.perf_counter_ns
        while not self.stopping:
            if self.poll_until_ns and clock() < self.poll_until_ns:
                if not self.turn(0.0):
                    os.sched_yield()
            else:
                self.turn(MAX_SELECT)

    def turn(self, longest: float) -> bool:
        """One turn: due timers, then the selector (sleeping at most ``longest`` seconds), the
        events it gives, the work posted by other threads. False if it found nothing to do."""
        sel = self._sel
        assert sel is not None
        on_event = self._on_event
        ready = sel.select(min(self._run_timers(), longest))
        for key, events in ready:
            data = key.data
            if isinstance(data, Connection):
                try:
                    on_event(data, events)
                except Exception as exc:
                    self._on_error(data, exc)
            elif data is None:
                self._drain_wake()
            else:
                data()  # a listening socket
        return self._run_posted() or bool(ready)

    def _run_posted(self) -> bool:
        """Run the work posted so far, in the order it was posted; False if there was none."""
        with self._lock:
            posted = self._posted
            self._woken = False
            if not posted:
                return False
            self._posted = []
        for fn, args in posted:
            fn(*args)
        return True

    def watch(self, conn: Connection, mask: int) -> None:
        """Have the selector report ``mask`` events of ``conn`` (0 is not allowed: see
        :meth:`forget`)."""
        if mask == conn.mask:
            return
        assert self._sel is not None
        if conn.mask:
            self._sel.modify(conn.sock, mask, conn)
        else:
            self._sel.register(conn.sock, mask, conn)
        conn.mask = mask

    def forget(self, conn: Connection) -> None:
        """Take ``conn`` out of the selector (before its socket is closed or handed away)."""
        if conn.mask:
            assert self._sel is not None
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.mask = 0

    def call_at(self, when: float, callback: Callable[[Any], None], argument: Any) -> None:
        """Call ``callback(argument)`` on the first turn from ``time.monotonic()`` ``when``."""
        heapq.heappush(self._timers, (when, next(self._timer_seq), callback, argument))

    def _run_timers(self) -> float:
        """Fire due timers; return how long select may sleep."""
        timers = self._timers
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, callback, argument = heapq.heappop(timers)
            callback(argument)
            now = time.monotonic()
        if not timers:
            return MAX_SELECT
        return min(max(timers[0][0] - now, 0.0), MAX_SELECT)

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self._wake_r.recv(4096):
                pass

    # -- any thread ----------------------------------------------------------------------------

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Have the I/O thread run ``fn(*args)`` at the end of its turn; wakes it (once per
        batch of posts) unless the caller is that thread."""
        with self._lock:
            self._posted.append((fn, args))
            if self._woken or threading.get_ident() == self._ident:
                return
            self._woken = True
        self.wake()

    def wake(self) -> None:
        """Make the selector return now (safe from any thread, and after :meth:`close`)."""
        wake_w = self._wake_w
        if wake_w is None:
            return
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            wake_w.send(b"\0")
