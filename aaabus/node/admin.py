"""The admin endpoint of an agent server: its listener and connections.

Each server process listens on one more TCP port, its **admin port**, for the tools of the bus
(``aaabus status``, ``aaabus stop``, ``aaabus send``, :class:`aaabus.tools.client.Client`).
The port is property ``aaabus.admin.port`` of the server, by default its first network port
+ 1000 (:data:`aaabus.config.admin_port.ADMIN_PORT_OFFSET`), bound on the server's ``hostname``.

Authentication
    Exactly the handshake of the links between servers (:mod:`aaabus.wire.frames`): a mutual HMAC
    challenge-response on this server's admin key for the scope the tool claims (derived from the
    tool key of that scope and this server's id; it opens no link between servers and no other
    server's admin port, see :mod:`aaabus.config.secret`), then every frame sequenced and MACed by
    a :class:`~aaabus.wire.frames.SessionCipher`. Server ids and client ids share the handshake's
    32-bit id field, so clients take their ids in a reserved range (:mod:`aaabus.io.adminlink`) and
    above; the endpoint refuses any other connector id and the role of a server, and the network
    ports refuse client ids and tools' roles (they only accept the configured peers). Nothing is
    read from a connection beyond the 256-byte handshake limit before the peer has proven it holds
    an admin key of this server. Each request is then checked against the scope the session
    proved (:mod:`aaabus.node.rights`).

Protocol
    After the handshake the client sends requests and the server answers each in order, one
    session frame each, both as UTF-8 JSON objects: ``{"op": "status"}`` (with
    ``"detail": true``, the lists the console shows: :func:`~aaabus.node.status.server_status`),
    ``{"op": "stop"}``,
    ``{"op": "send", "id": ..., "to": "#o.s.n", "note": <base64 body>}``,
    ``{"op": "deploy", "id": ..., "agent": <base64 body>, "server": n}``,
    ``{"op": "publish", "id": ..., "topic": ..., "payload": <base64 value>, "retain": b}``,
    ``{"op": "subscribe", "name": ..., "filter": ..., "durable": b}`` (open a client subscription's
    mailbox; ``durable``: a named one, default true),
    ``{"op": "fetch", "name": ..., "after": n, "most": k, "wait": s}`` (acknowledge up to ``n``,
    get what follows, waiting up to ``s`` seconds), ``{"op": "unsubscribe", "name": ...}``,
    ``{"op": "request", "id": ..., "to": ..., "note": ...}`` (its reply is fetched from mailbox
    ``request-<id>``; see :mod:`aaabus.node.mailboxes`),
    ``{"op": "failpoints", "arm": "name:action[:skip[:times]]"}`` (tests only, see
    :meth:`AgentServer.arm_failpoints`). A member of server N standing as candidate in a failover
    (role :data:`~aaabus.wire.frames.ROLE_CANDIDATE`, connector id N, N's link key with this
    server; issue 42) may ask ``{"op": "vote", ...}`` and ``{"op": "whois", ...}`` about N and
    nothing else (:mod:`aaabus.node.voter`). Answers are
    ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}`` (with ``"close": true`` when
    the request's body did not decode: the server then ends the connection). Notifications,
    payloads and agents are data, as between servers (:mod:`aaabus.wire.codec`), decoded only on
    an authenticated session; an agent by value (a pickle: code) only on a ``code`` session of a
    server that loads code; everything else is JSON, which carries no code either.

Threads
    One listener thread (``admin-<id>``) accepts connections and runs one short-lived thread per
    connection. Until it authenticates, a connection waits in a waiting room
    (:class:`~aaabus.io.gate.PendingTable`: at most :data:`MAX_PENDING`, and
    :data:`MAX_PENDING_PER_ADDRESS` per address, the oldest evicted beyond) and has
    :data:`HANDSHAKE_TIMEOUT` seconds from accept, enforced by the listener thread however slowly
    its bytes trickle in; at most :data:`MAX_CONNECTIONS` authenticated sessions run at once,
    more are answered "busy". Of those, ``read`` sessions take at most :data:`READ_SESSIONS`
    (:data:`READ_SESSIONS_PER_ADDRESS` from one address), so the slots left are kept for the
    ``operate`` and ``code`` keys, which can stop the server anyway: a leaked read key cannot
    lock the operator out. A session is closed after :data:`IDLE_TIMEOUT` seconds without a
    request, and between two requests once it has lasted ``aaabus.admin.lifetime`` seconds,
    however often it asks: a cheap request every minute does not hold a slot forever (a
    :class:`~aaabus.tools.client.Client` reconnects by itself). Refusals are logged rate-limited
    (:class:`~aaabus.io.gate.RefusalLog`), so a flood cannot fill the log. Whatever reads or
    changes the store is handed to the engine thread (:mod:`aaabus.node.dispatch`, through the
    narrow :class:`~aaabus.node.control.NodeControl`), so status figures are one consistent
    snapshot and sends are committed by the engine like any other.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from aaabus.config.scopes import Scope
from aaabus.errors import AdminError, AuthError, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.io.tls import tls_contexts
from aaabus.node.control import NodeControl
from aaabus.node.dispatch import answer
from aaabus.node.rates import RateMeter
from aaabus.node.rights import Session
from aaabus.wire.frames import ROLE_CANDIDATE

__all__ = ["AdminEndpoint"]

log = logging.getLogger("aaabus.admin")

#: Concurrent authenticated admin sessions per server; more are told the server is busy.
MAX_CONNECTIONS = 32
#: Of those, the most ``read`` sessions, in all and from one address: the other slots are kept
#: for ``operate`` and ``code`` keys, which always get in while a read key floods the port.
READ_SESSIONS = 24
READ_SESSIONS_PER_ADDRESS = 8
#: Connections waiting to authenticate, in all and per address; beyond, the oldest is evicted.
MAX_PENDING = 32
MAX_PENDING_PER_ADDRESS = 16
#: Seconds a connection has to complete the handshake, from accept (an absolute deadline).
HANDSHAKE_TIMEOUT = 5.0
#: Seconds an authenticated connection may stay idle between requests. A live consumer fetches
#: far more often (a fetch waits at most 10 s on the server); a quiet tool reconnects.
IDLE_TIMEOUT = 60.0


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    endpoint: AdminEndpoint

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.endpoint._admit(request, client_address)

    def service_actions(self) -> None:
        # Called by serve_forever between polls: samples for the reactions-per-second figure
        # and enforces the handshake deadline, without a thread of their own.
        self.endpoint.rates.sample()
        self.endpoint._expire()


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        self.server.endpoint._serve(self.request, self.client_address)


class AdminEndpoint:
    """The admin listener of one server (see the module docstring)."""

    def __init__(self, server: NodeControl, address: tuple[str, int]) -> None:
        self.server = server
        self.rates = RateMeter(server.reactions)
        # ``_lock`` guards the connection sets: the listener thread admits and expires, the
        # connection threads authenticate and leave.
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending: PendingTable[socket.socket] = PendingTable(
            MAX_PENDING, MAX_PENDING_PER_ADDRESS
        )
        self._sessions = 0
        self._reads: Counter[str] = Counter()  # read sessions by address
        self._lifetime = float(server.config.setting(server.server_id, "aaabus.admin.lifetime"))
        self._refusals = RefusalLog(log, f"server {server.server_id}: admin port")
        self._closing = False
        # Clients prove this server's admin key of their scope (aaabus.config.secret), which
        # opens no link between servers and no other server's admin port.
        self._admin_key = server.keys.admin_key
        self._tls = tls_contexts(server.config, server.server_id)[0]
        try:
            self._tcp = _TCPServer(address, _Handler, bind_and_activate=True)
        except OSError as exc:
            raise AdminError(
                f"admin port {address[1]} on {address[0]} of server {server.server_id} is not "
                f"usable ({exc.strerror or exc}); set property aaabus.admin.port to a free port "
                "or to off"
            ) from None
        self._tcp.endpoint = self
        self._thread = threading.Thread(
            target=self._tcp.serve_forever,
            kwargs={"poll_interval": 0.25},
            name=f"admin-{server.server_id}",
            daemon=True,
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._tcp.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, then close every open connection (clients see the end of stream)."""
        with self._lock:
            self._closing = True
            conns = list(self._conns)
        # shutdown() waits for serve_forever to notice: only if it runs, and not from inside it.
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._tcp.shutdown()
        self._tcp.server_close()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _admit(self, sock: socket.socket, peer: Any) -> bool:
        """Listener thread: take ``sock`` into the waiting room, evicting the oldest if full."""
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        with self._lock:
            if self._closing:
                return False
            self._conns.add(sock)
            evicted = self._pending.add(sock, address, time.monotonic())
        for old in evicted:
            _hang_up(old)
            self._refusals.refused(address, "evicted: too many unauthenticated connections")
        return True

    def _expire(self) -> None:
        """Listener thread: hang up on connections past their handshake deadline."""
        with self._lock:
            late = self._pending.added_before(time.monotonic() - HANDSHAKE_TIMEOUT)
        for sock in late:
            _hang_up(sock)

    def _session(self, client: int, scope: Scope | None) -> Callable[[Any], dict[str, Any]]:
        """How the session of ``client`` answers each request: a tool's, checked against its
        scope (:mod:`aaabus.node.rights`); a candidate's (``scope`` None), only ``vote`` and
        ``whois``, for its own server (:class:`aaabus.node.voter.Voter`)."""
        server = self.server
        if scope is None:
            voter = server.voter
            assert voter is not None  # the role is offered only then
            return partial(voter.answer, client)
        session = Session(scope)

        def serve(request: Any) -> dict[str, Any]:
            return session.serve(request, partial(answer, server, self.rates, session, request))

        return serve

    def _candidate_key(self, candidate: int) -> bytes:
        """The key a candidate for server ``candidate`` proves here: that server's link key
        with this one (connection thread, in the handshake; AuthError if there is none)."""
        server = self.server
        if candidate not in server.config.servers:
            raise AuthError(f"candidate for server {candidate}, which is not in this bus")
        try:
            return server.keys.link_key(candidate)
        except KeyError:
            raise AuthError(
                f"candidate for server {candidate}: this server's key file has no key for it"
            ) from None

    def _authenticated(self, sock: socket.socket, scope: Scope | None, address: str) -> str | None:
        """Leave the waiting room for a session slot: ``None``, or why none is given (any
        connection thread). ``scope`` None: a candidate's, counted with the others."""
        with self._lock:
            self._pending.remove(sock)
            if self._sessions >= MAX_CONNECTIONS:
                return "busy: every admin session is taken"
            if scope is Scope.READ:
                if self._reads.total() >= READ_SESSIONS:
                    return "busy: every admin session for read keys is taken"
                if self._reads[address] >= READ_SESSIONS_PER_ADDRESS:
                    return (
                        f"busy: {address} already holds {READ_SESSIONS_PER_ADDRESS} read "
                        "sessions; close one"
                    )
                self._reads[address] += 1
            self._sessions += 1
            return None

    def _left(self, scope: Scope | None, address: str) -> None:
        """Give back a session slot (its connection thread, at the end)."""
        with self._lock:
            self._sessions -= 1
            if scope is Scope.READ:
                self._reads[address] -= 1
                if not self._reads[address]:
                    del self._reads[address]

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        server = self.server
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        address = peer[0] if isinstance(peer, tuple) else str(peer)
        proved: Scope | None = None  # the tool's scope; None for a candidate (ROLE_CANDIDATE)
        slot = False  # whether the session holds a slot
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                try:
                    sock = self._wrap(sock)
                except (ssl.SSLError, OSError) as exc:
                    self._refusals.refused(where, f"TLS handshake failed ({exc})")
                    return
            try:
                link, client, role = AdminLink.accept(
                    sock,
                    self._admin_key,
                    server.server_id,
                    server.max_frame,
                    deadline,
                    None if server.voter is None else self._candidate_key,
                )
            except (WireError, OSError) as exc:
                self._refusals.refused(where, str(exc) or type(exc).__name__)
                return
            proved = None if role == ROLE_CANDIDATE else Scope(role)
            refusal = self._authenticated(sock, proved, address)
            if refusal is not None:
                link.send({"ok": False, "error": refusal})
                return
            slot = True
            log.debug(
                "server %s: admin client %s (%s) connected from %s",
                server.server_id,
                client,
                "candidate" if proved is None else f"scope {proved.label}",
                where,
            )
            serve = self._session(client, proved)
            # Closed between two requests once it has lasted its lifetime: a deadline that no
            # request pushes back, so a slot is never held forever by cheap requests.
            ends = time.monotonic() + self._lifetime
            while True:
                left = ends - time.monotonic()
                if left <= 0:
                    return  # the client reconnects if it has more to ask
                sock.settimeout(min(IDLE_TIMEOUT, left))
                try:
                    request = link.receive()
                except (WireError, OSError):
                    return  # the client left, idled out, or broke the session: nothing to say
                reply = serve(request)
                link.send(reply)
                if reply.get("close"):
                    return  # a request that did not decode ends its connection, not the server
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._pending.remove(sock)
            if slot:
                self._left(proved, address)
            if isinstance(sock, ssl.SSLSocket):
                sock.close()  # socketserver closes only the plain socket it accepted

    def _wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        """Run the server side of TLS on an accepted connection (a socket :meth:`stop` sees)."""
        assert self._tls is not None
        wrapped = self._tls.wrap_socket(sock, server_side=True)
        with self._lock:
            # The waiting room and stop() now hold the wrapper: it is what must be shut down.
            self._conns.discard(sock)
            self._conns.add(wrapped)
            self._pending.replace(sock, wrapped)
        return wrapped


def _hang_up(sock: socket.socket) -> None:
    """Make the thread serving ``sock`` see the end of the stream (it closes the socket)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
