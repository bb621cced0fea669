"""The admin endpoint of an agent server, and the client side of its protocol.

Each server process listens on one more TCP port, its **admin port**, for the tools of the bus
(``aaabus status``, ``aaabus stop``, ``aaabus send``, :class:`aaabus.client.Client`). The port is
property ``aaabus.admin.port`` of the server, by default its first network port + 1000
(:data:`ADMIN_PORT_OFFSET`), bound on the server's ``hostname``.

Authentication
    Exactly the handshake of the links between servers (:mod:`aaabus.wire`): a mutual HMAC
    challenge-response on the bus secret, then every frame sequenced and MACed by a
    :class:`~aaabus.wire.SessionCipher`. Server ids and client ids share the handshake's 32-bit id
    field, so clients take their ids in a reserved range, ``CLIENT_ID_BASE`` (2**31) and above;
    the endpoint refuses any other connector id, and the network ports refuse client ids (they
    only accept the configured peers). Nothing is read from a connection beyond the 256-byte
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
    handed to the engine thread with :meth:`AgentServer.call`, so status figures are one
    consistent snapshot and sends are committed by the engine like any other.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import secrets
import socket
import socketserver
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aaabus.errors import AaabusError
from aaabus.gate import PendingTable, RefusalLog
from aaabus.ids import AgentId
from aaabus.message import vet_body
from aaabus.secret import Credential, as_tool_key
from aaabus.tls import tls_contexts
from aaabus.trust import UntrustedClass
from aaabus.wire import (
    HANDSHAKE_MAX_FRAME,
    MAX_SERVER_ID,
    AcceptorHandshake,
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
    WireError,
)

if TYPE_CHECKING:
    from aaabus.config import BusConfig
    from aaabus.server import AgentServer

__all__ = [
    "ADMIN_PORT_OFFSET",
    "CLIENT_ID_BASE",
    "AdminEndpoint",
    "AdminError",
    "Link",
    "RequestRefused",
    "ServerBusy",
    "ServerUnreachable",
    "admin_address",
    "bus_status",
    "server_status",
    "stop_servers",
]

log = logging.getLogger("aaabus.admin")

#: Default admin port: the server's first network port plus this.
ADMIN_PORT_OFFSET = 1000
#: Handshake ids from here up are clients (tools, programs), never servers.
CLIENT_ID_BASE = 0x8000_0000
#: Concurrent authenticated admin sessions per server; more are told the server is busy.
MAX_CONNECTIONS = 32
#: Connections waiting to authenticate, in all and per address; beyond, the oldest is evicted.
MAX_PENDING = 32
MAX_PENDING_PER_ADDRESS = 16
#: Seconds a connection has to complete the handshake, from accept (an absolute deadline).
HANDSHAKE_TIMEOUT = 5.0
#: Seconds an authenticated connection may stay idle between requests.
IDLE_TIMEOUT = 300.0
#: Longest client-chosen request id (they are remembered by the server for deduplication).
MAX_REQUEST_ID = 128
#: Window of the reactions-per-second figure, in seconds.
RATE_WINDOW = 10.0


class AdminError(AaabusError):
    """An admin request could not be made or was refused."""


class ServerUnreachable(AdminError):
    """Nothing answers on the server's admin port (the server is down or unreachable)."""

    exit_code = 1


class ServerBusy(AdminError):
    """The server accepted the connection and dropped it before authenticating: it is up but
    turning connections away (overloaded, or under a flood of unauthenticated connections)."""

    exit_code = 1


class RequestRefused(AdminError):
    """The server received the request and refused it (bad target, undecodable notification)."""


# -- where ------------------------------------------------------------------------------------


def admin_address(config: BusConfig, server_id: int) -> tuple[tuple[str, int] | None, bool]:
    """``((host, port), explicit)`` of a server's admin endpoint; ``(None, True)`` when off.

    ``explicit`` tells whether property ``aaabus.admin.port`` chose it: an explicit port must be
    bound or the server does not start, the default one is used when free (see docs/config.md).
    """
    spec = config.server(server_id)
    if not config.prop(server_id, "aaabus.admin.port"):  # unset or empty: the default port
        port = spec.networks[0].port + ADMIN_PORT_OFFSET
        if port > 65535:
            return None, False
        return (spec.hostname, port), False
    chosen: int | None = config.setting(server_id, "aaabus.admin.port")
    return (None if chosen is None else (spec.hostname, chosen)), True


# -- one authenticated connection ---------------------------------------------------------------


class Link:
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
    ) -> Link:
        """Connect to the admin endpoint of ``server_id`` and authenticate both ways.

        With ``tls`` (the dialing context of :func:`aaabus.tls.tls_contexts`) the connection
        runs inside TLS first, as the server's does when its config sets ``aaabus.tls.cert``.
        ``secret``: the bus key (bytes) or a :class:`~aaabus.secret.Credential` (a bus key or a
        tool key file's); either way the handshake proves the tool key, never the bus key.
        Raises :class:`ServerUnreachable` when nothing listens, :class:`AdminError` when the
        handshake fails (another bus's secret, another server on that port, a certificate the
        server does not accept).
        """
        where = f"server {server_id} at {address[0]}:{address[1]}"
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise ServerUnreachable(
                f"server {server_id} does not answer on {address[0]}:{address[1]} "
                f"({exc.strerror or exc})"
            ) from None
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
            # A fresh random client id per connection: ids only have to differ from server ids.
            client_id = secrets.randbelow(MAX_SERVER_ID - CLIENT_ID_BASE + 1) + CLIENT_ID_BASE
            handshake = ConnectorHandshake(as_tool_key(secret), client_id, server_id)
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
                    f"{where} refused the authentication: it does not use this bus secret"
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
        cls, sock: socket.socket, secret: bytes, server_id: int, max_frame: int, deadline: float
    ) -> tuple[Link, int]:
        """Authenticate an accepted connection by ``deadline`` (``time.monotonic()``); returns
        the link and the client's id. ``secret``: the tool key (what clients prove). Raises
        ``TimeoutError`` past the deadline, however slowly the bytes trickle in."""
        link = cls(sock, deadline)
        handshake = AcceptorHandshake(secret, server_id, None)
        sock.sendall(handshake.start())
        proof = handshake.receive(link._read_raw())
        client_id = handshake.peer_id
        assert client_id is not None
        if client_id < CLIENT_ID_BASE:
            # A server of the bus holds the secret too, but has no business here: no proof.
            raise WireError(f"id {client_id} is a server id, not a client id")
        sock.sendall(proof)
        link._authenticated(handshake.cipher(), max_frame)
        link._deadline = None
        return link, client_id

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


# -- status -------------------------------------------------------------------------------------


def server_status(server: AgentServer, timeout: float = 10.0) -> dict[str, Any]:
    """One consistent snapshot of a running server's figures (see docs/operations.md).

    Queue depths, clocks, counters and the storage size are read together on the engine thread,
    between two reactions, so that they describe the same instant.
    """
    engine = server.engine
    channel = server.channel
    if engine is None or channel is None:
        raise AdminError(f"server {server.server_id} is not started")
    network = server.network
    me = server.server_id

    def read() -> dict[str, Any]:
        store = engine.store
        depths = channel.depths()
        clocks: dict[str, int] = {}
        sent_remote = received_remote = 0
        for name, clock in channel.clocks.items():
            clocks[name] = clock.size
            for j in range(clock.size):
                if j != clock.me:
                    sent_remote += clock.sent_to(j)
                    received_remote += clock.received_from(j)
        stats = engine.stats
        return {
            "queues": {
                "input": len(store.qin),
                "held_back": depths["held_back"],
                "outgoing": {str(peer): n for peer, n in sorted(depths["outgoing"].items())},
            },
            "messages": {
                "sent": stats.sent,
                "delivered": stats.reactions,
                "sent_remote": sent_remote,
                "received_remote": received_remote,
            },
            "reactions": stats.reactions,
            "commits": stats.commits,
            "errors": stats.errors,
            "boots": store.record.boots,
            "clocks": clocks,
            "clock_cells": sum(k * k for k in clocks.values()),
            **_storage_figures(store.disk()),
        }

    snapshot = server.call(read, timeout)
    spec = server.spec
    neighbours = server.topology.neighbours(me)
    return {
        "id": me,
        "name": spec.name,
        "up": True,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - server.started_at, 3),
        "domains": list(spec.domains),
        "router": server.topology.is_router(me),
        "store": server.store_kind,
        "links": {str(p): network is not None and network.is_up(p) for p in neighbours},
        **snapshot,
    }


def _storage_figures(disk: dict[str, Any]) -> dict[str, Any]:
    return {
        "storage_bytes": disk["file_bytes"],
        "storage_live_bytes": disk["live_bytes"],
        "storage_compacted_at": disk["compacted_at"],
    }


class RateMeter:
    """Reactions per second over the last :data:`RATE_WINDOW` seconds, from periodic samples."""

    def __init__(self, read: Any) -> None:
        self._read = read
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._samples and now - self._samples[-1][0] < 1.0:
                return
            self._samples.append((now, self._read()))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
                self._samples.popleft()

    def rate(self) -> float:
        now, value = time.monotonic(), self._read()
        with self._lock:
            then, before = self._samples[0]
        return round((value - before) / (now - then), 1) if now - then > 0.1 else 0.0


# -- the endpoint -------------------------------------------------------------------------------


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

    def __init__(self, server: AgentServer, address: tuple[str, int]) -> None:
        self.server = server
        self.rates = RateMeter(lambda: server.engine.stats.reactions if server.engine else 0)
        # ``_lock`` guards the connection sets: the listener thread admits and expires, the
        # connection threads authenticate and leave.
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending: PendingTable[socket.socket] = PendingTable(
            MAX_PENDING, MAX_PENDING_PER_ADDRESS
        )
        self._sessions = 0
        self._refusals = RefusalLog(log, f"server {server.server_id}: admin port")
        self._closing = False
        # Clients prove the tool key, which opens no link between servers (aaabus.secret).
        self._tool_key = server.keys.tool_key
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

    def _authenticated(self, sock: socket.socket) -> bool:
        """Leave the waiting room for a session slot; False when every slot is taken."""
        with self._lock:
            self._pending.remove(sock)
            if self._sessions >= MAX_CONNECTIONS:
                return False
            self._sessions += 1
            return True

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        server = self.server
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        in_session = False
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
                link, client = Link.accept(
                    sock, self._tool_key, server.server_id, server.max_frame, deadline
                )
            except (WireError, OSError) as exc:
                self._refusals.refused(where, str(exc) or type(exc).__name__)
                return
            in_session = self._authenticated(sock)
            if not in_session:
                link.send({"ok": False, "error": "busy: every admin session is taken"})
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
                link.send(self._answer(request))
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._pending.remove(sock)
                if in_session:
                    self._sessions -= 1
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

    def _answer(self, request: Any) -> dict[str, Any]:
        server = self.server
        try:
            if not isinstance(request, dict):
                raise RequestRefused("a request is a JSON object")
            op = request.get("op")
            if op == "status":
                status = server_status(server)
                status["reactions_per_s"] = self.rates.rate()
                return {"ok": True, "status": status}
            if op == "stop":
                log.info("server %s: stop requested through the admin port", server.server_id)
                server.request_stop()
                return {"ok": True}
            if op == "send":
                to = _target(server, request.get("to"))
                note = _unpickle(server, request.get("note"), "notification")
                key = _request_id(request)
                _, duplicate = server.accept_once(key, lambda: server.send_now(to, note))
                return {"ok": True, "duplicate": duplicate}
            if op == "deploy":
                agent = _unpickle(server, request.get("agent"), "agent")
                where = request.get("server")
                if where is not None and (
                    not isinstance(where, int) or where not in server.config.servers
                ):
                    raise RequestRefused(f"server {where!r} is not in the bus")
                key = _request_id(request)
                agent_id, duplicate = server.accept_once(
                    key, lambda: server.deploy_now(agent, where)
                )
                return {"ok": True, "agent": agent_id, "duplicate": duplicate}
            if op == "failpoints":
                spec = request.get("arm")
                if not isinstance(spec, str):
                    raise RequestRefused("'arm' must be a text like engine.commit:kill:0")
                server.arm_failpoints(spec)
                return {"ok": True}
            raise RequestRefused(f"unknown request {op!r}")
        except (AaabusError, TimeoutError) as exc:
            return {"ok": False, "error": str(exc) or type(exc).__name__}
        except Exception as exc:  # a failing send or deploy: its transaction was rolled back
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _request_id(request: dict[str, Any]) -> str:
    key = request.get("id")
    if not isinstance(key, str) or not 0 < len(key) <= MAX_REQUEST_ID:
        raise RequestRefused(f"a request id is a string of 1..{MAX_REQUEST_ID} characters")
    return key


def _target(server: AgentServer, text: Any) -> AgentId:
    if not isinstance(text, str):
        raise RequestRefused("'to' must be an agent id like #0.1.16")
    try:
        to = AgentId.parse(text)
    except ValueError as exc:
        raise RequestRefused(str(exc)) from None
    if to.server not in server.config.servers:
        raise RequestRefused(f"agent {to} is on server {to.server}, which is not in the bus")
    return to


def _unpickle(server: AgentServer, text: Any, what: str) -> Any:
    # Only ever reached on an authenticated session, and even then loaded under the server's
    # trust policy: holding a tool credential must not mean running code inside the server.
    if not isinstance(text, str):
        raise RequestRefused(f"the {what} is missing")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestRefused(f"the {what} is not base64") from None
    try:
        vet_body(data)
        return server.trust.loads(data)
    except UntrustedClass as exc:
        log.warning("server %s: admin %s refused: %s", server.server_id, what, exc)
        raise RequestRefused(f"the {what} was refused: {exc}") from None
    except Exception as exc:
        raise RequestRefused(
            f"cannot load the {what} here ({type(exc).__name__}: {exc}); its class must be "
            "importable by the server"
        ) from None


def _hang_up(sock: socket.socket) -> None:
    """Make the thread serving ``sock`` see the end of the stream (it closes the socket)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# -- bus-wide tools -----------------------------------------------------------------------------


def _ask(
    config: BusConfig,
    server_id: int,
    secret: bytes | Credential,
    request: dict[str, Any],
    timeout: float,
) -> tuple[Link, dict[str, Any]]:
    address, _ = admin_address(config, server_id)
    if address is None:
        raise ServerUnreachable(f"server {server_id} has no admin port (aaabus.admin.port=off)")
    link = Link.connect(
        address, secret, server_id, timeout=timeout, tls=tls_contexts(config, server_id)[1]
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
    return link, answer


def bus_status(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """The status of each server in ``ids``, asked in parallel; down ones are ``up: false``,
    busy ones (they accepted and dropped the connection) ``up: null`` with ``busy``: why."""

    def one(sid: int) -> dict[str, Any]:
        try:
            link, answer = _ask(config, sid, secret, {"op": "status"}, timeout)
        except ServerBusy as exc:
            return {"id": sid, "up": None, "busy": str(exc)}
        except ServerUnreachable:
            return {"id": sid, "up": False}
        link.close()
        status: dict[str, Any] = answer["status"]
        return status

    ids = list(ids)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(ids)))) as pool:
        return list(pool.map(one, ids))


def stop_servers(
    config: BusConfig, ids: Iterable[int], secret: bytes | Credential, timeout: float = 30.0
) -> dict[int, str]:
    """Stop servers cleanly, in parallel; waits until each has closed its store.

    Returns, per server, ``"stopped"``, ``"not running"``, ``"still stopping"`` (the deadline
    passed first) or ``"busy"`` (it accepted and dropped the connection: running, not stopped).
    """

    def one(sid: int) -> str:
        try:
            link, _ = _ask(config, sid, secret, {"op": "stop"}, timeout)
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
