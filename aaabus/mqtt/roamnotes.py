"""The notifications of roaming MQTT sessions (:mod:`aaabus.mqtt.roaming`).

They travel between the session handlers ``#s.s.3`` of the servers (:data:`SESSIONS_STAMP
<aaabus.model.ids.SESSIONS_STAMP>`): bus notifications like any other -- persistent, exactly
once, in causal order -- encoded as data (:mod:`aaabus.wire.codec`), every field typed. ``to``
is always the server id whose handler the answer goes to; ``cid`` an MQTT client id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aaabus.model.notifications import Notification

__all__ = [
    "MOVE_COST",
    "AnchorSubscribe",
    "AnchorUnsubscribe",
    "Claim",
    "Created",
    "Drop",
    "Handover",
    "MovedItems",
    "Refused",
    "Restored",
    "Roam",
    "SessionMoved",
    "Settled",
    "Taken",
    "Unregister",
]

#: What one move of a session costs its move budget on top of its backlog's bytes: the record,
#: the notifications and the commits of the servers on its way, whatever it carries.
MOVE_COST = 16384


@dataclass
class Claim(Notification):
    """Server ``to`` -> the directory: a device of ``user`` connected at ``to`` with a
    persistent session under ``cid``, which ``to`` does not hold."""

    cid: str
    user: str | None
    to: int


@dataclass
class Created(Notification):
    """The directory -> ``to``: ``cid`` was unknown; ``to`` is now its session's anchor."""

    cid: str
    user: str | None


@dataclass
class Refused(Notification):
    """-> the server whose device asked: no session for it (``reason``: ``"busy"``, the
    session is moving, try again; ``"busy: moved too often ..."``, its move budget is spent,
    try again later; ``"not authorized"``, another user's client id)."""

    cid: str
    reason: str


@dataclass
class Roam(Notification):
    """The directory -> the anchor: move ``cid``'s session to server ``to``."""

    cid: str
    to: int


@dataclass
class Handover(Notification):
    """The anchor -> the server holding ``cid``'s session: give it to server ``to``."""

    cid: str
    to: int


@dataclass
class SessionMoved(Notification):
    """The server that gave the session -> its new holder. ``state``: the whole
    :class:`~aaabus.mqtt.sessions.SessionRecord` as data (its :meth:`state`); ``items``: the
    backlog not acknowledged by the device, each with its number; ``next_seq`` and
    ``dropped``: the mailbox's numbering and its count of items dropped at the limit;
    ``anchor``: the server whose mailbox holds the subscriptions; ``size``: the bytes of the
    whole backlog (with the parts sent ahead), charged to the session's move budget."""

    cid: str
    anchor: int
    state: dict[str, Any]
    items: list[tuple[int, Notification]] = field(default_factory=list)
    next_seq: int = 1
    dropped: int = 0
    size: int = 0


@dataclass
class MovedItems(Notification):
    """The server that gives the session -> its new holder, ahead of :class:`SessionMoved`: a
    part of a backlog too large for one frame (``aaabus.max_frame``), items with numbers."""

    cid: str
    items: list[tuple[int, Notification]]


@dataclass
class Restored(Notification):
    """The new holder -> itself: the restored session's mailbox exists now (its creation
    request went first): its waiting connection may read the backlog."""

    cid: str
    user: str | None


@dataclass
class Settled(Notification):
    """The new holder -> the anchor: the session arrived (committed there); the next move may
    start once the session's move budget allows. ``size``: the bytes of the backlog moved."""

    cid: str
    size: int = 0


@dataclass
class Taken(Notification):
    """The new holder -> the server that gave it the session: committed here; the giver's copy
    (kept since it sent :class:`SessionMoved`) may go."""

    cid: str


@dataclass
class AnchorSubscribe(Notification):
    """The holder -> the anchor: subscribe the session's mailbox there to ``filters``, each
    ``(filter, send_retained)`` (MQTT 5.0's retain handling decided at the holder)."""

    cid: str
    filters: list[tuple[str, bool]]


@dataclass
class AnchorUnsubscribe(Notification):
    """The holder -> the anchor: unsubscribe the session's mailbox from ``filters``."""

    cid: str
    filters: list[str]


@dataclass
class Drop(Notification):
    """The holder -> the anchor: the session ended (clean start, expiry)."""

    cid: str


@dataclass
class Unregister(Notification):
    """The anchor -> the directory: ``cid`` has no session any more."""

    cid: str
    anchor: int
