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
from collections.abc import Callable
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


def connect(address: tuple[str, int], timeout: float, who: str) -> socket.socket:
    """A TCP connection to ``who`` at ``address``; :class:`ServerUnreachable` in one line
    naming it when nothing answers there."""
    try:
        return socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ServerUnreachable(
            f"{who} does not answer on {address[0]}:{address[1]} ({exc.strerror or exc})"
        ) from None


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
