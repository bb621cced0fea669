"""A blocking, authenticated connection carrying JSON objects: both ends of the admin protocol.

The handshake is exactly the one of the links between servers (:mod:`aaabus.wire.frames`): a
mutual HMAC challenge-response on the admin key of that server for the tool's scope (see
:mod:`aaabus.config.secret`), the scope being the connector's role, inside every MAC; then every
frame sequenced and MACed by a :class:`~aaabus.wire.frames.SessionCipher`. The proof is mutual: a
tool that talks to server N learns that the other end holds server N's admin key for its scope,
which neither another server's key file nor a key of another scope gives, before it sends a
request or reads an answer. Server ids and client ids share the handshake's 32-bit id field, so
clients take their ids in a reserved range, :data:`CLIENT_ID_BASE` (2**31) and above;
:meth:`AdminLink.accept` refuses any other connector id, except for one role: a member of server
N standing as candidate in a failover (:data:`~aaabus.wire.frames.ROLE_CANDIDATE`, issue 42)
connects as server N with the link key of N and the voter (:meth:`AdminLink.candidate`). Runs
on the caller's thread (a tool's, or one admin connection thread of the server); blocking
sockets, no selector, no store.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from aaabus.config.scopes import Scope
from aaabus.config.secret import Credential, as_credential
from aaabus.errors import AdminError, AuthError, ServerBusy, ServerUnreachable, WireError
from aaabus.wire.frames import (
    HANDSHAKE_MAX_FRAME,
    MAX_SERVER_ID,
    ROLE_CANDIDATE,
    AcceptorHandshake,
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
)

__all__ = ["CLIENT_ID_BASE", "AdminLink"]

#: Handshake ids from here up are clients (tools, programs), never servers.
CLIENT_ID_BASE = 0x8000_0000

#: Seconds each member's address gets in the first round of :meth:`AdminLink.connect_any`: a
#: live server on a LAN accepts and challenges within milliseconds.
QUICK_S = 1.0

#: The reason of a :class:`ServerUnreachable` whose connection attempt ran out of time.
TIMED_OUT = "timed out"


def connect(address: tuple[str, int], timeout: float, who: str) -> socket.socket:
    """A TCP connection to ``who`` at ``address``; :class:`ServerUnreachable` in one line
    naming it when nothing answers there (its ``reason``: why, alone)."""
    try:
        return socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        reason = TIMED_OUT if isinstance(exc, TimeoutError) else str(exc.strerror or exc)
        raise ServerUnreachable(
            f"{who} does not answer on {_where(address)} ({reason})", reason=reason
        ) from None


def _where(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


class AdminLink:
    """A blocking, authenticated connection carrying JSON objects in session frames.

    Used by both ends; not thread-safe (one request at a time).
    """

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self.sock = sock
        #: While set (the handshake), every read is bounded by this ``time.monotonic()`` value.
        self._deadline = deadline
        self._cipher: SessionCipher | None = None
        # Until the peer has authenticated, frames are held to the handshake's tiny limit.
        self._decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self._frames: deque[bytes] = deque()

    def _authenticated(self, cipher: SessionCipher, max_frame: int) -> None:
        self._cipher = cipher
        self._decoder.max_frame = max_frame + SessionCipher.OVERHEAD

    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        secret: bytes | Credential,
        server_id: int,
        *,
        timeout: float = 5.0,
        max_frame: int = 16 << 20,
        tls: ssl.SSLContext | None = None,
    ) -> AdminLink:
        """Connect to the admin endpoint of ``server_id`` and authenticate both ways.

        With ``tls`` (the dialing context of :func:`aaabus.io.tls.tls_contexts`) the connection
        runs inside TLS first, as the server's does when its config sets ``aaabus.tls.cert``.
        ``secret``: the bus key (bytes, claiming the default scope) or a
        :class:`~aaabus.config.secret.Credential` (a bus key or a tool key file's); either way the
        handshake proves the admin key of ``server_id`` for the credential's scope, never the bus
        key nor the tool key, and the server must prove it back.
        Raises :class:`ServerUnreachable` when nothing listens, :class:`AdminError` when the
        handshake fails (another bus's secret, another server or an impostor on that port, another
        wire version, a certificate the server does not accept).
        """
        # A fresh random client id per connection: ids only have to differ from server ids.
        client_id = secrets.randbelow(MAX_SERVER_ID - CLIENT_ID_BASE + 1) + CLIENT_ID_BASE
        credential = as_credential(secret)
        return cls._open(
            address,
            credential.admin_key(server_id),
            client_id,
            server_id,
            credential.scope,
            timeout=timeout,
            max_frame=max_frame,
            tls=tls,
        )

    @classmethod
    def candidate(
        cls,
        address: tuple[str, int],
        link_key: bytes,
        candidate_id: int,
        voter_id: int,
        *,
        timeout: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> AdminLink:
        """Connect to the admin endpoint of ``voter_id`` as a member of server ``candidate_id``
        standing in a failover (role :data:`~aaabus.wire.frames.ROLE_CANDIDATE`), proving
        ``link_key``, the key of the link between the two servers. Raises as :meth:`connect`."""
        return cls._open(
            address, link_key, candidate_id, voter_id, ROLE_CANDIDATE, timeout=timeout, tls=tls
        )

    @classmethod
    def _open(
        cls,
        address: tuple[str, int],
        key: bytes,
        my_id: int,
        server_id: int,
        role: int,
        *,
        timeout: float,
        max_frame: int = 16 << 20,
        tls: ssl.SSLContext | None,
    ) -> AdminLink:
        where = f"server {server_id} at {address[0]}:{address[1]}"
        sock = connect(address, timeout, f"server {server_id}")
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=address[0])
            except ssl.SSLError as exc:
                sock.close()
                raise AdminError(f"{where}: TLS handshake failed ({exc.reason or exc})") from None
            except OSError as exc:
                sock.close()
                raise ServerBusy(
                    f"{where} is busy: it accepted the connection and dropped it during TLS "
                    f"({exc.strerror or exc}); try again later"
                ) from None
        link = cls(sock)
        answered = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake = ConnectorHandshake(key, my_id, server_id, role)
            sock.sendall(handshake.receive(link._read_raw()))
            answered = True
            handshake.receive(link._read_raw())
            link._authenticated(handshake.cipher(), max_frame)
            return link
        except WireError as exc:
            link.close()
            raise AdminError(f"{where}: {exc}") from None
        except OSError as exc:
            link.close()
            if answered:
                # It challenged us and hung up on our answer: it refused our proof.
                raise AdminError(
                    f"{where} refused the authentication: it does not use this bus secret (or "
                    "this tool key was made from another bus key)"
                ) from None
            # Something listens and took the connection, but dropped it (or kept silent)
            # before its challenge: the server is up and turning connections away.
            raise ServerBusy(
                f"{where} is busy or expects TLS: it accepted the connection and dropped it "
                f"before the handshake ({exc.strerror or exc}); try again later, or check the "
                "config's aaabus.tls.* properties"
            ) from None

    @classmethod
    def connect_any(
        cls,
        addresses: Sequence[tuple[str, int]],
        secret: bytes | Credential,
        server_id: int,
        *,
        first: int = 0,
        timeout: float = 5.0,
        max_frame: int = 16 << 20,
        tls: ssl.SSLContext | None = None,
    ) -> tuple[AdminLink, int]:
        """:meth:`connect` to the first of ``addresses`` that answers, starting at ``first`` and
        going round; returns the link and the position of its address.

        The addresses of one server's members
        (:func:`~aaabus.config.admin_port.member_admin_addresses`): only the primary listens, so
        an address where nothing listens (refused, no answer) or where the connection is taken
        and dropped (busy) sends the tool to the next. A failed handshake (:class:`AdminError`:
        another bus's key, TLS) ends it at once: another member would refuse the same key.

        With several addresses, a first round gives each at most :data:`QUICK_S` (a member
        whose machine is gone, or a process stopped with its port open, would otherwise hold
        the tool for the whole ``timeout`` before the primary is tried); the addresses that ran
        out of time, and only those, get a second round with the whole ``timeout``. A refused
        address is not tried again. When none answers, raises the first :class:`ServerBusy` if
        one was busy (a server runs there), else one :class:`ServerUnreachable` line naming
        every address tried and why.
        """
        if not addresses:
            raise ServerUnreachable(f"server {server_id} has no admin address")
        order = [(first + step) % len(addresses) for step in range(len(addresses))]
        rounds = [(order, min(timeout, QUICK_S) if len(order) > 1 else timeout)]
        outcome: dict[int, str] = {}
        busy: ServerBusy | None = None
        while rounds:
            ats, limit = rounds.pop()
            slow: list[int] = []
            for at in ats:
                try:
                    link = cls.connect(
                        addresses[at],
                        secret,
                        server_id,
                        timeout=limit,
                        max_frame=max_frame,
                        tls=tls,
                    )
                except ServerBusy as exc:
                    busy = busy or exc
                    outcome[at] = "busy"
                    slow.append(at)
                    continue
                except ServerUnreachable as exc:
                    outcome[at] = exc.reason
                    if exc.reason == TIMED_OUT:
                        slow.append(at)
                    continue
                return link, at
            if slow and limit < timeout:
                rounds.append((slow, timeout))
        if busy is not None:
            raise busy
        tried = [f"{_where(addresses[at])} ({outcome[at]})" for at in order]
        if len(tried) == 1:
            raise ServerUnreachable(f"server {server_id} does not answer on {tried[0]}")
        raise ServerUnreachable(
            f"server {server_id} does not answer on any of its members' admin addresses: "
            + ", ".join(tried)
        )

    @classmethod
    def accept(
        cls,
        sock: socket.socket,
        admin_key: Callable[[Scope], bytes],
        server_id: int,
        max_frame: int,
        deadline: float,
        candidate_key: Callable[[int], bytes] | None = None,
    ) -> tuple[AdminLink, int, int]:
        """Authenticate an accepted connection by ``deadline`` (``time.monotonic()``); returns
        the link, the connector's id and the role it proved (a scope's value, or
        :data:`~aaabus.wire.frames.ROLE_CANDIDATE`). ``admin_key``: this server's admin key for
        a scope (what clients of that scope prove, from client ids only). ``candidate_key``:
        the key of this server's link with a server id, for the candidates of a failover (None:
        that role is refused); it raises :class:`AuthError` for a server it has no key for.
        Raises ``TimeoutError`` past the deadline, however slowly the bytes trickle in."""
        link = cls(sock, deadline)
        # Never ROLE_SERVER: servers have no business here, but as candidates.
        roles = [int(scope) for scope in Scope]
        if candidate_key is not None:
            roles.append(ROLE_CANDIDATE)

        def key_for(connector: int, role: int) -> bytes:
            # Checked before any key is derived, so before the MAC and the proof.
            if role == ROLE_CANDIDATE:
                assert candidate_key is not None
                if connector >= CLIENT_ID_BASE:
                    raise AuthError(f"id {connector} is a client id, not a server id")
                return candidate_key(connector)
            if connector < CLIENT_ID_BASE:
                raise AuthError(f"id {connector} is a server id, not a client id")
            return admin_key(Scope(role))

        handshake = AcceptorHandshake(key_for, server_id, None, roles)
        sock.sendall(handshake.start())
        proof = handshake.receive(link._read_raw())
        connector, role = handshake.peer_id, handshake.role
        assert connector is not None and role is not None
        sock.sendall(proof)
        link._authenticated(handshake.cipher(), max_frame)
        link._deadline = None
        return link, connector, role

    def _read_raw(self) -> bytes:
        while not self._frames:
            if self._deadline is not None:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("handshake deadline passed")
                self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionResetError("connection closed by the other end")
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()

    def send(self, obj: Any) -> None:
        assert self._cipher is not None, "not authenticated"
        payload = json.dumps(obj, separators=(",", ":")).encode()
        self.sock.sendall(self._cipher.wrap_frame(payload))

    def receive(self) -> Any:
        """The next JSON object; raises ConnectionResetError at the end of the stream."""
        assert self._cipher is not None, "not authenticated"
        payload = self._cipher.unwrap(self._read_raw())
        try:
            return json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireError(f"admin frame is not JSON ({exc})") from None

    def request(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.send(obj)
        answer = self.receive()
        if not isinstance(answer, dict):
            raise WireError("admin answer is not a JSON object")
        return answer

    def wait_closed(self, timeout: float) -> bool:
        """Wait for the other end to close (True) or the deadline (False)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
