"""A server's answers to the candidates of another server's failover (issue 42).

A member of server N that has lost its primary asks the voters of N for a vote on N's next epoch
(docs/architecture.md, "Replicas and failover"). It reaches each voter's admin port with the
role :data:`~aaabus.wire.frames.ROLE_CANDIDATE`, as server N, proving the key of the link
between N and the voter (only N's members hold it; :mod:`aaabus.node.admin`). Such a session may
ask two things about N, nothing else, and nothing about another server::

    {"op": "vote", "server": N, "epoch": E, "member": K, "position": "<hex tid>"}
        -> {"ok": true, "granted": bool, "epoch": int, "member": int, "why": "one line"}
    {"op": "whois", "server": N}
        -> {"ok": true, "epoch": int, "member": int}      (0, 0 when N never failed over)

The grant rule (:meth:`aaabus.node.epochs.EpochBook.grant`): refused if E is not above the
epoch known for N, unless exactly (E, K) was granted already (a candidate retrying); refused if
this server heard from N within ``aaabus.failover.delay_ms``, or has itself been running for
less than that (it could not have heard N yet: amended, docs/architecture.md); else the grant
and the epoch are persisted, then the answer given, and this server's link with N reset if it
speaks for an older epoch (:meth:`aaabus.io.network.Network.fence`): from then on N's links
below E are refused. A malformed request is answered ``{"ok": false, "error": "one line"}``.

Runs on the admin connection's thread; the book has its own lock, the network's calls are
thread-safe.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from aaabus.config.reader import BusConfig
from aaabus.errors import RequestRefused
from aaabus.io.network import Network
from aaabus.node.epochs import FIRST, EpochBook, VoteAnswer

__all__ = ["Voter"]

log = logging.getLogger("aaabus.voter")

#: The longest ``position`` accepted (a tid is 8 bytes: 16 hex digits).
_MAX_POSITION = 64


class Voter:
    """The voter of server ``server_id``: ``book`` its memory of epochs and grants, ``network``
    its links now (None before they start, or on a server without peers), ``delay_s`` the
    failover delay, counted from ``started`` (``time.monotonic()``) too."""

    def __init__(
        self,
        server_id: int,
        config: BusConfig,
        book: EpochBook,
        network: Callable[[], Network | None],
        delay_s: float,
        started: float,
    ) -> None:
        self.server_id = server_id
        self._config = config
        self._book = book
        self._network = network
        self._delay_s = delay_s
        self._started = started

    def answer(self, candidate: int, request: Any) -> dict[str, Any]:
        """The answer to ``request`` from a candidate of server ``candidate`` (any thread)."""
        try:
            if not isinstance(request, dict):
                raise RequestRefused("a request is a JSON object")
            op = request.get("op")
            if op not in ("vote", "whois"):
                raise RequestRefused(
                    f"a candidate's session may ask only vote or whois, not {op!r}"
                )
            if request.get("server") != candidate:
                raise RequestRefused(
                    f"this session proved server {candidate}'s key: it may ask about server "
                    f"{candidate} only, not {request.get('server')!r}"
                )
            if op == "whois":
                epoch, member = self._book.known(candidate) or (0, 0)
                return {"ok": True, "epoch": epoch, "member": member}
            return self._vote(candidate, request)
        except RequestRefused as exc:
            return {"ok": False, "error": str(exc)}

    def _vote(self, server: int, request: dict[str, Any]) -> dict[str, Any]:
        epoch = _integer(request, "epoch", 2)
        member = _integer(request, "member", 0)
        members = {0} | {r.index for r in self._config.servers[server].replicas}
        if member not in members:
            raise RequestRefused(
                f"server {server} has no member {member} (members: "
                f"{', '.join(map(str, sorted(members)))})"
            )
        position = request.get("position")
        if not isinstance(position, str) or len(position) > _MAX_POSITION:
            raise RequestRefused("'position' must be the hex tid of the candidate's last commit")
        network = self._network()
        silent = math.inf if network is None else network.silent_for(server)
        running = time.monotonic() - self._started
        if running < self._delay_s and self._book.granted(server) != (epoch, member):
            # It has not had the time to hear N: N may be alive (a retried grant it gave before
            # its restart is still answered, by the book).
            verdict = VoteAnswer(
                False,
                *(self._book.known(server) or FIRST),
                f"this voter started {running:.3f} s ago, less than the failover delay of "
                f"{self._delay_s:g} s: it cannot tell yet whether server {server} is alive",
            )
        else:
            verdict = self._book.grant(server, epoch, member, silent, self._delay_s)
        if verdict.granted:
            log.info(
                "server %d: granted epoch %d of server %d to its member %d (%s; position %s)",
                self.server_id,
                epoch,
                server,
                member,
                verdict.why,
                position,
            )
            if network is not None:
                network.fence(server, epoch)
        else:
            log.info(
                "server %d: refused epoch %d of server %d to its member %d: %s",
                self.server_id,
                epoch,
                server,
                member,
                verdict.why,
            )
        return {
            "ok": True,
            "granted": verdict.granted,
            "epoch": verdict.epoch,
            "member": verdict.member,
            "why": verdict.why,
        }


def _integer(request: dict[str, Any], field: str, low: int) -> int:
    value = request.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 1 << 63:
        raise RequestRefused(f"'{field}' must be an integer of at least {low}, not {value!r}")
    return value
