"""The MQTT listener of a server (property ``aaabus.mqtt.port``): devices on the bus's topics.

MQTT 3.1.1 (docs/mqtt.md says what is built and what is not). A device's PUBLISH is a
publication on the bus's topic of the same name, made by this server's topic representative;
its SUBSCRIBE subscribes the device's session (:mod:`aaabus.node.mqttsessions`, a mailbox in the
store) to the filter, so it receives what agents, clients and other devices publish, anywhere on
the bus, in the topics' causal order. A QoS 1/2 PUBLISH is acknowledged after the commit that
hands it to the bus.

Limits (each a property): ``max_packet`` bytes per packet; ``connect_ms`` from accept to a
complete CONNECT; ``max_connections`` at once (beyond, a new connection is closed at accept);
``per_address`` connections waiting for their CONNECT per remote address (beyond, the oldest is
closed: a flood cycles through the table while a real client gets in); ``inflight`` QoS 1/2
messages per device. Every refusal closes the connection (after CONNACK with the return code
where 3.1.1 has one) and writes one rate-limited log line
(:class:`~aaabus.io.gate.RefusalLog`).

Threads: one acceptor (``mqtt-<id>``), three per connection (:mod:`aaabus.node.mqttconn`), and
the server's engine thread for everything that touches the store.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from aaabus.config.reader import BusConfig
from aaabus.errors import ConfigError
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.io.mqttauth import Credentials
from aaabus.node.mqttconn import MqttConnection
from aaabus.node.mqttsessions import MqttSessions

__all__ = ["MqttListener"]

log = logging.getLogger("aaabus.mqtt")
T = TypeVar("T")


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

    From the server: its MQTT ``sessions``; ``call(fn)`` runs ``fn`` on the engine thread and
    returns its committed result, ``call_async(fn)`` returns a future of it; ``poll(look,
    wait)`` is :meth:`aaabus.node.mailboxes.MailboxDesk.poll`. Raises :class:`ConfigError` at
    construction for a bad credentials file, TLS files or a port in use.
    """

    def __init__(
        self,
        cfg: BusConfig,
        sid: int,
        sessions: MqttSessions,
        call: Callable[[Callable[[], Any]], Any],
        call_async: Callable[[Callable[[], Any]], Future[Any]],
        poll: Callable[[Callable[[], tuple[bool, Any]], float], Any],
    ) -> None:
        self.server_id = sid
        self._call = call
        self._call_async = call_async
        self._poll = poll
        self.max_packet: int = cfg.setting(sid, "aaabus.mqtt.max_packet")
        self.connect_s: float = cfg.setting(sid, "aaabus.mqtt.connect_ms") / 1000.0
        self.inflight: int = cfg.setting(sid, "aaabus.mqtt.inflight")
        self.max_connections: int = cfg.setting(sid, "aaabus.mqtt.max_connections")
        base = Path(cfg.path).resolve().parent
        credentials: str | None = cfg.setting(sid, "aaabus.mqtt.credentials")
        self.credentials = Credentials.load(base / credentials) if credentials else None
        self.anonymous: bool = cfg.setting(sid, "aaabus.mqtt.anonymous")
        cert: str | None = cfg.setting(sid, "aaabus.mqtt.tls.cert")
        key: str | None = cfg.setting(sid, "aaabus.mqtt.tls.key")
        self.tls = _tls_context(base, cert, key) if cert else None
        self.sessions = sessions
        host: str = cfg.setting(sid, "aaabus.mqtt.host")
        port: int = cfg.setting(sid, "aaabus.mqtt.port")
        try:
            self._sock = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise ConfigError(
                f"MQTT listener cannot listen on {host}:{port} ({exc}); change aaabus.mqtt.port"
            ) from None
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._pending: PendingTable[MqttConnection] = PendingTable(
            self.max_connections, cfg.setting(sid, "aaabus.mqtt.per_address")
        )
        self._connections: set[MqttConnection] = set()
        self._by_client: dict[str, MqttConnection] = {}
        self._refusals = RefusalLog(log, f"server {sid}: MQTT port")
        self._count = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"mqtt-{sid}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("server %s: MQTT listener on %s:%s", self.server_id, *self.address)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the port and every connection; wait for their threads (any thread)."""
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        # shutdown() wakes the acceptor blocked in accept() (close() alone does not, on Linux).
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in connections:
            conn.close()
        for conn in connections:
            conn.join(timeout)
        self._thread.join(timeout)

    # -- what connections use ----------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        result: T = self._call(fn)
        return result

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = self._call_async(fn)
        return future

    def poll(self, look: Callable[[], tuple[bool, T]], wait: float) -> T:
        result: T = self._poll(look, wait)
        return result

    def refused(self, where: str, reason: str) -> None:
        with self._lock:
            self._refusals.refused(where, reason)

    def authenticate(self, user: str | None, password: str | None) -> bool:
        if self.credentials is not None:
            return self.credentials.check(user, password)
        return self.anonymous

    def take_over(self, client_id: str, conn: MqttConnection) -> None:
        """``conn`` claims ``client_id``: the connection holding it is closed and waited for
        (MQTT: the newer connection wins)."""
        with self._lock:
            old = self._by_client.get(client_id)
        if old is not None:
            old.close()
            old.join(5.0)

    def connected(self, conn: MqttConnection) -> None:
        with self._lock:
            self._pending.remove(conn)
            self._by_client[conn.client_id] = conn

    def forget(self, conn: MqttConnection) -> None:
        with self._lock:
            self._pending.remove(conn)
            self._connections.discard(conn)
            if self._by_client.get(conn.client_id) is conn:
                del self._by_client[conn.client_id]

    # -- acceptor ----------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
            address = peer[0]
            if self.tls is not None:
                # The handshake runs on the connection's reader, under the CONNECT deadline.
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            evicted: list[MqttConnection] = []
            with self._lock:
                if self._stopping or len(self._connections) >= self.max_connections:
                    self._refusals.refused(address, "too many connections")
                    sock.close()
                    continue
                self._count += 1
                conn = MqttConnection(self, sock, address, self._count)
                self._connections.add(conn)
                evicted = self._pending.add(conn, address)
            for old in evicted:
                self.refused(old.address, "evicted: too many connections waiting for CONNECT")
                old.close()
            conn.start()
