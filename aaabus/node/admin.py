"""The admin endpoint of an agent server: its listener and connections.

Each server process listens on one more TCP port, its **admin port**, for the tools of the bus
(``aaabus status``, ``aaabus stop``, ``aaabus send``, :class:`aaabus.tools.client.Client`).
The port is property ``aaabus.admin.port`` of the server, by default its first network port
+ 1000 (:data:`aaabus.config.admin_port.ADMIN_PORT_OFFSET`), bound on the server's ``hostname``.

Authentication
    Exactly the handshake of the links between servers (:mod:`aaabus.wire.frames`): a mutual HMAC
    challenge-response on the bus secret, then every frame sequenced and MACed by a
    :class:`~aaabus.wire.frames.SessionCipher`. Server ids and client ids share the handshake's
    32-bit id field, so clients take their ids in a reserved range (:mod:`aaabus.io.link`) and
    above; the endpoint refuses any other connector id, and the network ports refuse client ids
    (they only accept the configured peers). Nothing is read from a connection beyond the 256-byte
    handshake limit before the peer has proven it holds the secret.

Protocol
    After the handshake the client sends requests and the server answers each in order, one
    session frame each, both as UTF-8 JSON objects: ``{"op": "status"}``, ``{"op": "stop"}``,
    ``{"op": "send", "id": ..., "to": "#o.s.n", "note": <base64 pickle>}``,
    ``{"op": "deploy", "id": ..., "agent": <base64 cloudpickle>, "server": n}``,
    ``{"op": "failpoints", "arm": "name:action[:skip[:times]]"}`` (tests only, see
    :meth:`AgentServer.arm_failpoints`). Answers are
    ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``. Notifications and agents are
    pickles, as between servers, and are unpickled only on an authenticated session; everything
    else is JSON, which carries no code.

Threads
    One listener thread (``admin-<id>``) accepts connections and runs one short-lived thread per
    connection (at most :data:`MAX_CONNECTIONS` at once). Whatever reads or changes the store is
    handed to the engine thread (:mod:`aaabus.node.dispatch`, through the narrow
    :class:`~aaabus.node.control.NodeControl`), so status figures are one
    consistent snapshot and sends are committed by the engine like any other.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import ssl
import threading
from typing import Any

from aaabus.errors import AdminError, WireError
from aaabus.io.link import Link
from aaabus.io.tls import tls_contexts
from aaabus.node.control import NodeControl
from aaabus.node.dispatch import answer
from aaabus.node.rates import RateMeter

__all__ = ["AdminEndpoint"]

log = logging.getLogger("aaabus.admin")

#: Concurrent admin connections per server; more are refused at once.
MAX_CONNECTIONS = 32
#: Seconds a connection has to complete the handshake.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds an authenticated connection may stay idle between requests.
IDLE_TIMEOUT = 300.0


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    endpoint: AdminEndpoint

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.endpoint._admit(request)

    def service_actions(self) -> None:
        # Called by serve_forever between polls: samples for the reactions-per-second figure
        # without a thread of its own.
        self.endpoint.rates.sample()


class _Handler(socketserver.BaseRequestHandler):
    server: _TCPServer

    def handle(self) -> None:
        self.server.endpoint._serve(self.request, self.client_address)


class AdminEndpoint:
    """The admin listener of one server (see the module docstring)."""

    def __init__(self, server: NodeControl, address: tuple[str, int]) -> None:
        self.server = server
        self.rates = RateMeter(server.reactions)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closing = False
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

    def _admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closing or len(self._conns) >= MAX_CONNECTIONS:
                return False
            self._conns.add(sock)
            return True

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        server = self.server
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            if self._tls is not None:
                try:
                    sock = self._wrap(sock)
                except (ssl.SSLError, OSError) as exc:
                    log.warning(
                        "server %s: admin connection from %s refused: TLS handshake failed (%s)",
                        server.server_id,
                        where,
                        exc,
                    )
                    return
            try:
                link, client = Link.accept(sock, server.secret, server.server_id, server.max_frame)
            except (WireError, OSError) as exc:
                log.warning(
                    "server %s: admin connection from %s refused: %s", server.server_id, where, exc
                )
                return
            log.debug(
                "server %s: admin client %s connected from %s", server.server_id, client, where
            )
            sock.settimeout(IDLE_TIMEOUT)
            while True:
                try:
                    request = link.receive()
                except (WireError, OSError):
                    return  # the client left, idled out, or broke the session: nothing to say
                link.send(answer(server, self.rates, request))
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(sock)
            if isinstance(sock, ssl.SSLSocket):
                sock.close()  # socketserver closes only the plain socket it accepted

    def _wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        """Run the server side of TLS on an accepted connection (a socket :meth:`stop` sees)."""
        assert self._tls is not None
        with self._lock:
            self._conns.discard(sock)
        wrapped = self._tls.wrap_socket(sock, server_side=True)
        with self._lock:
            self._conns.add(wrapped)
        return wrapped
