"""The accepting side of a network: its listening sockets and the waiting room of connections
that have not authenticated yet.

Only lower ids dial us, so anyone may connect, and until a connection has proven it holds a
pair's key (:mod:`aaabus.wire.frames`) it costs a file descriptor and may never finish its
handshake. The :class:`Acceptor` keeps such connections in two bounded waiting rooms
(:class:`~aaabus.io.gate.PendingTable`, evicting the oldest when full): one for the addresses of
the configured peers, and a small one for every other address, which can never authenticate
here, so that a flood from strangers cannot push a peer's handshake out. Refusals are logged
through a :class:`~aaabus.io.gate.RefusalLog` (rate-limited: the log cannot amplify a flood).
I/O thread only, apart from :meth:`Acceptor.bind` and :meth:`Acceptor.close` (the owner's).
"""

from __future__ import annotations

import errno
import functools
import logging
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from aaabus.errors import NetworkError
from aaabus.io.connection import Connection, tune
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.io.loop import Loop

__all__ = ["Acceptor"]

#: Unauthenticated connections held at once from the configured peers' addresses, in all and per
#: address (both raised to two per configured peer where peers share an address: see open());
#: beyond either bound the oldest waiting one is evicted (see aaabus.io.gate).
_MAX_PENDING = 256
_MAX_PENDING_PER_ADDRESS = 64
#: The same for addresses that are no peer's: they can never authenticate here, so a flood from
#: them gets a small room of its own and cannot push a peer's connection out.
_MAX_STRANGERS = 32
_MAX_STRANGERS_PER_ADDRESS = 8
#: Connections taken from a listening socket per turn: a flood cannot starve established links.
_ACCEPTS_PER_TURN = 64


class Acceptor:
    """Listening sockets and waiting rooms of one network (see the module docstring).

    ``adopt(conn)`` takes in a new connection (tracking, handshake deadline), ``begin(conn)``
    starts its TLS or aaabus handshake, ``close(conn, reason, level)`` closes one evicted from a
    waiting room. ``where`` names this server and network in the errors of :meth:`bind`.
    """

    def __init__(
        self,
        loop: Loop,
        *,
        adopt: Callable[[Connection], None],
        begin: Callable[[Connection], None],
        close: Callable[[Connection, str, int], None],
        log: logging.Logger,
        name: str,
        where: str,
    ) -> None:
        self._loop = loop
        self._adopt = adopt
        self._begin = begin
        self._close = close
        self._log = log
        self._name = name
        self._where = where
        self._listeners: list[socket.socket] = []
        self._pending: PendingTable[Connection] = PendingTable(
            _MAX_PENDING, _MAX_PENDING_PER_ADDRESS
        )
        self._strangers: PendingTable[Connection] = PendingTable(
            _MAX_STRANGERS, _MAX_STRANGERS_PER_ADDRESS
        )
        self._peer_addresses: frozenset[str] = frozenset()
        #: Where refused connections are logged, rate-limited.
        self.refusals = RefusalLog(log, name)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The bound listen addresses (useful when listening on port 0)."""
        return [s.getsockname()[:2] for s in self._listeners]

    def bind(self, listen: Sequence[tuple[str, int]]) -> None:
        """Bind every address of ``listen``, or none: raises :class:`NetworkError`."""
        try:
            for host, port in listen:
                self._listeners.append(self._bind(host, port))
        except BaseException:
            self.close()
            raise

    def open(self, peer_hosts: Sequence[str]) -> None:
        """Size the waiting rooms for the peers that dial us (at ``peer_hosts``, one entry per
        peer) and start accepting on ``loop``."""
        self._peer_addresses = _addresses_of(peer_hosts)
        # A host may run many peers (a bus on one machine, a rack behind one NAT address): each
        # may have a handshake under way at boot, so such an address gets room for two per peer
        # (its dial and ours) instead of the flat cap, which made big flat domains on one host
        # evict each other's handshakes and boot slower than their launchers wait.
        per_host: Counter[str] = Counter()
        for host, peers in Counter(peer_hosts).items():
            for address in _addresses_of([host]):
                per_host[address] += peers
        room = {a: 2 * n for a, n in per_host.items() if 2 * n > _MAX_PENDING_PER_ADDRESS}
        self._pending = PendingTable(
            max(_MAX_PENDING, sum(2 * n for n in per_host.values())), _MAX_PENDING_PER_ADDRESS, room
        )
        for lsock in self._listeners:
            self._loop.listen(lsock, functools.partial(self._accept, lsock))

    def forget(self, conn: Connection) -> None:
        """``conn`` leaves the waiting room: authenticated, or closed."""
        if not self._pending.remove(conn):
            self._strangers.remove(conn)

    def close(self) -> None:
        """Close the listening sockets."""
        for lsock in self._listeners:
            lsock.close()
        self._listeners.clear()

    def _accept(self, lsock: socket.socket) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving established links
                self._log.warning("%s: accept failed: %s", self._name, exc)
                return
            label = f"{addr[0]}:{addr[1]}"
            sock.setblocking(False)
            tune(sock)
            conn = Connection(sock, label, outgoing=False, peer=None, host=addr[0])
            self._adopt(conn)
            table = self._pending if addr[0] in self._peer_addresses else self._strangers
            for old in table.add(conn, addr[0]):
                self._close(old, "evicted: too many unauthenticated connections", logging.DEBUG)
            self._begin(conn)

    def _bind(self, host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            # create_server sets SO_REUSEADDR, so a restarted server can rebind a port whose old
            # connections linger in TIME_WAIT; a port with a live listener still fails.
            lsock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            detail = exc.strerror or str(exc)
            if exc.errno == errno.EADDRINUSE:
                raise NetworkError(
                    f"port {port} on {host} is in use {self._where}: {detail}"
                ) from None
            raise NetworkError(f"cannot listen on {host}:{port} {self._where}: {detail}") from None
        lsock.setblocking(False)
        return lsock


def _addresses_of(hosts: Iterable[str]) -> frozenset[str]:
    """The numeric addresses ``hosts`` resolve to now (a host that does not resolve: none)."""
    found: set[str] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found.update(str(info[4][0]) for info in infos)
    return frozenset(found)
