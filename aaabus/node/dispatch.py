"""The admin requests: each JSON request of an admin connection, answered as one JSON object.

Runs on the admin connection's thread; whatever touches the store is handed to the engine
thread through :meth:`NodeControl.accept_once` (and the status through ``status()``). Every
failure is an answer ``{"ok": false, "error": "one line"}``, never an exception.
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from aaabus.errors import AaabusError, BadBody, RequestRefused, UndecodableRequest, UntrustedClass
from aaabus.model.ids import AgentId
from aaabus.model.pubsub import Publish
from aaabus.model.topicnames import check_filter, check_topic
from aaabus.node.control import NodeControl
from aaabus.node.rates import RateMeter
from aaabus.node.rights import Session
from aaabus.wire.codec import is_pickle
from aaabus.wire.message import vet_body

__all__ = ["MAX_REQUEST_ID", "answer"]

log = logging.getLogger("aaabus.admin")

#: Longest client-chosen request id (they are remembered by the server for deduplication).
MAX_REQUEST_ID = 128
#: Most items one fetch returns, and the longest it waits for one (seconds): a fetch holds its
#: admin connection's thread, and the client's answer timeout must exceed the wait.
MAX_FETCH_ITEMS = 1000
MAX_FETCH_WAIT = 10.0


def answer(server: NodeControl, rates: RateMeter, session: Session, request: Any) -> dict[str, Any]:
    """The answer to one request of ``session`` (see :mod:`aaabus.node.admin` for the protocol;
    :mod:`aaabus.node.rights` has already checked that its scope may make it, and the mailbox
    requests check here that it may touch the mailbox it names)."""
    try:
        if not isinstance(request, dict):
            raise RequestRefused("a request is a JSON object")
        op = request.get("op")
        if op == "status":
            status = server.status(detail=request.get("detail") is True)
            status["reactions_per_s"] = rates.rate()
            return {"ok": True, "status": status}
        if op == "stop":
            log.info("server %s: stop requested through the admin port", server.server_id)
            server.request_stop()
            return {"ok": True}
        if op == "send":
            to = _target(server, request.get("to"))
            note = _decode(server, request.get("note"), "notification")
            key = _request_id(request)
            _, duplicate = server.accept_once(key, lambda: server.send_now(to, note))
            return {"ok": True, "duplicate": duplicate}
        if op == "deploy":
            agent = _decode(server, request.get("agent"), "agent")
            where = request.get("server")
            if where is not None and (
                not isinstance(where, int) or where not in server.config.servers
            ):
                raise RequestRefused(f"server {where!r} is not in the bus")
            key = _request_id(request)
            agent_id, duplicate = server.accept_once(key, lambda: server.deploy_now(agent, where))
            return {"ok": True, "agent": agent_id, "duplicate": duplicate}
        if op in _TOPIC_OPS:
            return _TOPIC_OPS[op](server, session, request)
        if op == "failpoints":
            spec = request.get("arm")
            if not isinstance(spec, str):
                raise RequestRefused("'arm' must be a text like engine.commit:kill:0")
            server.arm_failpoints(spec)
            return {"ok": True}
        raise RequestRefused(f"unknown request {op!r}")
    except UndecodableRequest as exc:
        # Bytes that are not what they claim: answered, then the connection ends (the server
        # goes on); a client that meant well reconnects for its next request.
        return {"ok": False, "error": str(exc), "close": True}
    except (AaabusError, TimeoutError) as exc:
        return {"ok": False, "error": str(exc) or type(exc).__name__}
    except Exception as exc:  # a failing send or deploy: its transaction was rolled back
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _publish(server: NodeControl, session: Session, request: dict[str, Any]) -> dict[str, Any]:
    topic = check_topic(request.get("topic"))
    payload = _decode(server, request.get("payload"), "payload")
    note = Publish(topic, payload, bool(request.get("retain", False)))
    rep = AgentId.topics_of(server.server_id)
    _, duplicate = server.accept_once(_request_id(request), lambda: server.send_now(rep, note))
    return {"ok": True, "duplicate": duplicate}


def _subscribe(server: NodeControl, session: Session, request: dict[str, Any]) -> dict[str, Any]:
    name = _mailbox_name(request)
    durable = request.get("durable", True)  # clients of before the field named theirs all
    if not isinstance(durable, bool):
        raise RequestRefused("'durable' must be true (a named subscription) or false")
    topic_filter = check_filter(request.get("filter"))
    existed = server.mailboxes.open(name, topic_filter, None, session.scope, durable)
    return {"ok": True, "existed": existed}


def _fetch(server: NodeControl, session: Session, request: dict[str, Any]) -> dict[str, Any]:
    after, most, wait = request.get("after"), request.get("most", 100), request.get("wait", 0)
    if not isinstance(after, int) or after < 0:
        raise RequestRefused("'after' must be the last item number consumed (an integer >= 0)")
    if not isinstance(most, int) or not 0 <= most <= MAX_FETCH_ITEMS:
        raise RequestRefused(f"'most' must be an integer in 0..{MAX_FETCH_ITEMS}")
    if not isinstance(wait, int | float) or not 0 <= wait <= MAX_FETCH_WAIT:
        raise RequestRefused(f"'wait' must be seconds in 0..{MAX_FETCH_WAIT:g}")
    found = server.mailboxes.fetch(_mailbox_name(request), after, most, wait, session.scope)
    return {"ok": True, **found}


def _unsubscribe(server: NodeControl, session: Session, request: dict[str, Any]) -> dict[str, Any]:
    name = _mailbox_name(request)
    server.mailboxes.delete(name, session.scope, session.opened(name))
    return {"ok": True}


def _request(server: NodeControl, session: Session, request: dict[str, Any]) -> dict[str, Any]:
    to = _target(server, request.get("to"))
    note = _decode(server, request.get("note"), "notification")
    # The mailbox is named after the request id: a retried request finds it and sends nothing.
    box = f"request-{_request_id(request)}"
    existed = server.mailboxes.open(box, None, (to, note), session.scope, durable=False)
    return {"ok": True, "duplicate": existed}


_TOPIC_OPS = {
    "publish": _publish,
    "subscribe": _subscribe,
    "fetch": _fetch,
    "unsubscribe": _unsubscribe,
    "request": _request,
}


def _mailbox_name(request: dict[str, Any]) -> str:
    name = request.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_REQUEST_ID + 8:
        raise RequestRefused(f"a subscription name is a string of 1..{MAX_REQUEST_ID} characters")
    return name


def _request_id(request: dict[str, Any]) -> str:
    key = request.get("id")
    if not isinstance(key, str) or not 0 < len(key) <= MAX_REQUEST_ID:
        raise RequestRefused(f"a request id is a string of 1..{MAX_REQUEST_ID} characters")
    return key


def _target(server: NodeControl, text: Any) -> AgentId:
    if not isinstance(text, str):
        raise RequestRefused("'to' must be an agent id like #0.1.16")
    try:
        to = AgentId.parse(text)
    except ValueError as exc:
        raise RequestRefused(str(exc)) from None
    if to.server not in server.config.servers:
        raise RequestRefused(f"agent {to} is on server {to.server}, which is not in the bus")
    return to


def _decode(server: NodeControl, text: Any, what: str) -> Any:
    # Only ever reached on an authenticated session, and even then decoded as data: holding a
    # tool credential must not mean running code inside the server. The one exception is an
    # agent by value (code), loaded only where the operator allowed code (trust.by_value).
    if not isinstance(text, str):
        raise RequestRefused(f"the {what} is missing")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestRefused(f"the {what} is not base64") from None
    codec = server.codec
    try:
        if what == "notification":
            return codec.decode(data)
        if what == "payload":
            return codec.decode_value(data)
        if not is_pickle(data):
            return codec.decode_agent(data)
        if not server.trust.by_value:
            raise BadBody(
                f"an agent by value (code) refused: server {server.server_id} does not load "
                "code (property aaabus.trust.by_value, docs/security.md)"
            )
        vet_body(data)
        return server.trust.loads(data)
    except (BadBody, UntrustedClass) as exc:
        log.warning("server %s: admin %s refused: %s", server.server_id, what, exc)
        raise UndecodableRequest(f"the {what} was refused: {exc}") from None
    except Exception as exc:
        raise UndecodableRequest(
            f"cannot load the {what} here ({type(exc).__name__}: {exc})"
        ) from None
