"""A client subscription: an iterator over publications, with acknowledgement.

The server keeps the subscription's backlog in a mailbox agent (:mod:`aaabus.topics.mailbox`),
numbered 1, 2, 3, ...; this object remembers the number of the last item it handed out and
sends it with its next fetch, which acknowledges everything up to it (the server then forgets
those items). So:

* asking for the next publication acknowledges the previous one (:meth:`Subscription.ack` does
  it at once);
* after a lost connection or a restart of the server, the next fetch asks for what follows the
  last item handed out: nothing is lost and nothing is handed out twice. If the server stays
  unreachable past the client's timeout, :meth:`get` raises :class:`~aaabus.ServerUnreachable`;
  calling it again later resumes at the same place;
* a **named** subscription outlives this object and the client process: another
  ``subscribe(filter, name=...)`` resumes after the last acknowledged item (an item handed out
  but not yet acknowledged when a process dies is handed out again: acknowledge after acting on
  it). An unnamed one is deleted by :meth:`close`.

Not thread-safe, like the :class:`~aaabus.tools.client.Client` it uses.
"""

from __future__ import annotations

import base64
import binascii
import collections
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from aaabus.errors import AdminError, BadBody

__all__ = ["Subscription"]

T = TypeVar("T")

#: Longest wait of one fetch (seconds) by default; below the server's limit (10 s).
FETCH_WAIT = 5.0


class Subscription(Generic[T]):
    """Publications matching ``topic_filter`` (see the module docstring); ``T`` is
    :class:`~aaabus.Publication` (a request's reply mailbox holds any notification).

    ``request`` is the client's request function (retries included); ``decode`` its codec's
    (:meth:`aaabus.wire.codec.Codec.decode`); ``durable``: keep the
    server's mailbox at :meth:`close`; ``wait``: the longest one fetch waits on the server (it
    must stay below the client's answer timeout).
    """

    def __init__(
        self,
        request: Callable[[dict[str, Any]], dict[str, Any]],
        name: str,
        topic_filter: str,
        *,
        durable: bool,
        decode: Callable[[bytes], Any],
        batch: int = 100,
        wait: float = FETCH_WAIT,
    ) -> None:
        self._request = request
        self._decode = decode
        self.name = name
        self.topic_filter = topic_filter
        self.durable = durable
        self.batch = batch
        self.wait = wait
        #: Items the server dropped at its backlog limit (``aaabus.topics.backlog``) so far.
        self.dropped = 0
        self._after = 0  # number of the last item handed out
        self._buffer: collections.deque[tuple[int, T]] = collections.deque()
        self._closed = False

    def __iter__(self) -> Subscription[T]:
        return self

    def __next__(self) -> T:
        while True:  # get(None) returns an item or raises; the loop only satisfies the types
            item = self.get(None)
            if item is not None:
                return item

    def get(self, timeout: float | None) -> T | None:
        """The next publication, or ``None`` after ``timeout`` seconds (``None``: wait for one).

        Acknowledges the one handed out before. Raises :class:`~aaabus.ServerUnreachable` when
        the server does not answer within the client's timeout (call again to resume).
        """
        if self._closed:
            raise RuntimeError(f"subscription {self.name!r} is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._buffer:
            left = self.wait if deadline is None else deadline - time.monotonic()
            self._fetch(self.batch, max(0.0, min(self.wait, left)))  # at least one look
            if not self._buffer and deadline is not None and time.monotonic() >= deadline:
                return None
        seq, publication = self._buffer.popleft()
        self._after = seq
        return publication

    def ack(self) -> None:
        """Acknowledge now everything handed out so far."""
        self._fetch(0, 0.0)

    def _fetch(self, most: int, wait: float) -> None:
        # Items already buffered are asked for again only if the buffer is empty, so "after" is
        # also the last buffered item's number.
        answer = self._request(
            {"op": "fetch", "name": self.name, "after": self._after, "most": most, "wait": wait}
        )
        try:
            self.dropped = int(answer.get("dropped", 0))
            for seq, body in answer["items"]:
                last = self._buffer[-1][0] if self._buffer else self._after
                if seq > last:
                    # Data, decoded into the types this program registered: whoever answers
                    # on the server's address can make it build nothing else, and run nothing.
                    self._buffer.append((seq, self._decode(base64.b64decode(body))))
        except BadBody as exc:
            raise AdminError(
                f"subscription {self.name!r}: the server sent an item this program refuses: {exc}"
            ) from None
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise AdminError(
                f"subscription {self.name!r}: the server's answer to a fetch is malformed "
                f"({type(exc).__name__}: {exc})"
            ) from None

    def close(self) -> None:
        """Acknowledge what was handed out; delete the subscription unless it is named."""
        if self._closed:
            return
        self._closed = True
        self._request(
            {"op": "fetch", "name": self.name, "after": self._after, "most": 0, "wait": 0}
        )
        if not self.durable:
            self._request({"op": "unsubscribe", "name": self.name})

    def __enter__(self) -> Subscription[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
