"""What each admin request needs: the scope of the tool's credential, checked before it runs.

A session's scope is what its credential proved in the handshake (:mod:`aaabus.io.adminlink`): the
admin key of a scope is derived from that scope's tool key, so a session cannot hold more than
its key gives. Every request names an ``op``; :data:`NEEDS` says which scope it takes, and the
check runs before anything of the request is decoded, so that a refused request has no effect::

    read      status, subscribe, fetch (of the mailboxes a read key opened: the owner check is
              aaabus.node.mailboxes); and unsubscribe of a subscription this session opened,
              or of an unnamed one a read key opened (checked there too: it knows the owner)
    operate   send, publish, request, deploy (of an agent by class), unsubscribe, stop, failpoints
    code      a request whose notification, payload or agent is a pickle (:data:`CARRIERS`):
              deploying an agent *by value*, or a body with no data form on a bus that opted in
              to pickles. A pickle is a program. The server loads it only where its operator
              allowed code as well (``aaabus.trust.by_value``, ``aaabus.wire.pickle``): the
              scope is necessary, not sufficient.

An op that is not in the table is refused, whatever the scope: a new request must be given its
scope here before any tool can use it. Refusals are one line naming the op, the scope needed and
the scope held, and how to get a key of that scope.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from aaabus.config.scopes import Scope
from aaabus.errors import RequestRefused
from aaabus.wire.codec import is_pickle

__all__ = ["CARRIERS", "NEEDS", "Session", "refusal"]

NEEDS: dict[str, Scope] = {
    "status": Scope.READ,
    "subscribe": Scope.READ,
    "fetch": Scope.READ,
    "send": Scope.OPERATE,
    "publish": Scope.OPERATE,
    "request": Scope.OPERATE,
    "deploy": Scope.OPERATE,
    "unsubscribe": Scope.OPERATE,
    "stop": Scope.OPERATE,
    "failpoints": Scope.OPERATE,
}

#: The requests that carry something to decode, and the field that holds it (base64).
CARRIERS = {"send": "note", "request": "note", "publish": "payload", "deploy": "agent"}


class Session:
    """One authenticated admin connection: its scope, and the subscriptions it opened itself
    (which it may close again whatever its scope: a read tool's anonymous subscription ends
    with an unsubscribe). Used by the connection's thread only."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self._opened: set[str] = set()

    def opened(self, name: str) -> bool:
        """Whether this session created subscription ``name``."""
        return name in self._opened

    def serve(self, request: Any, perform: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The answer to ``request``: a refusal if this session may not make it, else what
        ``perform()`` answers (a request that is not a JSON object is left to it to refuse)."""
        if isinstance(request, dict):
            try:
                self._check(request)
            except RequestRefused as exc:
                return {"ok": False, "error": str(exc)}
        reply = perform()
        if _created_subscription(request, reply):
            self._opened.add(request["name"])
        return reply

    def _check(self, request: dict[str, Any]) -> None:
        op = request.get("op")
        needed = NEEDS.get(op) if isinstance(op, str) else None
        if needed is None:
            raise RequestRefused(f"unknown request {op!r}")
        what = str(op)
        if op in CARRIERS and _carries_pickle(request.get(CARRIERS[op])):
            needed, what = Scope.CODE, f"{op} of a pickle (code, e.g. an agent by value)"
        elif op == "unsubscribe" and (
            request.get("name") in self._opened or self.scope is Scope.READ
        ):
            # What this session opened, it closes. A read key's unnamed subscription opened in
            # an earlier session (the client reconnected) it closes too: only the mailbox desk
            # knows the owner, and refuses the rest with the same line as here.
            return
        if not self.scope.covers(needed):
            raise refusal(what, needed, self.scope)


def _carries_pickle(text: Any) -> bool:
    """Whether the base64 field ``text`` holds a pickle: its first 4 characters give its
    first 3 bytes, enough to tell (what is not valid base64 is refused by the decoder)."""
    if not isinstance(text, str):
        return False
    try:
        return is_pickle(base64.b64decode(text[:4], validate=True))
    except (binascii.Error, ValueError):
        return False


def refusal(what: str, needed: Scope, held: Scope) -> RequestRefused:
    """The one line refusing ``what`` to a session of scope ``held``."""
    return RequestRefused(
        f"{what} needs scope {needed.label}, this session holds {held.label}; "
        f"use a tool key made with `aaabus secret --tool --scope {needed.label}`"
    )


def _created_subscription(request: Any, reply: dict[str, Any]) -> bool:
    """Whether ``request`` created a subscription (not opened someone's existing durable one)."""
    return (
        isinstance(request, dict)
        and request.get("op") == "subscribe"
        and reply.get("ok") is True
        and reply.get("existed") is False
    )
