"""The server side of outside consumers: open, read, acknowledge and close mailboxes.

A client subscription or request is a mailbox agent (:mod:`aaabus.topics.mailbox`) registered by
name with this server's topic representative. The admin connections (:mod:`aaabus.node.dispatch`)
come here; everything that reads or changes the store runs on the engine thread through
:meth:`AgentServer.call`, so the backlog has one writer and every answer is committed.

Waiting: :meth:`MailboxDesk.fetch` may wait for a mailbox to receive something. The wait is on a
generation counter that the engine thread bumps, after the commit, for every
:class:`~aaabus.topics.messages.MailboxGrew` a mailbox sends to ``#s.s.0`` (:meth:`on_note`, an
engine listener). The counter is read inside the same engine call that found the mailbox empty,
so no wake-up can fall between the look and the wait. The waiting thread is the admin
connection's own; the engine never waits for it.

Owners: a mailbox records the scope of the admin key that opened it (:class:`OpenMailbox`'s
``owner``, kept with its entry in the representative), and only a session whose scope covers it
may resume it (subscribe to its name again) or fetch it, which acknowledges: a ``read`` key
cannot empty the backlog of an ``operate`` key's subscription nor read a request's reply. A
mailbox of a store written before owners were recorded, or that the config declares, is
``operate``'s. Every holder of one scope's key holds the same key: they share its mailboxes
(docs/security.md, *Admin sessions*).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aaabus.config.scopes import Scope
from aaabus.errors import RequestRefused
from aaabus.model.ids import TOPICS_STAMP, AgentId
from aaabus.model.notifications import Notification
from aaabus.node.rights import refusal
from aaabus.topics.mailbox import Mailbox
from aaabus.topics.messages import CloseMailbox, MailboxGrew, OpenMailbox
from aaabus.topics.representative import TopicRepresentative

__all__ = ["MAX_FETCH_BYTES", "MailboxDesk"]

T = TypeVar("T")

#: Most pickled bytes one fetch answer carries (the rest waits for the next fetch): an answer is
#: one admin frame, far below ``aaabus.max_frame``.
MAX_FETCH_BYTES = 1 << 20


class MailboxDesk:
    """Mailbox operations for the admin connections of one server (any thread but the engine's).

    ``call(fn)`` runs ``fn`` on the engine thread and returns its result once committed;
    ``agents()`` is the store's agent table and ``send(to, note)`` sends from ``#s.s.0`` (both
    engine thread only, inside ``call``).
    """

    def __init__(
        self,
        server_id: int,
        call: Callable[[Callable[[], Any]], Any],
        agents: Callable[[], Any],
        send: Callable[[AgentId, Notification], None],
        encode: Callable[[Notification], bytes],
    ) -> None:
        self.server_id = server_id
        self._encode = encode
        self._call = call
        self._agents = agents
        self._send = send
        self._cond = threading.Condition()
        self._generation = 0
        self._stopping = False

    def on_note(self, sender: AgentId, note: Notification) -> None:
        """Engine listener (after commit, engine thread): wake the fetches waiting."""
        if isinstance(note, MailboxGrew):
            with self._cond:
                self._generation += 1
                self._cond.notify_all()

    def set_stopping(self, stopping: bool) -> None:
        """While the server stops (``True``), waiting fetches and later ones answer at once;
        ``False`` when it starts again (any thread)."""
        with self._cond:
            self._stopping = stopping
            self._cond.notify_all()

    # -- engine thread -----------------------------------------------------------------------------

    def _representative(self) -> TopicRepresentative:
        rep = self._agents().get((self.server_id, TOPICS_STAMP))
        if not isinstance(rep, TopicRepresentative):
            raise RequestRefused(f"server {self.server_id} has no topic representative")
        return rep

    def _mailbox(self, name: str, scope: Scope) -> Mailbox | None:
        """Mailbox ``name`` (``None`` while there is none), if ``scope`` covers its owner's;
        :class:`RequestRefused` if not."""
        entry = self._representative().mailboxes.get(name)
        if entry is None:
            return None
        _check_owner(name, entry, scope)
        box = self._agents().get((entry[0].origin, entry[0].stamp))
        return box if isinstance(box, Mailbox) else None

    # -- the operations ----------------------------------------------------------------------------

    def open(
        self,
        name: str,
        topic_filter: str | None,
        first: tuple[AgentId, Notification] | None,
        scope: Scope,
        durable: bool = True,
    ) -> bool:
        """Create mailbox ``name``, owned by ``scope``, unless it exists; True if it did exist.
        ``durable``: a named subscription, which outlives its client (``False``: an unnamed
        one or a request's reply, which its client deletes when done).
        Refuses a name taken with another filter, or by a scope that ``scope`` does not cover.
        The creation itself happens in the representative's next reaction (a fetch before that
        finds the mailbox empty; two sessions that race to create one name: the first one's
        scope owns it, and the other's fetches are checked against it)."""

        def do() -> bool:
            rep = self._representative()
            entry = rep.mailboxes.get(name)
            if entry is not None:
                _check_owner(name, entry, scope)
                if entry[1] != topic_filter:
                    raise RequestRefused(
                        f"subscription {name!r} exists with filter {entry[1]!r}, not "
                        f"{topic_filter!r}: choose another name, or unsubscribe it first"
                    )
                return True
            self._send(rep.id, OpenMailbox(name, topic_filter, first, int(scope), durable))
            return False

        result: bool = self._call(do)
        return result

    def delete(self, name: str, scope: Scope, opened_here: bool) -> None:
        """Delete mailbox ``name`` and its backlog (nothing if there is none), for a session of
        ``scope`` that created it (``opened_here``) or not. Below ``operate``, only what the
        session created, or an unnamed subscription of its own scope (its client reconnected
        since it opened it); :class:`RequestRefused` (one line) for the rest."""

        def do() -> None:
            rep = self._representative()
            entry = rep.mailboxes.get(name)
            if entry is not None:
                _check_owner(name, entry, scope)
            mine = opened_here or scope.covers(Scope.OPERATE)
            if not mine and (entry is None or _owner(entry) is not scope or _durable(entry)):
                raise refusal("unsubscribe", Scope.OPERATE, scope)
            self._send(rep.id, CloseMailbox(name))

        self._call(do)

    def fetch(self, name: str, after: int, most: int, wait: float, scope: Scope) -> dict[str, Any]:
        """Acknowledge items up to ``after``; return up to ``most`` items numbered above it,
        waiting up to ``wait`` seconds for one if there is none. :class:`RequestRefused` if
        ``scope`` does not cover the mailbox's owner.

        The answer: ``items`` (``[seq, base64 body]``, oldest first), ``dropped`` (items
        dropped at the backlog limit so far) and ``exists`` (whether the mailbox exists yet).
        """

        def look() -> tuple[bool, dict[str, Any]]:
            box = self._mailbox(name, scope)
            if box is None:
                return False, {"items": [], "dropped": 0, "exists": False}
            box.ack(after)
            items: list[list[Any]] = []
            size = 0
            for seq, note in box.take(after, most):
                body = self._encode(note)
                size += len(body)
                if items and size > MAX_FETCH_BYTES:
                    break
                items.append([seq, base64.b64encode(body).decode("ascii")])
            return bool(items), {"items": items, "dropped": box.dropped, "exists": True}

        return self.poll(look, wait)

    def poll(self, look: Callable[[], tuple[bool, T]], wait: float) -> T:
        """Run ``look`` on the engine thread (committed) until its first value is true or
        ``wait`` seconds have passed; return its last second value.

        Between two looks it waits for a mailbox of this server to grow. The counter is read
        inside the same engine call as the look, so no wake-up falls between look and wait.
        """
        deadline = time.monotonic() + wait
        while True:

            def counted() -> tuple[int, bool, T]:
                generation = self._generation  # the engine's turn, which listeners hold too
                found, value = look()
                return generation, found, value

            generation, found, value = self._call(counted)
            left = deadline - time.monotonic()
            # Stopping: answer now; the client's next request finds the server gone and
            # reconnects, or finds it restarted.
            if found or left <= 0 or self._stopping:
                return value
            with self._cond:
                while self._generation == generation and left > 0 and not self._stopping:
                    self._cond.wait(left)
                    left = deadline - time.monotonic()


def _owner(entry: tuple[Any, ...]) -> Scope:
    """The owner of a representative's mailbox ``entry``: (agent, filter, owner, durable), or
    (agent, filter) from before owners were recorded, which are ``operate``'s (the scope that
    could always delete them)."""
    return Scope(entry[2]) if len(entry) > 2 else Scope.OPERATE


def _durable(entry: tuple[Any, ...]) -> bool:
    """Whether a mailbox ``entry`` is a named subscription (those of old stores count as such)."""
    return bool(entry[3]) if len(entry) > 3 else True


def _check_owner(name: str, entry: tuple[Any, ...], scope: Scope) -> None:
    """Refuse (:class:`RequestRefused`, one line) a session of ``scope`` mailbox ``name`` if its
    scope does not cover the owner's."""
    owner = _owner(entry)
    if not scope.covers(owner):
        raise RequestRefused(
            f"subscription {name!r} belongs to scope {owner.label}, this session holds "
            f"{scope.label}: a key reads and acknowledges only what a key of its scope (or "
            "below) opened; choose another name"
        )
