"""Where a connection is in its session's backlog, and what of it waits in memory (sans-IO).

A device's session is a mailbox in the store; its items (seq 1, 2, ...) are pushed to the
connection once durable. A connection sends them in order: the next one at once if the window
allows, else it keeps the pushed items in memory, contiguous from the next one to send, up to
``aaabus.mqtt.queued_bytes`` of payload. Beyond that, or once an item was missed (a gap: the
connection fell behind, or resumed a session whose backlog is in the store), it reads the rest
from the store a window at a time, and goes back to the pushed items once the store has given
everything it held when it answered.

This module is that bookkeeping only: no event loop, socket or store. The connection
(:mod:`aaabus.mqtt.connection`) asks it what to do, sends, and reads the store.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Literal, Protocol, TypeVar

__all__ = ["Backlog", "Item"]


class Item(Protocol):
    """What the bookkeeping reads of an item (a :class:`~aaabus.mqtt.sessions.Delivery`)."""

    @property
    def payload(self) -> bytes: ...


T = TypeVar("T", bound=Item)


class Backlog(Generic[T]):
    """One connection's place in its session's backlog; ``limit``: bytes of payload it may
    hold in memory (``aaabus.mqtt.queued_bytes``)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        #: The next seq to send.
        self.next = 1
        #: The highest seq pushed so far.
        self.heard = 0
        # Pushed items not sent yet (the window was full), contiguous from next; bounded.
        self._ahead: deque[T] = deque()
        self._ahead_bytes = 0
        #: The store holds items beyond ``next`` that memory does not.
        self.gap = False
        #: A read of the store is under way (the connection sets it and clears it).
        self.fetching = False

    def pushed(self, seq: int, item: T) -> Literal["", "pump", "fill"]:
        """``item`` was appended as ``seq``: ``"pump"`` it is in memory, next in line (send
        what waits); ``"fill"`` what lies before it is in the store only (read it); ``""``
        nothing to do now (sent already, or left to the store, memory staying bounded)."""
        if seq < self.next:
            return ""
        if seq > self.heard:
            self.heard = seq
        ahead = self._ahead
        if self.gap or seq != self.next + len(ahead):
            if seq >= self.next + len(ahead):
                self.gap = True  # what lies between is in the store only
                return "fill"
            return ""
        size = len(item.payload)
        if ahead and self._ahead_bytes + size > self._limit:
            self.gap = True  # the store keeps it; memory stays bounded
            return ""
        ahead.append(item)
        self._ahead_bytes += size
        return "pump"

    @property
    def waiting(self) -> bool:
        """Whether pushed items wait in memory."""
        return bool(self._ahead)

    def pop(self) -> T:
        """The next item waiting in memory (there is one: :attr:`waiting`)."""
        item = self._ahead.popleft()
        self._ahead_bytes -= len(item.payload)
        return item

    def sent(self, seq: int) -> None:
        """``seq`` was handed to the device (or counts as handed)."""
        self.next = seq + 1

    def to_read(self, window: int, in_flight: int) -> int:
        """How many items to read from the store now (0: none): a window at a time, once at
        least half the window is free, and only while memory holds none of what follows."""
        if self.fetching or not self.gap or self._ahead:
            return 0
        free = window - in_flight
        if free < max(1, window // 2) and in_flight:
            return 0
        return free

    def read(self, given: int, asked: int) -> None:
        """The store gave ``given`` of the ``asked`` items (each sent in turn). Fewer: it had
        nothing more when it answered; what was announced before the answer and not given was
        dropped at the backlog limit, what its own batch appended is announced after it, in
        order: the pushed items are the backlog again."""
        if given < asked:
            self.next = max(self.next, self.heard + 1)
            self.gap = False
