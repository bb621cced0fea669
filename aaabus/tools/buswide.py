"""Bus-wide tools: the status of many servers, stopping many servers, in parallel.

Each server is asked over its admin port (:class:`~aaabus.io.adminlink.AdminLink`) from a pool
thread of the caller; a server that does not answer counts as down, never as an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig
from aaabus.config.secret import Credential
from aaabus.errors import RequestRefused, ServerBusy, ServerUnreachable, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.tls import tls_contexts

__all__ = ["bus_status", "stop_servers"]


def _ask(
    config: BusConfig,
    server_id: int,
    secret: bytes | Credential,
    request: dict[str, Any],
    timeout: float,
) -> tuple[AdminLink, dict[str, Any]]:
    address, _ = admin_address(config, server_id)
    if address is None:
        raise ServerUnreachable(f"server {server_id} has no admin port (aaabus.admin.port=off)")
    link = AdminLink.connect(
        address, secret, server_id, timeout=timeout, tls=tls_contexts(config, server_id)[1]
    )
    try:
        link.sock.settimeout(timeout)
        answer = link.request(request)
    except (WireError, OSError) as exc:
        link.close()
        raise ServerUnreachable(f"server {server_id} did not answer ({exc})") from None
    if not answer.get("ok"):
        link.close()
        raise RequestRefused(f"server {server_id}: {answer.get('error', 'refused')}")
    return link, answer


def bus_status(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """The status of each server in ``ids``, asked in parallel; down ones are ``up: false``,
    busy ones (they accepted and dropped the connection) ``up: null`` with ``busy``: why."""

    def one(sid: int) -> dict[str, Any]:
        try:
            link, answer = _ask(config, sid, secret, {"op": "status"}, timeout)
        except ServerBusy as exc:
            return {"id": sid, "up": None, "busy": str(exc)}
        except ServerUnreachable:
            return {"id": sid, "up": False}
        link.close()
        status: dict[str, Any] = answer["status"]
        return status

    ids = list(ids)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(ids)))) as pool:
        return list(pool.map(one, ids))


def stop_servers(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 30.0
) -> dict[int, str]:
    """Stop servers cleanly, in parallel; waits until each has closed its store.

    Returns, per server, ``"stopped"``, ``"not running"``, ``"still stopping"`` (the deadline
    passed first) or ``"busy"`` (it accepted and dropped the connection: running, not stopped).
    """

    def one(sid: int) -> str:
        try:
            link, _ = _ask(config, sid, secret, {"op": "stop"}, timeout)
        except ServerBusy:
            return "busy"
        except ServerUnreachable:
            return "not running"
        try:
            # The server closes admin connections last, once its store is closed.
            return "stopped" if link.wait_closed(timeout) else "still stopping"
        finally:
            link.close()

    ids = list(ids)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(ids)))) as pool:
        return dict(zip(ids, pool.map(one, ids), strict=True))
