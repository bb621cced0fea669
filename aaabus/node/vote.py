"""The candidate's side of a failover vote: asking one voter (issue 42).

A member of server N standing for N's next epoch asks each voter M through M's admin port, as
server N with the role :data:`~aaabus.wire.frames.ROLE_CANDIDATE`, proving the key of the link
between N and M (``keys.link_key(M)`` of N's keys); the voter's side is
:mod:`aaabus.node.voter`. A voter is reached at any of its members' hosts (whichever is its
primary serves its admin port), tried in turn: an address where nothing answers, or where the
connection is turned away before the handshake, moves on to the next; any other failure (a
refused proof, a malformed answer, a refusal) is final for this voter.

Runs on the caller's thread, blocking, within ``deadline`` (``time.monotonic()``). Errors are one
line: :class:`~aaabus.errors.ServerUnreachable` naming every address tried, or
:class:`~aaabus.errors.AdminError`.
"""

from __future__ import annotations

import time
from typing import Any

from aaabus.config.admin_port import admin_address
from aaabus.config.hosts import member_hosts
from aaabus.config.reader import BusConfig
from aaabus.config.secret import ServerKeys
from aaabus.errors import AdminError, ServerBusy, ServerUnreachable, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.tls import tls_contexts
from aaabus.node.epochs import VoteAnswer

__all__ = ["request_vote", "whois"]


def request_vote(
    config: BusConfig,
    keys: ServerKeys,
    voter_id: int,
    server_id: int,
    epoch: int,
    member: int,
    position: str,
    deadline: float,
) -> VoteAnswer:
    """Ask voter ``voter_id`` for epoch ``epoch`` of ``server_id`` for its ``member``, whose
    last commit is ``position`` (a tid, hex). ``keys``: server ``server_id``'s keys."""
    answer = _ask(
        config,
        keys,
        voter_id,
        server_id,
        {
            "op": "vote",
            "server": server_id,
            "epoch": epoch,
            "member": member,
            "position": position,
        },
        deadline,
    )
    granted, why = answer.get("granted"), answer.get("why")
    if not isinstance(granted, bool) or not isinstance(why, str):
        raise AdminError(f"voter {voter_id} answered a vote without 'granted' and 'why'")
    voted_epoch, voted_member = _pair(answer, voter_id)
    return VoteAnswer(granted, voted_epoch, voted_member, why)


def whois(
    config: BusConfig, keys: ServerKeys, voter_id: int, server_id: int, deadline: float
) -> tuple[int, int]:
    """``(epoch, member)`` that voter ``voter_id`` knows for ``server_id`` (``(0, 0)``: it
    knows of no failover of it). ``keys``: server ``server_id``'s keys."""
    answer = _ask(config, keys, voter_id, server_id, {"op": "whois", "server": server_id}, deadline)
    return _pair(answer, voter_id)


def _ask(
    config: BusConfig,
    keys: ServerKeys,
    voter_id: int,
    server_id: int,
    request: dict[str, Any],
    deadline: float,
) -> dict[str, Any]:
    """Send ``request`` to the voter at its members' hosts in turn; its answer (``ok``)."""
    address, _explicit = admin_address(config, voter_id)
    if address is None:
        raise AdminError(f"voter {voter_id} has no admin port (aaabus.admin.port is off)")
    try:
        key = keys.link_key(voter_id)
    except KeyError:
        raise AdminError(
            f"the key file of server {server_id} has no key for its link with voter {voter_id}"
        ) from None
    tls = tls_contexts(config, server_id)[1]
    port = address[1]
    tried: list[str] = []
    for host in member_hosts(config.server(voter_id)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        tried.append(f"{host}:{port}")
        try:
            link = AdminLink.candidate(
                (host, port), key, server_id, voter_id, timeout=left, tls=tls
            )
        except (ServerUnreachable, ServerBusy):
            continue  # another member of the voter may be its primary
        try:
            link.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            answer = link.request(request)
        except (WireError, OSError) as exc:
            raise AdminError(
                f"voter {voter_id} at {host}:{port} did not answer the {request['op']} "
                f"request ({exc or type(exc).__name__})"
            ) from None
        finally:
            link.close()
        if answer.get("ok") is not True:
            raise AdminError(f"voter {voter_id} refused the request: {answer.get('error')}")
        return answer
    raise ServerUnreachable(
        f"voter {voter_id} does not answer at {', '.join(tried) or 'any address'} "
        f"(the {request['op']} request of server {server_id})"
    )


def _pair(answer: dict[str, Any], voter_id: int) -> tuple[int, int]:
    epoch, member = answer.get("epoch"), answer.get("member")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, member)):
        raise AdminError(f"voter {voter_id} answered without a valid epoch and member")
    assert isinstance(epoch, int) and isinstance(member, int)
    return epoch, member
