"""Bus-wide tools: the status of many servers, stopping many servers, in parallel.

Each server is asked over its admin port (:class:`~aaabus.io.adminlink.AdminLink`) from a pool
thread of the caller; a server that does not answer counts as down, never as an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aaabus.config.admin_port import member_admin_addresses
from aaabus.config.reader import BusConfig
from aaabus.config.secret import Credential
from aaabus.errors import RequestRefused, ServerBusy, ServerUnreachable, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.tls import tls_contexts

__all__ = ["bus_status", "membership", "stop_servers"]


def _ask(
    config: BusConfig,
    server_id: int,
    secret: bytes | Credential,
    request: dict[str, Any],
    timeout: float,
) -> tuple[AdminLink, dict[str, Any], int]:
    """The link and answer of ``request`` to ``server_id``, and the index of the member that
    answered (its primary)."""
    members = member_admin_addresses(config, server_id)
    if not members:
        raise ServerUnreachable(f"server {server_id} has no admin port (aaabus.admin.port=off)")
    # Only the primary member listens: each member's address in turn.
    link, at = AdminLink.connect_any(
        [address for _member, address in members],
        secret,
        server_id,
        timeout=timeout,
        tls=tls_contexts(config, server_id)[1],
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
    return link, answer, members[at][0]


def bus_status(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """The status of each server in ``ids``, asked in parallel; down ones are ``up: false``,
    busy ones (they accepted and dropped the connection) ``up: null`` with ``busy``: why."""

    def one(sid: int) -> dict[str, Any]:
        # A server with replicas also says who is who among its members; one without keeps
        # exactly the figures it had before (issue 42).
        replicated = bool(config.server(sid).replicas)
        try:
            link, answer, member = _ask(config, sid, secret, {"op": "status"}, timeout)
        except ServerBusy as exc:
            down: dict[str, Any] = {"id": sid, "up": None, "busy": str(exc)}
        except ServerUnreachable as exc:
            down = {"id": sid, "up": False}
            if replicated:
                down["error"] = str(exc)  # every member's address, and why each failed
        else:
            link.close()
            status: dict[str, Any] = answer["status"]
            if replicated:
                status["membership"] = membership(config, sid, status, member)
            return status
        if replicated:
            down["membership"] = membership(config, sid)
        return down

    ids = list(ids)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(ids)))) as pool:
        return list(pool.map(one, ids))


def membership(
    config: BusConfig,
    server_id: int,
    status: dict[str, Any] | None = None,
    answered: int | None = None,
) -> dict[str, Any]:
    """Who is who among a server's members, from its primary's status (issue 42).

    ``status``: what the member that answered the admin connection said (None: none answered),
    ``answered``: that member's index. Returns ``{"primary": index or None, "epoch": int or
    None, "members": [{"member", "hostname", "role", "behind_commits", "behind_bytes"}, ...]}``,
    member 0 first; ``role``: ``primary``, ``follower`` (connected to the primary's replication,
    with its lag in commits and bytes since its last acknowledgement: None before its first)
    or ``unreachable`` (not connected, or no member answered). The primary is the member whose
    address answered (only a primary listens there); the epoch is the one the server's status
    speaks for (``[epoch, member]``, :mod:`aaabus.node.status`); the primary's replication
    figures are keyed by member index.
    """
    spec = config.server(server_id)
    status = status or {}
    primary = answered
    speaks = status.get("epoch")
    epoch = None if speaks is None else speaks[0]
    shipping = (status.get("replication") or {}).get("replicas", {})
    members = []
    for index, hostname in [(0, spec.hostname)] + [(r.index, r.hostname) for r in spec.replicas]:
        figures = shipping.get(str(index))
        role = "unreachable"
        if primary is not None and index == primary:
            role = "primary"
        elif figures is not None and figures.get("connected"):
            role = "follower"
        members.append({
            "member": index,
            "hostname": hostname,
            "role": role,
            "behind_commits": None if figures is None else figures.get("behind_commits"),
            "behind_bytes": None if figures is None else figures.get("behind_bytes"),
        })  # fmt: skip
    return {"primary": primary, "epoch": epoch, "members": members}


def stop_servers(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 30.0
) -> dict[int, str]:
    """Stop servers cleanly, in parallel; waits until each has closed its store.

    Returns, per server, ``"stopped"``, ``"not running"``, ``"still stopping"`` (the deadline
    passed first) or ``"busy"`` (it accepted and dropped the connection: running, not stopped).
    """

    def one(sid: int) -> str:
        try:
            link, _, _ = _ask(config, sid, secret, {"op": "stop"}, timeout)
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
