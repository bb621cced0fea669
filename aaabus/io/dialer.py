"""The dialling side of a network: one connection attempt at a time to each higher peer.

Exactly one long-lived TCP connection per pair of servers: the lower id connects to the higher
id's address, the higher id accepts. A single dialling side means two servers can never race to
open two connections to each other. The :class:`Dialer` opens a non-blocking connect to each
higher peer (state CONNECTING of :mod:`aaabus.io.states`), hands it to the network once the
connect succeeds, and, whenever an attempt fails or a link is lost, dials again after the delay
of that peer's :class:`~aaabus.io.peerdial.PeerDial` (jittered exponential backoff, reset once a
session frame of the link passes its MAC).

A peer may have several addresses, one per member of that server (issue 42: whichever member
is its primary listens on the server's port on its own host): a failed attempt or a lost link
moves on to the next address at once, and the backoff delay is taken only once every address
of the round has failed, so that finding a new primary costs one connect per member, not one
backoff per member. A lost link is dialled again at the next address as well: its primary may
have moved.

Host names are resolved on the I/O thread at each dial (``getaddrinfo`` blocks, so prefer
numeric addresses or names in ``/etc/hosts``). I/O thread only (no lock).
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence

from aaabus.io.connection import Connection, tune
from aaabus.io.loop import Loop
from aaabus.io.peerdial import PeerDial

__all__ = ["Dialer"]


class Dialer:
    """Dials the peers of ``peers`` (the higher ids: peer -> address) on ``loop``'s thread.

    ``adopt(conn)`` takes in a new connection (tracking, handshake deadline) before its connect
    starts; ``begin(conn)`` starts its TLS or aaabus handshake once connected; ``fail(conn,
    reason)`` closes it. The network calls :meth:`connected`, :meth:`verified` and
    :meth:`lost` back.
    """

    def __init__(
        self,
        loop: Loop,
        peers: Mapping[int, Sequence[tuple[str, int]]],
        *,
        adopt: Callable[[Connection], None],
        begin: Callable[[Connection], None],
        fail: Callable[[Connection, str], None],
        log: logging.Logger,
        name: str,
    ) -> None:
        self._loop = loop
        self._peers = {peer: tuple(addresses) for peer, addresses in peers.items()}
        self._adopt = adopt
        self._begin = begin
        self._fail = fail
        self._log = log
        self._name = name
        self._dials: dict[int, PeerDial[Connection]] = {p: PeerDial() for p in self._peers}

    def start(self) -> None:
        """Dial every peer on the loop's first turn."""
        now = time.monotonic()
        for peer in self._dials:
            self._loop.call_at(now, self._due, peer)

    def connected(self, conn: Connection) -> None:
        """``conn``'s connect finished (its socket turned writable): on to its handshake."""
        err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._fail(conn, f"connect failed: {errno.errorcode.get(err, err)}")
            return
        self._begin(conn)

    def verified(self, peer: int) -> None:
        """The link with ``peer`` works (a session frame passed its MAC): only now does a dial
        count as a success, so that a peer, or a relay, that completes handshakes and then
        breaks the session does not earn fast redials."""
        self._dials[peer].succeeded()

    def first_time(self, peer: int, reason: str) -> bool:
        """Whether ``reason`` differs from the previous failure of dialling ``peer``."""
        return self._dials[peer].first_time(reason)

    def lost(self, conn: Connection) -> None:
        """``conn``, one of ours, closed: dial its peer's next address, at once within a
        round of its addresses, after the backoff delay when the round is over."""
        assert conn.peer is not None
        dial = self._dials[conn.peer]
        if dial.conn is conn:
            dial.conn = None
            if not self._loop.stopping:
                self._redial(conn.peer, dial)

    def _redial(self, peer: int, dial: PeerDial[Connection]) -> None:
        dial.at = (dial.at + 1) % len(self._peers[peer])
        delay = dial.next_delay() if dial.at == 0 else 0.0
        self._loop.call_at(time.monotonic() + delay, self._due, peer)

    def _due(self, peer: int) -> None:
        """A dial timer fired: dial, unless a connection is already there (a stale timer)."""
        dial = self._dials[peer]
        if dial.conn is None and not self._loop.stopping:
            self._dial(peer, dial)

    def _dial(self, peer: int, dial: PeerDial[Connection]) -> None:
        host, port = self._peers[peer][dial.at]
        label = f"{host}:{port}"
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self._log.debug("%s: cannot dial server %d at %s: %s", self._name, peer, label, exc)
            self._redial(peer, dial)
            return
        sock.setblocking(False)
        tune(sock)
        conn = Connection(sock, label, outgoing=True, peer=peer, host=host)
        dial.conn = conn
        self._adopt(conn)
        err = sock.connect_ex(sockaddr)
        if err in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._loop.watch(conn, selectors.EVENT_WRITE)  # writable: the connect's outcome
        else:
            self._fail(conn, f"connect failed: {errno.errorcode.get(err, err)}")
