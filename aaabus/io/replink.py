"""The blocking, authenticated connection between a server and one of its replicas.

The handshake is the links' (:mod:`aaabus.wire.frames`) with role
:data:`~aaabus.wire.frames.ROLE_REPLICA`: the server (the connector) and its replica (the
acceptor) both prove server N's key of its link with itself (``ServerKeys.link_key(N)``, see
:mod:`aaabus.config.secret`), which no other server holds and which opens no link between two
servers; the role is inside every MAC, so the same key cannot be replayed as anything else.
A replica accepts only its own server's id. Then every frame is sequenced and MACed by a
:class:`~aaabus.wire.frames.SessionCipher`; payloads are the bytes of
:mod:`aaabus.core.replication`, not JSON.

Threads: one thread sends (:meth:`ReplicaLink.send_many`) while another receives
(:meth:`ReplicaLink.receive_bytes`, or :meth:`ReplicaLink.receive_ready` by whichever thread
holds the caller's read lock): the cipher keeps the two directions apart, and each direction
has one user at a time. Blocking sockets; :meth:`close` from any thread ends both.
"""

from __future__ import annotations

import contextlib
import socket
import time

from aaabus.errors import WireError
from aaabus.io.adminlink import AdminLink, connect
from aaabus.wire.frames import ROLE_REPLICA, AcceptorHandshake, ConnectorHandshake

__all__ = ["ReplicaLink"]

#: TCP keepalive on replication links: a peer whose machine vanished without closing the
#: connection is noticed after about 5 + 3 x 1 s (a stopped process is not: its kernel answers).
KEEPALIVE = ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 1), (socket.TCP_KEEPCNT, 3))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE:
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


class ReplicaLink(AdminLink):
    """One authenticated replication connection (either end)."""

    @classmethod
    def dial(
        cls,
        address: tuple[str, int],
        key: bytes,
        server_id: int,
        *,
        timeout: float,
        max_frame: int,
    ) -> ReplicaLink:
        """The server's side: connect to its replica at ``address`` and authenticate both ways
        within ``timeout`` seconds. Raises :class:`ServerUnreachable` (nothing listens) or
        :class:`WireError` / ``OSError`` (the handshake failed or the connection dropped)."""
        sock = connect(address, timeout, f"replica of server {server_id}")
        link = cls(sock, time.monotonic() + timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = ConnectorHandshake(key, server_id, server_id, ROLE_REPLICA)
            sock.sendall(handshake.receive(link._read_raw()))
            handshake.receive(link._read_raw())
            link._authenticated(handshake.cipher(), max_frame)
        except BaseException:
            link.close()
            raise
        link._deadline = None
        sock.settimeout(None)
        _keepalive(sock)
        return link

    @classmethod
    def answer(
        cls, sock: socket.socket, key: bytes, server_id: int, max_frame: int, deadline: float
    ) -> ReplicaLink:
        """The replica's side: authenticate an accepted connection as coming from server
        ``server_id`` itself, by ``deadline`` (``time.monotonic()``). Raises ``TimeoutError``,
        :class:`WireError` (another id, another role, a wrong key) or ``OSError``."""
        link = cls(sock, deadline)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake = AcceptorHandshake(key, server_id, (server_id,), (ROLE_REPLICA,))
        sock.sendall(handshake.start())
        sock.sendall(handshake.receive(link._read_raw()))
        link._authenticated(handshake.cipher(), max_frame)
        link._deadline = None
        sock.settimeout(None)
        _keepalive(sock)
        return link

    def wrap(self, payloads: list[bytes]) -> bytes:
        """The bytes that carry ``payloads``, in order (each gets the next sequence number: the
        caller writes them in the order it wrapped them)."""
        cipher = self._cipher
        if cipher is None:
            raise WireError("replication link is not authenticated")
        return b"".join([cipher.wrap_frame(p) for p in payloads])

    def send_many(self, payloads: list[bytes]) -> None:
        """Send ``payloads`` in order, in one write."""
        self.sock.sendall(self.wrap(payloads))

    def send_now(self, data: bytes) -> int:
        """Write what the socket takes of ``data`` without blocking; how many bytes it took."""
        try:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def send_all(self, data: bytes) -> None:
        """Write all of ``data`` (blocking)."""
        self.sock.sendall(data)

    def buffered(self) -> bool:
        """Whether a whole frame is already read and waiting (the next receive won't block)."""
        return bool(self._frames)

    def receive_bytes(self) -> bytes:
        """The next payload; ``ConnectionResetError`` at the end of the stream."""
        cipher = self._cipher
        if cipher is None:
            raise WireError("replication link is not authenticated")
        return cipher.unwrap(self._read_raw())

    def receive_ready(self) -> list[bytes]:
        """The payloads of every whole frame that has arrived, without blocking (maybe none);
        ``ConnectionResetError`` at the end of the stream once nothing is left before it. Not
        to be mixed with a blocking receive in another thread: the caller serialises readers."""
        cipher = self._cipher
        if cipher is None:
            raise WireError("replication link is not authenticated")
        ended = False
        while True:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not data:
                ended = True
                break
            self._frames.extend(self._decoder.feed(data))
            if len(data) < 65536:
                break
        payloads = [cipher.unwrap(frame) for frame in self._frames]
        self._frames.clear()
        if ended and not payloads:
            raise ConnectionResetError("connection closed by the other end")
        return payloads

    def receive_within(self, seconds: float) -> bytes:
        """The next payload, within ``seconds`` (``TimeoutError`` after); blocking again after."""
        self._deadline = time.monotonic() + seconds
        try:
            return self.receive_bytes()
        finally:
            self._deadline = None
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)

    @classmethod
    def ask(
        cls,
        address: tuple[str, int],
        key: bytes,
        server_id: int,
        question: bytes,
        timeout: float,
        max_frame: int,
    ) -> bytes:
        """One question to a member of server ``server_id`` on a connection of its own, and its
        answer, within ``timeout`` seconds in all (the failover's FENCE and WHOIS). Raises what
        :meth:`dial` raises, or ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        link = cls.dial(address, key, server_id, timeout=timeout, max_frame=max_frame)
        try:
            link.send_many([question])
            return link.receive_within(max(0.0, deadline - time.monotonic()))
        finally:
            link.close()

    def close(self) -> None:
        """Close both directions (a thread blocked in a read returns)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        super().close()
