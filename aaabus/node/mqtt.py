"""The MQTT listener of a server (property ``aaabus.mqtt.port``): devices on the bus's topics.

MQTT 3.1.1 (docs/mqtt.md says what is built and what is not). A device's PUBLISH is a
publication on the bus's topic of the same name, made by this server's topic representative;
its SUBSCRIBE subscribes the device's session (:mod:`aaabus.node.mqttsessions`, a mailbox in the
store) to the filter, so it receives what agents, clients and other devices publish, anywhere on
the bus, in the topics' causal order. A QoS 1/2 PUBLISH is acknowledged once the batch that
hands it to the bus is durable.

Threads: **one event loop** (asyncio, thread ``mqtt-<id>``) owns the port, every connection
(:mod:`aaabus.node.mqttconn`) and every table here: no lock. A server's thread count does not
grow with its devices. What touches the store runs on the engine thread: the connections'
operations gathered during one turn of the loop go to the engine as one batch
(:meth:`~aaabus.core.engine.Engine.run_batch`), and the batches that arrive while a commit runs
go into the next one (group commit across connections); each batch's outcomes come back to the
loop once durable. The session mailboxes push what they receive the same way (an engine
observer, :data:`~aaabus.node.mqttsessions.PUSH_KEY`): nothing polls, nothing runs for an idle
device but its keep-alive check (one sweep of the loop a second). With a credentials file, the
scrypt checks run on a pool of two threads (``mqtt-auth-<id>``), never on the loop.

Limits, each a property (docs/config.md): the waiting room (``max_waiting``, ``per_address``,
``connect_ms``) holds connections until their CONNECT and evicts the oldest before refusing;
``max_connections``, ``connections_per_user`` and ``sessions_per_user`` count accepted
devices; ``max_keepalive``/``keepalive_0``; ``inflight``, ``queued_bytes``, ``max_filters`` per
device; ``retained``, ``retained_bytes``, ``retained_total`` per user and server;
``session_expiry_s``. Every refusal answers with the protocol's code where it has one and
writes one rate-limited log line (:class:`~aaabus.io.gate.RefusalLog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import hmac
import logging
import os
import resource
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from aaabus.config.reader import BusConfig
from aaabus.errors import ConfigError
from aaabus.io import mqttcodec as mc
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.io.mqttauth import Credentials
from aaabus.model.notifications import Notification
from aaabus.node.mqttconn import MqttConnection
from aaabus.node.mqttsessions import BOX_PREFIX, PUSH_KEY, MqttSessions, delivery_of

__all__ = ["MqttListener"]

log = logging.getLogger("aaabus.mqtt")

#: Seconds between two sweeps of the deadlines (CONNECT, keep-alive) and between two
#: expiries of persistent sessions.
SWEEP_S = 1.0
EXPIRE_S = 60.0
#: How long a connection may wait for its CONNECT before its address's cap may evict it.
GRACE_S = 1.0
#: Sockets accepted per turn of the loop, and the kernel's queue of connections not yet
#: accepted (capped by the system's net.core.somaxconn).
ACCEPT_BATCH = 128
LISTEN_BACKLOG = 4096
#: Verified passwords remembered (a reconnecting site does not pay scrypt again per device).
AUTH_CACHE = 4096

Op = Callable[[], Any]
Then = Callable[[Any], None]


def _tls_context(base: Path, cert: str, key: str | None) -> ssl.SSLContext:
    """The listener's TLS context: the server proves itself; devices prove themselves with
    their password (MQTT's usual deployment), so no client certificate is asked for."""
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(base / cert), str(base / key) if key else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"MQTT TLS set-up failed ({exc}); check aaabus.mqtt.tls.cert/key", str(base)
        ) from None
    return context


class MqttListener:
    """The MQTT port of server ``sid`` of ``cfg`` (see the module docstring).

    From the server: its MQTT ``sessions`` and three engine entry points: ``run_batch(ops,
    done)`` (:meth:`~aaabus.core.engine.Engine.run_batch`), ``observe(key, fn)`` and
    ``unobserve(key)``. Raises :class:`ConfigError` at construction for a bad credentials
    file, TLS files or a port in use.
    """

    def __init__(
        self,
        cfg: BusConfig,
        sid: int,
        sessions: MqttSessions,
        run_batch: Callable[..., None],
        observe: Callable[[str, Callable[[list[object]], None]], None],
    ) -> None:
        self.server_id = sid
        self.sessions = sessions
        self._run_batch = run_batch
        self._observe = observe

        def setting(name: str) -> Any:
            return cfg.setting(sid, f"aaabus.mqtt.{name}")

        self.max_packet: int = setting("max_packet")
        self.connect_s: float = setting("connect_ms") / 1000.0
        self.inflight: int = setting("inflight")
        self.queued_bytes: int = setting("queued_bytes")
        self.max_connections: int = setting("max_connections")
        self.per_user: int = setting("connections_per_user")
        self.sessions_per_user: int = setting("sessions_per_user")
        self.session_expiry_s: float = setting("session_expiry_s")
        self.max_filters: int = setting("max_filters")
        self.max_keepalive: int = setting("max_keepalive")
        self.keepalive_0: bool = setting("keepalive_0")
        self.retained: int = setting("retained")
        self.retained_bytes: int = setting("retained_bytes")
        self.retained_total: int = setting("retained_total")
        base = Path(cfg.path).resolve().parent
        credentials: str | None = setting("credentials")
        self.credentials = Credentials.load(base / credentials) if credentials else None
        self.anonymous: bool = setting("anonymous")
        cert: str | None = setting("tls.cert")
        key: str | None = setting("tls.key")
        self.tls = _tls_context(base, cert, key) if cert else None
        host: str = setting("host")
        port: int = setting("port")
        try:
            self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise ConfigError(
                f"MQTT listener cannot listen on {host}:{port} ({exc}); change aaabus.mqtt.port"
            ) from None
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        # -- owned by the loop thread --
        self._waiting: PendingTable[MqttConnection] = PendingTable(
            setting("max_waiting"), setting("per_address")
        )
        self._connections: set[MqttConnection] = set()
        self._deadlines: list[tuple[float, int, MqttConnection]] = []  # see _sweep
        self._by_client: dict[str, MqttConnection] = {}
        self._of_user: dict[str, int] = {}  # connections per named user
        self._stored: dict[str, str | None] = {}  # client id -> user, sessions in the store
        self._sessions_of: dict[str, set[str]] = {}  # named user -> their stored sessions
        self._refusals = RefusalLog(log, f"server {sid}: MQTT port")
        self._pending: list[tuple[Op, Then]] = []
        self._lazy: list[tuple[Op, Then]] = []
        # Whether the loop thread is running a batch itself (see _to_loop).
        self._inline = False
        self._loop_thread = 0
        self._flush_scheduled = False
        self._dirty: list[MqttConnection] = []  # connections with bytes queued this turn
        self._writes_scheduled = False
        self._count = 0
        #: Connections and packets refused since start (every refusal, logged or counted).
        self.refusals = 0
        self._stopping = False
        self._next_expiry = 0.0
        # Verified (user, keyed hash of the password): a reconnection skips scrypt.
        self._auth_key = os.urandom(32)
        self._auth_ok: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._auth_pool: ThreadPoolExecutor | None = None
        if self.credentials is not None:
            self._auth_pool = ThreadPoolExecutor(2, thread_name_prefix=f"mqtt-auth-{sid}")
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mqtt-{sid}", daemon=True)

    # -- life (server's thread) --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Load the session index, start the loop; returns once the port accepts."""
        loaded: list[Any] = []
        done = threading.Event()
        sessions, expiry = self.sessions, self.session_expiry_s

        def finished(outcomes: list[Any]) -> None:
            loaded.extend(outcomes)
            done.set()

        self._run_batch(
            [
                lambda: self._observe(PUSH_KEY, self._on_push),
                lambda: sessions.index_now(time.time(), expiry),
            ],
            finished,
        )
        if not done.wait(timeout):
            raise TimeoutError(f"server {self.server_id}: MQTT sessions not loaded in {timeout} s")
        index = loaded[1]
        if isinstance(index, BaseException):
            raise index
        for client_id, user in index.items():
            self._set_stored(client_id, user, True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server {self.server_id}: MQTT listener did not start")
        log.info("server %s: MQTT listener on %s:%s", self.server_id, *self.address)
        self._check_file_limit()

    def _check_file_limit(self) -> None:
        """Say so once if the process cannot open a descriptor per device the limits allow:
        beyond it, accepting fails (asyncio pauses the port) rather than refusing cleanly."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = self.max_connections + self._waiting.capacity
        if soft != resource.RLIM_INFINITY and soft < wanted:
            log.warning(
                "server %s: MQTT limits allow %d connections but this process may open %d "
                "files (ulimit -n); raise it, or lower aaabus.mqtt.max_connections/max_waiting",
                self.server_id,
                wanted,
                soft,
            )

    def stop(self, timeout: float = 5.0) -> None:
        """Close the port and every connection (any thread); the wills and clean sessions of
        the connections cut are left to the next boot (which drops clean sessions)."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(timeout)
        if self._auth_pool is not None:
            self._auth_pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _run(self) -> None:
        self._loop_thread = threading.get_ident()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._open())
            self._ready.set()
            self._loop.call_later(SWEEP_S, self._sweep)
            self._loop.run_forever()
        except Exception:
            log.exception("server %s: MQTT listener stopped", self.server_id)
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _open(self) -> None:
        self._server = await self._loop.create_server(
            self._new_connection,
            sock=self._sock,
            ssl=self.tls,
            ssl_handshake_timeout=self.connect_s if self.tls is not None else None,
            # asyncio accepts up to `backlog` sockets per turn of the loop before it reads any:
            # a storm of thousands connecting at once would fill the waiting room with sockets
            # whose CONNECT is already there, unread. A small batch lets the loop read them
            # between two batches.
            backlog=ACCEPT_BATCH,
        )
        # ...while the kernel keeps the long queue of connections not accepted yet (asyncio
        # set the listen backlog to the batch when it started serving).
        self._sock.listen(LISTEN_BACKLOG)

    def _shutdown(self) -> None:
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if conn.transport is not None:
                conn.transport.abort()
        self._loop.stop()

    # -- connections (loop thread) -----------------------------------------------------------------

    def _new_connection(self) -> MqttConnection:
        self._count += 1
        return MqttConnection(self, self._count, self.connect_s)

    def admit(self, conn: MqttConnection) -> bool:
        """A socket was accepted: into the waiting room (False: refuse it now)."""
        if self._stopping:
            return False
        now = time.monotonic()
        evicted = self._waiting.add(conn, conn.address, now, GRACE_S)
        self._connections.add(conn)
        if conn.deadline is not None:
            heapq.heappush(self._deadlines, (conn.deadline, conn.n, conn))
        if conn.transport is not None:
            conn.transport.set_write_buffer_limits(high=self.queued_bytes)
        for old in evicted:
            self.refused(old.address, "evicted: too many connections waiting for CONNECT")
            old.end("evicted from the waiting room")
        return True

    def authenticate(
        self, user: str | None, password: bytes | None, then: Callable[[bool], None]
    ) -> None:
        """``then(ok)`` on the loop: at once without a credentials file or for a password
        verified lately, else after scrypt on the auth pool."""
        credentials = self.credentials
        if credentials is None:
            then(self.anonymous)
            return
        if user is None or password is None:
            then(False)
            return
        try:
            text = password.decode("utf-8")
        except UnicodeDecodeError:
            then(False)
            return
        key = (user, hmac.new(self._auth_key, password, hashlib.sha256).digest())
        if key in self._auth_ok:
            self._auth_ok.move_to_end(key)
            then(True)
            return
        assert self._auth_pool is not None
        loop = self._loop

        def check() -> None:
            ok = credentials.check(user, text)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(checked, ok)

        def checked(ok: bool) -> None:
            if ok:
                self._auth_ok[key] = None
                while len(self._auth_ok) > AUTH_CACHE:
                    self._auth_ok.popitem(last=False)
            then(ok)

        self._auth_pool.submit(check)

    def claim(self, conn: MqttConnection) -> int | None:
        """``conn`` authenticated as ``conn.user`` asks for ``conn.client_id``: None and it is
        in (a connection holding the id is ended: MQTT's newer connection wins), or the 5.0
        reason it is refused for."""
        user, cid = conn.user, conn.client_id
        connected = len(self._by_client)
        old = self._by_client.get(cid)
        if old is not None:
            connected -= 1
        if connected >= self.max_connections:
            self.refused(
                conn.address, f"{self.max_connections} devices connected (max_connections)"
            )
            return mc.QUOTA_EXCEEDED
        if user is not None:
            held = self._of_user.get(user, 0) - (1 if old is not None and old.user == user else 0)
            if held >= self.per_user:
                self.refused(conn.address, f"user {user!r} holds {held} connections")
                return mc.QUOTA_EXCEEDED
            mine = self._sessions_of.get(user, set())
            if not conn.clean and cid not in mine and len(mine) >= self.sessions_per_user:
                self.refused(conn.address, f"user {user!r} has {len(mine)} persistent sessions")
                return mc.QUOTA_EXCEEDED
        if old is not None:
            old.end("session taken over", reason=mc.SESSION_TAKEN_OVER)
        self._waiting.remove(conn)
        self._by_client[cid] = conn
        if user is not None:
            self._of_user[user] = self._of_user.get(user, 0) + 1
        return None

    def forget(self, conn: MqttConnection) -> None:
        self._waiting.remove(conn)
        self._connections.discard(conn)
        if conn.client_id and self._by_client.get(conn.client_id) is conn:
            del self._by_client[conn.client_id]
            if conn.user is not None:
                left = self._of_user.get(conn.user, 1) - 1
                if left:
                    self._of_user[conn.user] = left
                else:
                    self._of_user.pop(conn.user, None)

    def stored(self, client_id: str) -> bool:
        return client_id in self._stored

    def stored_changed(self, client_id: str, user: str | None, present: bool) -> None:
        """The store now holds (``present``) or no longer holds a session for ``client_id``."""
        self._set_stored(client_id, user, present)

    def _set_stored(self, client_id: str, user: str | None, present: bool) -> None:
        if present:
            self._stored[client_id] = user
            if user is not None:
                self._sessions_of.setdefault(user, set()).add(client_id)
            return
        old = self._stored.pop(client_id, None)
        if old is not None:
            mine = self._sessions_of.get(old)
            if mine is not None:
                mine.discard(client_id)
                if not mine:
                    del self._sessions_of[old]

    def refused(self, where: str, reason: str) -> None:
        self.refusals += 1
        self._refusals.refused(where, reason)

    def figures(self, timeout: float) -> dict[str, Any]:
        """What ``aaabus status`` shows of this listener (any thread; read on the loop)."""
        answer: Future[dict[str, Any]] = Future()

        def read() -> None:
            queued = [
                c.transport.get_write_buffer_size()
                for c in self._connections
                if c.transport is not None and not c.transport.is_closing()
            ]
            answer.set_result(
                {
                    "connected": len(self._by_client),
                    "waiting": len(self._waiting),
                    "sockets": len(self._connections),
                    "sessions_stored": len(self._stored),
                    "queued_bytes": sum(queued),
                    "queued_bytes_max": max(queued, default=0),
                    "unparsed_bytes_max": max(
                        (c.proto.buffered for c in self._connections), default=0
                    ),
                    "refused": self.refusals,
                }
            )

        try:
            self._loop.call_soon_threadsafe(read)
        except RuntimeError:
            return {}  # stopped
        return answer.result(timeout)

    def _sweep(self) -> None:
        """Close the connections past their deadline; expire sessions now and then.

        The deadlines are a heap keyed by each connection's deadline as it was when pushed: a
        packet only moves ``conn.deadline`` forward, and the entry, once due, is pushed again
        with the new one. So a sweep costs the entries due, not the connections: an idle
        device is looked at once per keep-alive period."""
        if self._stopping:
            return
        now = time.monotonic()
        heap, due = self._deadlines, []
        while heap and heap[0][0] <= now:
            _at, n, conn = heapq.heappop(heap)
            if conn.ended or conn.deadline is None:
                continue
            if conn.deadline > now:
                heapq.heappush(heap, (conn.deadline, n, conn))
            else:
                due.append(conn)
        for conn in due:
            if conn.client_id and self._by_client.get(conn.client_id) is conn:
                self.refused(conn.address, f"client {conn.client_id!r}: keep-alive expired")
                conn.end("keep-alive expired", reason=mc.KEEP_ALIVE_TIMEOUT)
            else:
                self.refused(conn.address, "no CONNECT before the deadline")
                conn.end("no CONNECT before the deadline")
        if now >= self._next_expiry:
            # A short expiry (tests, or an operator's choice) is checked at half its length.
            self._next_expiry = now + min(EXPIRE_S, max(SWEEP_S, self.session_expiry_s / 2))
            self._expire()
        self._loop.call_later(SWEEP_S, self._sweep)

    def _expire(self) -> None:
        sessions, expiry, connected = self.sessions, self.session_expiry_s, set(self._by_client)
        wall = time.time()

        def then(gone: Any) -> None:
            if isinstance(gone, list):
                for client_id in gone:
                    self._set_stored(client_id, None, False)

        self._add_op(lambda: sessions.expire_now(wall, expiry, connected), then)

    # -- the engine (loop thread, except the observer) ---------------------------------------------

    def op(self, conn: MqttConnection, fn: Op, then: Then, *, lazy: bool = False) -> None:
        """Queue ``fn`` for the engine's next batch (see :class:`ConnectionHost`)."""
        self._add_op(fn, then, lazy)

    def _add_op(self, fn: Op, then: Then, lazy: bool = False) -> None:
        if self._stopping:
            return
        (self._lazy if lazy else self._pending).append((fn, then))
        if not self._flush_scheduled:
            # After every callback of this turn of the loop: one batch for all of them.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._stopping:
            return
        if self._lazy:
            # Writes nobody waits for (acknowledgements of the devices' backlogs): they ride
            # along with the next batch instead of costing a commit of their own.
            lazy, self._lazy = self._lazy, []
            self._run_batch([fn for fn, _then in lazy], self._done_for(lazy), lazy=True)
        ops, self._pending = self._pending, []
        if ops:
            # Run by this thread if the engine is idle: no hand-off to the engine thread and
            # back (two wake-ups per batch). The loop waits for the commit meanwhile; what
            # arrives then is read after it and goes into the next batch.
            self._inline = True
            try:
                self._run_batch([fn for fn, _then in ops], self._done_for(ops), run_here=True)
            finally:
                self._inline = False

    def _done_for(self, ops: list[tuple[Op, Then]]) -> Callable[[list[Any]], None]:
        def done(outcomes: list[Any]) -> None:  # engine thread (or this one), once durable
            self._to_loop(self._completed, ops, outcomes)

        return done

    def _to_loop(self, handle: Callable[..., None], *args: Any) -> None:
        """Have the loop run ``handle(*args)``: at once when this is the loop thread running a
        batch itself (the batch is durable: what ZODB still does to finish its commit need not
        delay the answers), else through the loop's wake-up (from the engine thread).

        At once is safe: what a handler starts on the loop only queues (operations go to the
        next batch through ``call_soon``; sockets are written without blocking)."""
        if self._inline and threading.get_ident() == self._loop_thread:
            try:
                handle(*args)
            except Exception:  # a bug here must end one connection, not the commit
                log.exception("server %s: MQTT completion failed", self.server_id)
            return
        with contextlib.suppress(RuntimeError):  # the listener stopped meanwhile
            self._loop.call_soon_threadsafe(handle, *args)

    def _completed(self, ops: list[tuple[Op, Then]], outcomes: list[Any]) -> None:
        for (_fn, then), outcome in zip(ops, outcomes, strict=True):
            try:
                then(outcome)
            except Exception:  # a bug here must end one connection, not the listener
                log.exception("server %s: MQTT completion failed", self.server_id)
        self.flush_writes()

    def dirty(self, conn: MqttConnection) -> None:
        """``conn`` has bytes queued this turn (see :meth:`MqttConnection._write`)."""
        self._dirty.append(conn)
        if not self._writes_scheduled:
            self._writes_scheduled = True
            self._loop.call_soon(self.flush_writes)

    def flush_writes(self) -> None:
        """Send every connection's queued bytes, one system call each."""
        self._writes_scheduled = False
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.flush()

    def _on_push(self, values: list[object]) -> None:
        """Engine observer (engine thread, once durable): session mailboxes grew."""
        items = []
        for value in values:
            name, seq, note = cast(tuple[str, int, Notification], value)
            if name.startswith(BOX_PREFIX):
                items.append((name[len(BOX_PREFIX) :], seq, delivery_of(seq, note)))
        if items:
            self._to_loop(self._pushed, items)

    def _pushed(self, items: list[tuple[str, int, Any]]) -> None:
        by_client = self._by_client
        for client_id, seq, delivery in items:
            conn = by_client.get(client_id)
            if conn is not None:
                conn.pushed(seq, delivery)
        self.flush_writes()
