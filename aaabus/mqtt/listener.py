"""The MQTT listener of a server (property ``aaabus.mqtt.port``): devices on the bus's topics.

MQTT 3.1.1 and 5.0 on one port (docs/mqtt.md says what is built and what is not). A device's
PUBLISH is a publication on the bus's topic of the same name, made by this server's topic
representative; its SUBSCRIBE subscribes the device's session
(:mod:`aaabus.mqtt.sessions`, a mailbox in the store) to the filter, so it receives what
agents, clients and other devices publish, anywhere on the bus, in the topics' causal order. A
QoS 1/2 PUBLISH is acknowledged once the batch that hands it to the bus is durable.

Threads: **one event loop** (asyncio, thread ``mqtt-<id>``) owns the port, every connection
(:mod:`aaabus.mqtt.connection`) and every table here: no lock. A server's thread count does not
grow with its devices. What touches the store runs on the engine thread: the connections'
operations gathered during one turn of the loop go to the engine as one batch
(:meth:`~aaabus.core.engine.Engine.run_batch`), and the batches that arrive while a commit runs
go into the next one (group commit across connections); each batch's outcomes come back to the
loop once durable. The session mailboxes push what they receive the same way (an engine
observer, :data:`~aaabus.mqtt.sessions.PUSH_KEY`): nothing polls, nothing runs for an idle
device but its keep-alive check (one sweep of the loop a second). With a credentials file, the
scrypt checks run on a pool of two threads (``mqtt-auth-<id>``), never on the loop; the logins
waiting for them are the loop's, two handed to the pool at a time.

Limits, each a property (docs/config.md): the waiting room (``max_waiting``, ``per_address``,
``connect_ms``) holds connections until their CONNECT and evicts the oldest before refusing;
``max_connections``, ``connections_per_user`` and ``sessions_per_user`` count accepted
devices; ``max_keepalive``/``keepalive_0``/``max_idle_s`` (a device's silence); ``inflight``,
``queued_bytes``, ``max_filters`` per device; ``login_queue`` and ``login_per_address``, the
password checks waiting (a :class:`~aaabus.io.loginqueue.LoginQueue`: beyond, CONNACK "server
busy"); ``retained``, ``retained_bytes``, ``retained_total`` per user and server (kept by the
sessions, :meth:`~aaabus.mqtt.sessions.MqttSessions.publish_now`, for wills too);
``session_expiry_s``. Every refusal answers with the protocol's code where it has one and
writes one rate-limited log line (:class:`~aaabus.io.gate.RefusalLog`).

Access control (``aaabus.mqtt.acl``, :mod:`aaabus.mqtt.acl`, loaded at construction): the
connections ask :meth:`MqttListener.may_publish` and :meth:`MqttListener.may_subscribe`, and
:meth:`MqttListener.claim` refuses a will topic the ACL denies and a client id that is another
user's. The listener serves its own ``$SYS/aaabus/<id>/...`` status topics.

The listener is the loop and its tables (connections, client ids, users, addresses, stored
sessions); the ideas it composes have modules of their own, all run by its loop:
:mod:`~aaabus.mqtt.logins` (the password checks and their pool),
:mod:`~aaabus.mqtt.batches` (the operations of a turn as one engine batch),
:mod:`~aaabus.mqtt.sweep` (deadlines and session expiries), :mod:`~aaabus.mqtt.wills`
(5.0's delayed wills) and :mod:`~aaabus.mqtt.systopics` (the ``$SYS`` topics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

from aaabus.config.reader import BusConfig
from aaabus.errors import ConfigError
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.model.notifications import Notification
from aaabus.mqtt import codes as mq
from aaabus.mqtt.acl import Acl
from aaabus.mqtt.auth import Credentials
from aaabus.mqtt.batches import Batches, Op, Then
from aaabus.mqtt.batchtrace import BatchTrace
from aaabus.mqtt.connection import MqttConnection
from aaabus.mqtt.logins import Logins
from aaabus.mqtt.port import EnginePort
from aaabus.mqtt.roaming import NOT_AUTHORIZED, ROAM_KEY
from aaabus.mqtt.sessions import (
    BOX_PREFIX,
    PUSH_KEY,
    MqttSessions,
    Will,
    accounted,
    delivery_of,
    shown,
)
from aaabus.mqtt.sweep import SWEEP_S, Sweep
from aaabus.mqtt.systopics import Counts, SysTopics
from aaabus.mqtt.wills import DelayedWills

__all__ = ["MqttListener"]

log = logging.getLogger("aaabus.mqtt")

#: How long a connection may wait for its CONNECT before its address's cap may evict it.
GRACE_S = 1.0
#: File descriptors the listener leaves to the rest of the process (store segments and temporary
#: files, links, the admin port): a socket accepted beyond the process's limit minus these is
#: closed at once. Without them, devices took the last descriptor and the next commit failed
#: three times (no temporary file), which stops the server (issue 43).
FD_RESERVE = 256
#: Sockets accepted per turn of the loop, and the kernel's queue of connections not yet
#: accepted (capped by the system's net.core.somaxconn).
ACCEPT_BATCH = 128
LISTEN_BACKLOG = 4096


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

    From the server: its MQTT ``sessions`` and its engine, of which the listener uses
    ``run_batch`` and ``observe`` (:class:`~aaabus.mqtt.port.EnginePort`). Raises
    :class:`ConfigError` at construction for a bad credentials file, TLS files or a port in
    use.
    """

    def __init__(
        self,
        cfg: BusConfig,
        sid: int,
        sessions: MqttSessions,
        engine: EnginePort,
    ) -> None:
        self.server_id = sid
        self.sessions = sessions
        self._run_batch = engine.run_batch
        self._observe = engine.observe

        def setting(name: str) -> Any:
            return cfg.setting(sid, f"aaabus.mqtt.{name}")

        self.max_packet: int = setting("max_packet")
        self.user_bound = (setting("user_properties"), setting("user_properties_bytes"))
        self.connect_s: float = setting("connect_ms") / 1000.0
        self.inflight: int = setting("inflight")
        self.queued_bytes: int = setting("queued_bytes")
        self.max_connections: int = setting("max_connections")
        self.per_user: int = setting("connections_per_user")
        self.connections_per_address: int = setting("connections_per_address")
        self.sessions_per_user: int = setting("sessions_per_user")
        self.session_expiry_s: float = setting("session_expiry_s")
        self.max_filters: int = setting("max_filters")
        self.max_keepalive: int = setting("max_keepalive")
        self.keepalive_0: bool = setting("keepalive_0")
        self.max_idle_s: float = setting("max_idle_s")
        self.topic_aliases: int = setting("topic_aliases")
        #: Persistent sessions follow their device across the bus (aaabus.mqtt.roaming).
        self.roaming: bool = setting("roaming")
        base = Path(cfg.path).resolve().parent
        credentials: str | None = setting("credentials")
        self.credentials = Credentials.load(base / credentials) if credentials else None
        acl: str | None = setting("acl")
        self.acl = Acl.load(base / acl) if acl else None
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
        #: Sockets this listener may hold at once (the file limit less FD_RESERVE; see admit).
        #: Set before the loop thread starts, read by it only.
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._socket_budget = (
            1 << 62 if soft == resource.RLIM_INFINITY else max(1, soft - FD_RESERVE)
        )
        # Ended connections draining the device's input after their last packet (see
        # MqttConnection._linger), at most as many as the waiting room holds.
        self._lingering = 0
        self._max_lingering: int = setting("max_waiting")
        self._sweep_of = Sweep(self.session_expiry_s)
        self._by_client: dict[str, MqttConnection] = {}
        # Roaming: connections whose CONNACK waits for their session to arrive, by client id.
        self._awaiting: dict[str, MqttConnection] = {}
        self._of_user: dict[str, int] = {}  # connections per named user
        self._of_address: dict[str, int] = {}  # connections per remote address
        self._stored: dict[str, str | None] = {}  # client id -> user, sessions in the store
        self._sessions_of: dict[str, set[str]] = {}  # accounted user -> their stored sessions
        self._refusals = RefusalLog(log, f"server {sid}: MQTT port")
        self._dirty: list[MqttConnection] = []  # connections with bytes queued this turn
        self._writes_scheduled = False
        self._count = 0
        #: Connections and packets refused since start (every refusal, logged or counted).
        self.refusals = 0
        self._stopping = False
        # The publications counted in (ACL passed) and out (sent), for $SYS and the status.
        self.published_in = 0
        self.published_out = 0
        self._logins = Logins(
            sid,
            self.credentials,
            setting("anonymous"),
            setting("login_queue"),
            setting("login_per_address"),
            self.refused,
        )
        self._loop = asyncio.new_event_loop()
        self._logins.bind(self._loop)
        traced: str | None = cfg.setting(sid, "aaabus.trace")
        #: Where each batch's time goes (aaabus.trace only; perf mqtt --breakdown).
        self.trace = BatchTrace(base / traced, sid) if traced else None
        self._batches = Batches(
            sid, engine, self._loop, self.flush_writes, self._is_stopping, self.trace
        )
        self._add_op = self._batches.add
        self._wills = DelayedWills(self._loop, sessions, self._add_op, self.refused)
        self._sys = SysTopics(
            sid, setting("sys_interval_s"), self._counts, self.flush_writes, self._is_stopping
        )
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
                lambda: self._observe(ROAM_KEY, self._on_roam),
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
        self._check_acl()

    def _check_acl(self) -> None:
        """Say once what the access control set-up leaves open (docs/mqtt.md, "Access
        control"): the operator chooses least privilege, the listener does not impose it."""
        if self.credentials is not None and self.acl is None:
            log.warning(
                "server %s: MQTT devices are authenticated but every user may read and write "
                "every topic: set aaabus.mqtt.acl to restrict them",
                self.server_id,
            )
        elif self.acl is not None and self.credentials is None:
            log.warning(
                "server %s: aaabus.mqtt.acl is set without aaabus.mqtt.credentials: the user "
                "names it is checked with are not verified",
                self.server_id,
            )

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
        self._logins.shutdown()
        with contextlib.suppress(OSError):
            self._sock.close()

    def _run(self) -> None:
        self._batches.bind_thread()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._open())
            self._ready.set()
            self._loop.call_later(SWEEP_S, self._sweep)
            self._sys.start(self._loop)
            self._loop.run_forever()
        except Exception:
            log.exception("server %s: MQTT listener stopped", self.server_id)
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
            if self.trace is not None:
                self.trace.close()

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
            conn.shutdown()  # a 5.0 device is told (DISCONNECT 0x8B)
        self._loop.stop()

    # -- connections (loop thread) -----------------------------------------------------------------

    def _new_connection(self) -> MqttConnection:
        self._count += 1
        return MqttConnection(self, self._count, self.connect_s)

    def admit(self, conn: MqttConnection) -> bool:
        """A socket was accepted: into the waiting room (False: refuse it now)."""
        if self._stopping:
            return False
        if len(self._connections) >= self._socket_budget:
            self.refused(
                conn.address,
                f"{len(self._connections)} sockets open: the rest of the process's file limit "
                f"(ulimit -n) is kept for the store (FD_RESERVE {FD_RESERVE})",
            )
            return False
        now = time.monotonic()
        evicted = self._waiting.add(conn, conn.address, now, GRACE_S)
        self._connections.add(conn)
        self._sweep_of.watch(conn)
        if conn.transport is not None:
            conn.transport.set_write_buffer_limits(high=self.queued_bytes)
        for old in evicted:
            self.refused(old.address, "evicted: too many connections waiting for CONNECT")
            old.end("evicted from the waiting room")
        return True

    def authenticate(
        self,
        conn: MqttConnection,
        user: str | None,
        password: bytes | None,
        then: Callable[[bool | None], None],
    ) -> None:
        """``then(ok)`` on the loop, once ``user``'s ``password`` is checked (see
        :meth:`Logins.authenticate`)."""
        self._logins.authenticate(conn, conn.address, user, password, then)

    def claim(self, conn: MqttConnection) -> int | None:
        """``conn`` authenticated as ``conn.user`` asks for ``conn.client_id``: None and it is
        in (a connection holding the id is ended: MQTT's newer connection wins), or the 5.0
        reason it is refused for."""
        user, cid = conn.user, conn.client_id
        old = self._by_client.get(cid)
        refusal = self._authorize(conn, old)
        if refusal is not None:
            return refusal
        connected = len(self._by_client)
        if old is not None:
            connected -= 1
        if connected >= self.max_connections:
            self.refused(
                conn.address, f"{self.max_connections} devices connected (max_connections)"
            )
            return mq.QUOTA_EXCEEDED
        address = conn.address
        here = self._of_address.get(address, 0) - (old is not None and old.address == address)
        if here >= self.connections_per_address:
            self.refused(address, f"{here} devices connected from it (connections_per_address)")
            return mq.QUOTA_EXCEEDED
        if user is not None:
            held = self._of_user.get(user, 0) - (1 if old is not None and old.user == user else 0)
            if held >= self.per_user:
                self.refused(conn.address, f"user {user!r} holds {held} connections")
                return mq.QUOTA_EXCEEDED
        # The store's bounds count the devices without a user name as one user.
        mine = self._sessions_of.get(accounted(user), set())
        if not conn.clean and cid not in mine and len(mine) >= self.sessions_per_user:
            who = shown(accounted(user))
            self.refused(
                conn.address,
                f"{who}: {len(mine)} persistent sessions already (aaabus.mqtt.sessions_per_user)",
            )
            return mq.QUOTA_EXCEEDED
        if old is not None:
            old.end("session taken over", reason=mq.SESSION_TAKEN_OVER)
        self._waiting.remove(conn)
        self._by_client[cid] = conn
        self._wills.claimed(cid, conn.terms.clean_start)
        self._of_address[address] = self._of_address.get(address, 0) + 1
        if user is not None:
            self._of_user[user] = self._of_user.get(user, 0) + 1
        return None

    def forget(self, conn: MqttConnection) -> None:
        self._waiting.remove(conn)
        self._logins.remove(conn)  # a login not checked yet costs nothing more
        self._sys.forget(conn)
        self._connections.discard(conn)
        if conn.client_id and self._by_client.get(conn.client_id) is conn:
            del self._by_client[conn.client_id]
            left = self._of_address.get(conn.address, 1) - 1
            if left:
                self._of_address[conn.address] = left
            else:
                self._of_address.pop(conn.address, None)
            if conn.user is not None:
                left = self._of_user.get(conn.user, 1) - 1
                if left:
                    self._of_user[conn.user] = left
                else:
                    self._of_user.pop(conn.user, None)

    # -- access control and $SYS (loop thread) ----------------------------------------------------

    def _authorize(self, conn: MqttConnection, old: MqttConnection | None) -> int | None:
        """Before ``conn`` takes its client id: None, or NOT_AUTHORIZED if the id belongs to
        another user (its stored session's, or its connected device's: no takeover across
        users, the session and the device's will untouched) or the will topic is not the
        device's to publish on."""
        cid, user = conn.client_id, conn.user
        owner = self._stored.get(cid, user)  # a stored session's user, even None
        if owner != user or (old is not None and old.user != user):
            self.refused(conn.address, f"user {user!r} asked for client id {cid!r}, another user's")
            return mq.NOT_AUTHORIZED
        if conn.will is not None and not self._may_write(conn, conn.will[0]):
            self.refused(conn.address, f"client {cid!r}: will topic {conn.will[0][:60]!r} denied")
            return mq.NOT_AUTHORIZED
        return None

    def may_publish(self, conn: MqttConnection, topic: str) -> bool:
        """Whether ``conn``'s device may publish on ``topic``: never on a ``$`` topic (the
        bus's own), else as the ACL says (everything without one). Counts it for $SYS."""
        if self._may_write(conn, topic):
            self.published_in += 1
            return True
        return False

    def _may_write(self, conn: MqttConnection, topic: str) -> bool:
        if topic[:1] == "$":
            return False
        acl = self.acl
        return acl is None or acl.may_publish(conn.user, conn.client_id, topic)

    def may_subscribe(self, conn: MqttConnection, topic_filter: str) -> bool:
        """Whether ``conn``'s device may subscribe to ``topic_filter`` (a shared subscription
        is checked on its filter); a granted ``$SYS`` filter gets the listener's status topics,
        the current values at once."""
        acl, checked = self.acl, topic_filter
        if checked.startswith("$share/"):
            checked = checked.split("/", 2)[2] if checked.count("/") >= 2 else checked
        if acl is not None and not acl.may_subscribe(conn.user, conn.client_id, checked):
            self.refused(
                conn.address,
                f"client {conn.client_id!r}: SUBSCRIBE {topic_filter[:60]!r} denied by the ACL",
            )
            return False
        if checked.startswith("$SYS"):
            self._sys.subscribed(conn, checked)
        return True

    def resumed(self, conn: MqttConnection) -> None:
        """A stored session's filters are back on ``conn`` (before its CONNACK): those the ACL
        no longer grants (it changed since they were granted) are unsubscribed, and its ``$SYS``
        filters get the status topics again. What its backlog already holds stays."""
        granted = conn._granted
        if not granted:
            return
        revoked = [f for f in granted if not self.may_subscribe(conn, f)]
        if revoked:
            for topic_filter in revoked:
                del granted[topic_filter]
                conn._subopts.pop(topic_filter, None)
            cid, sessions = conn.client_id, self.sessions
            self._add_op(lambda: sessions.unsubscribe_now(cid, revoked), lambda _outcome: None)

    def _counts(self) -> Counts:
        """What the status topics show of this listener now (loop thread)."""
        return Counts(
            len(self._by_client),
            len(self._stored),
            self.published_in,
            self.published_out,
            self.refusals,
        )

    def stored(self, client_id: str) -> bool:
        return client_id in self._stored

    def stored_changed(self, client_id: str, user: str | None, present: bool) -> None:
        """The store now holds (``present``) or no longer holds a session for ``client_id``."""
        self._set_stored(client_id, user, present)

    def _set_stored(self, client_id: str, user: str | None, present: bool) -> None:
        if present:
            self._stored[client_id] = user
            self._sessions_of.setdefault(accounted(user), set()).add(client_id)
            return
        if client_id in self._stored:
            old = accounted(self._stored.pop(client_id))
            mine = self._sessions_of.get(old)
            if mine is not None:
                mine.discard(client_id)
                if not mine:
                    del self._sessions_of[old]

    def delay_will(self, client_id: str, will: Will, delay: float, user: str) -> None:
        """5.0's Will Delay Interval: see :meth:`DelayedWills.delay` (loop thread)."""
        self._wills.delay(client_id, will, delay, user)

    def deadline_sooner(self, conn: MqttConnection) -> None:
        """``conn.deadline`` moved earlier: see :meth:`Sweep.watch`."""
        self._sweep_of.watch(conn)

    def lingered(self, change: int) -> bool:
        """See :meth:`~aaabus.mqtt.connection.ConnectionHost.lingered` (loop thread)."""
        if change > 0 and self._lingering >= self._max_lingering:
            return False
        self._lingering += change
        return True

    def expires_in(self, seconds: float) -> None:
        """See :meth:`Sweep.expires_in` (loop thread)."""
        self._sweep_of.expires_in(seconds)

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
                    "publications_in": self.published_in,
                    "publications_out": self.published_out,
                    "logins_waiting": len(self._logins),
                    "logins_checked": self._logins.checked,
                }
            )

        try:
            self._loop.call_soon_threadsafe(read)
        except RuntimeError:
            return {}  # stopped
        return answer.result(timeout)

    def clients(self, timeout: float, most: int) -> list[dict[str, Any]]:
        """The connected devices, at most ``most`` of them in client id order, each as
        :meth:`MqttConnection.figures` gives it (any thread; read on the loop, which owns the
        connections). Empty once the listener has stopped."""
        answer: Future[list[dict[str, Any]]] = Future()

        def read() -> None:
            ids = sorted(self._by_client)[:most]
            answer.set_result([self._by_client[cid].figures() for cid in ids])

        try:
            self._loop.call_soon_threadsafe(read)
        except RuntimeError:
            return []
        return answer.result(timeout)

    def anchored_now(self, most: int) -> list[dict[str, Any]]:
        """The roaming sessions anchored on this server and the server holding each, at most
        ``most`` (engine thread: the anchors' table is in the store). Empty without roaming."""
        roaming = self.sessions.roaming
        return [] if roaming is None else roaming.anchored_now(most)

    def _sweep(self) -> None:
        """Close the connections past their deadline; expire sessions now and then (see
        :class:`Sweep`)."""
        if self._stopping:
            return
        now = time.monotonic()
        for conn in self._sweep_of.due(now):
            if conn.client_id and self._by_client.get(conn.client_id) is conn:
                self.refused(
                    conn.address,
                    f"client {conn.client_id!r}: silent for {conn.silence:g} s (keep-alive "
                    f"{conn.keep_alive} s, aaabus.mqtt.max_idle_s {self.max_idle_s:g} s)",
                )
                conn.end("keep-alive expired", reason=mq.KEEP_ALIVE_TIMEOUT)
            else:
                self.refused(conn.address, "no CONNECT before the deadline")
                conn.end("no CONNECT before the deadline")
        if self._sweep_of.expiry_due(now):
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

    def op(
        self, conn: MqttConnection, fn: Op, then: Then, *, lazy: bool = False, flow: bool = False
    ) -> None:
        """Queue ``fn`` for the engine's next batch (see :class:`ConnectionHost`)."""
        self._add_op(fn, then, lazy, flow, conn)

    def _is_stopping(self) -> bool:
        return self._stopping

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
            self._batches.to_loop(self._pushed, items)

    def _pushed(self, items: list[tuple[str, int, Any]]) -> None:
        by_client = self._by_client
        answer_before = self._batches.answer_before
        for client_id, seq, delivery in items:
            conn = by_client.get(client_id)
            if conn is not None:
                answer_before(conn)
                conn.pushed(seq, delivery)
        self.flush_writes()
        if self.trace is not None:
            self.trace.pushed()

    # -- roaming sessions (aaabus.mqtt.roaming; loop thread, except the observer) ------------------

    def await_session(self, conn: MqttConnection) -> None:
        """``conn``'s session was asked for on the bus: its CONNACK waits until the session
        arrives (:meth:`MqttConnection.session_arrived`), is refused, or ``connect_ms`` passes
        (CONNACK "server unavailable"; the session, if it arrives later, waits here for the
        device's next CONNECT)."""
        self._awaiting[conn.client_id] = conn
        self._loop.call_later(self.connect_s, self._await_lapsed, conn)

    def _await_lapsed(self, conn: MqttConnection) -> None:
        if self._awaiting.get(conn.client_id) is conn:
            del self._awaiting[conn.client_id]
            if not conn.ended:
                self.refused(conn.address, f"client {conn.client_id!r}: session did not arrive")
                conn.roam_refused(mq.SERVER_UNAVAILABLE, "its session did not arrive in time")

    def _on_roam(self, values: list[object]) -> None:
        """Engine observer (engine thread, once durable): sessions arrived, were refused, left."""
        self._batches.to_loop(self._roamed, list(values))

    def _roamed(self, values: list[Any]) -> None:
        for value in values:
            kind, cid = value[0], value[1]
            if kind == "gone":
                # Given to another server: a device still connected here is taken over.
                self._set_stored(cid, None, False)
                conn = self._by_client.get(cid)
                if conn is not None and self._awaiting.get(cid) is not conn:
                    conn.end("session moved to another server", reason=mq.SESSION_TAKEN_OVER)
                continue
            if kind == "ready":
                self._set_stored(cid, value[2], True)
            conn = self._awaiting.pop(cid, None)
            if conn is None or conn.ended:
                continue
            if kind == "ready":
                conn.session_arrived(value[3])
            else:
                self.roam_refusal(conn, value[2])
        self.flush_writes()

    def roam_refusal(self, conn: MqttConnection, reason: str) -> None:
        """``conn``'s CONNECT gets no session, for ``reason`` (``"not authorized"``: another
        user's id, CONNACK 0x87; otherwise busy, 0x89: the session is moving or moved too
        often, the device retries)."""
        cid = conn.client_id
        self.refused(conn.address, f"client {cid!r}: session refused ({reason})")
        code = mq.NOT_AUTHORIZED if reason == NOT_AUTHORIZED else mq.SERVER_BUSY
        conn.roam_refused(code, f"session refused: {reason}")
