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

from aaabus.errors import AaabusError, RequestRefused, UntrustedClass
from aaabus.model.ids import AgentId
from aaabus.node.control import NodeControl
from aaabus.node.rates import RateMeter
from aaabus.wire.message import vet_body

__all__ = ["MAX_REQUEST_ID", "answer"]

log = logging.getLogger("aaabus.admin")

#: Longest client-chosen request id (they are remembered by the server for deduplication).
MAX_REQUEST_ID = 128


def answer(server: NodeControl, rates: RateMeter, request: Any) -> dict[str, Any]:
    """The answer to one request (see :mod:`aaabus.node.admin` for the protocol)."""
    try:
        if not isinstance(request, dict):
            raise RequestRefused("a request is a JSON object")
        op = request.get("op")
        if op == "status":
            status = server.status()
            status["reactions_per_s"] = rates.rate()
            return {"ok": True, "status": status}
        if op == "stop":
            log.info("server %s: stop requested through the admin port", server.server_id)
            server.request_stop()
            return {"ok": True}
        if op == "send":
            to = _target(server, request.get("to"))
            note = _unpickle(server, request.get("note"), "notification")
            key = _request_id(request)
            _, duplicate = server.accept_once(key, lambda: server.send_now(to, note))
            return {"ok": True, "duplicate": duplicate}
        if op == "deploy":
            agent = _unpickle(server, request.get("agent"), "agent")
            where = request.get("server")
            if where is not None and (
                not isinstance(where, int) or where not in server.config.servers
            ):
                raise RequestRefused(f"server {where!r} is not in the bus")
            key = _request_id(request)
            agent_id, duplicate = server.accept_once(key, lambda: server.deploy_now(agent, where))
            return {"ok": True, "agent": agent_id, "duplicate": duplicate}
        if op == "failpoints":
            spec = request.get("arm")
            if not isinstance(spec, str):
                raise RequestRefused("'arm' must be a text like engine.commit:kill:0")
            server.arm_failpoints(spec)
            return {"ok": True}
        raise RequestRefused(f"unknown request {op!r}")
    except (AaabusError, TimeoutError) as exc:
        return {"ok": False, "error": str(exc) or type(exc).__name__}
    except Exception as exc:  # a failing send or deploy: its transaction was rolled back
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


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


def _unpickle(server: NodeControl, text: Any, what: str) -> Any:
    # Only ever reached on an authenticated session, and even then loaded under the server's
    # trust policy: holding a tool credential must not mean running code inside the server.
    if not isinstance(text, str):
        raise RequestRefused(f"the {what} is missing")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestRefused(f"the {what} is not base64") from None
    try:
        vet_body(data)
        return server.trust.loads(data)
    except UntrustedClass as exc:
        log.warning("server %s: admin %s refused: %s", server.server_id, what, exc)
        raise RequestRefused(f"the {what} was refused: {exc}") from None
    except Exception as exc:
        raise RequestRefused(
            f"cannot load the {what} here ({type(exc).__name__}: {exc}); its class must be "
            "importable by the server"
        ) from None
