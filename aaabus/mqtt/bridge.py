"""The MQTT bridge of a server (property ``aaabus.mqtt.bridge.address``): topics to and from an
external broker, the usual edge -> cloud link (docs/mqtt.md, "Bridging out to another broker").

**Out.** A mailbox agent (:mod:`aaabus.topics.mailbox`, created once and kept in the store under
``mqtt_bridge``) is subscribed to the ``out`` filters, like a client subscription's; each item
it receives is published to the broker at QoS 1 and acknowledged to the mailbox only once the
broker's PUBACK has come, as a prefix: at most :data:`WINDOW` are unacknowledged, and an item is
forgotten only when every item before it is. A crash or a restart sends again what the broker
had not acknowledged (at least once; duplicates are QoS 1's). The mailbox pushes what it
appends (:attr:`Mailbox.push` = :data:`PUSH_KEY`): nothing polls; the bridge takes the rest from
the store, at least half a window at a time, when it falls behind (the broker away, or slower
than the bus).

**In.** The bridge subscribes to the ``in`` filters at the broker with a persistent session
(3.1.1: clean session 0; 5.0: clean start 0 and a session expiry) and paho's manual
acknowledgement: each message is published on the bus (:meth:`MqttSessions.publish_now`, as a
device's through the listener) and its PUBACK leaves only once that publication is durable. A
crash of the server before that: the broker sends it again.

**5.0 message properties** (protocol 5) cross both ways: :func:`_paho_props` and
:func:`_bus_props` translate between the bus's :class:`~aaabus.model.pubsub.MessageProps` and
paho's.

**No echo.** What comes in is published with ``origin``
:attr:`~aaabus.mqtt.bridgesettings.BridgeSettings.mark`; the out side skips publications with
that origin (and, in 5.0, subscribes with no-local; in 3.1.1 the settings refuse ``out`` and
``in`` filters that could meet at the broker).

Threads: **one** thread, ``mqtt-bridge-<id>``, owns the paho client, its socket (through paho's
external-loop interface: this thread's selector, ``loop_read``/``loop_write``/``loop_misc``),
the reconnections (:class:`~aaabus.io.backoff.Backoff`, with jitter: many sites losing one cloud
broker do not come back in step) and every table here; no lock. The engine thread hands it the
mailbox's pushes, the answers of its batches (:meth:`~aaabus.core.engine.Engine.run_batch`) and
the commits of incoming messages through :meth:`MqttBridge._post` (a deque and a wake-up
socket); what touches the store runs on the engine thread.

paho-mqtt is the ``bridge`` extra; this module imports it only when a bridge starts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from BTrees.OOBTree import OOBTree

from aaabus.errors import TopicError
from aaabus.io.backoff import Backoff
from aaabus.model.ids import AgentId
from aaabus.model.notifications import AgentDeleteRequest, Notification
from aaabus.model.pubsub import MessageProps, Publication, Subscribe, Unsubscribe
from aaabus.model.topicnames import check_topic
from aaabus.mqtt.bridgesettings import BridgeSettings
from aaabus.mqtt.port import EnginePort
from aaabus.mqtt.sessions import BRIDGE, MqttSessions, payload_bytes
from aaabus.topics.mailbox import Mailbox

if TYPE_CHECKING:
    from paho.mqtt.client import Client, MQTTMessage
    from paho.mqtt.properties import Properties

__all__ = ["PUSH_KEY", "WINDOW", "MqttBridge", "forget_now"]

log = logging.getLogger("aaabus.mqtt.bridge")

#: The store root key of the bridge's record (its mailbox, the filters it is subscribed to).
ROOT_KEY = "mqtt_bridge"
#: The observer key of the bridge's mailbox (:meth:`aaabus.core.engine.Engine.observe`).
PUSH_KEY = "mqtt-bridge"
#: Most messages sent to the broker and not yet acknowledged by it (paho's in-flight bound too).
WINDOW = 100
#: Keep-alive towards the broker (seconds): a half-open connection is found within 1.5 times it.
KEEPALIVE_S = 30
#: How long the broker keeps the bridge's session while it is away (MQTT 5.0; 3.1.1 brokers
#: keep a persistent session until their own expiry).
SESSION_EXPIRY_S = 7 * 24 * 3600
#: Reconnection delays (seconds): the first, and the ceiling of their doubling.
RETRY_FIRST_S = 0.5
RETRY_CEILING_S = 30.0
#: While the broker stays away, at most one log line per this many seconds.
DOWN_LOG_S = 60.0


# -- the store (engine thread) ---------------------------------------------------------------------


def forget_now(root: Any, send: Callable[[AgentId, Notification], None]) -> None:
    """A server without a bridge: delete the mailbox a former bridge left (its backlog with
    it), or the bus would keep filling it for nobody (engine thread, in a transaction)."""
    record = root.get(ROOT_KEY)
    if record is None:
        return
    del root[ROOT_KEY]
    box: AgentId = record["box"]
    for topic_filter in record.get("out", ()):
        send(AgentId.topics_of(box.server), Unsubscribe(topic_filter, box))
    send(box, AgentDeleteRequest())
    log.warning("no aaabus.mqtt.bridge.address any more: the bridge's backlog is deleted")


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One mailbox item for the broker: ``topic`` is None for what is not sent (not a
    publication, or one this bridge brought in)."""

    seq: int
    topic: str | None
    payload: bytes = b""
    retain: bool = False
    props: MessageProps | None = None


# -- the bridge ----------------------------------------------------------------------------------


class MqttBridge:
    """The bridge of server ``sid`` (see the module docstring). ``engine``: the server's (its
    ``run_batch``, ``observe`` and, on the engine thread, its store); ``sessions``: the
    server's MQTT sessions, through which incoming messages are published."""

    def __init__(
        self,
        settings: BridgeSettings,
        sid: int,
        backlog: int,
        engine: EnginePort,
        sessions: MqttSessions,
    ) -> None:
        self.settings = settings
        self.server_id = sid
        self.backlog = backlog
        self._engine = engine
        self._sessions = sessions
        self._mark = settings.mark
        # -- handed over by other threads --
        self._inbox: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        # -- owned by the bridge thread --
        self._client: Client | None = None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._sock: Any = None
        self._backoff = Backoff(RETRY_FIRST_S, RETRY_CEILING_S)
        self._retry_at = 0.0
        self._down_since: float | None = None
        self._down_logged = 0.0
        self._attempts = 0
        self._refusal = ""  # why the broker refused the last CONNECT
        self._generation = 0  # connections made: an acknowledgement belongs to one of them
        self._box: AgentId | None = None
        self._stored_in: tuple[str, ...] = ()
        self._sent_upto = 0  # highest mailbox item handed to paho (or skipped)
        self._known_upto = 0  # highest mailbox item known to exist
        self._fetching = True  # the opening batch takes the first window
        self._pushed_max = 0  # highest item pushed since the last fetch was asked for
        self._outstanding: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._mid_seq: dict[int, int] = {}
        self._acked = 0
        self._incoming: list[MQTTMessage] = []
        #: Figures of ``aaabus status`` (read from any thread).
        self.connected = False
        self.sent = 0
        self.received = 0
        self.skipped = 0
        self.refused = 0
        self.reconnections = 0
        self.subscribed = 0  # in filters the broker has granted (its SUBACK)
        self._thread = threading.Thread(target=self._run, name=f"mqtt-bridge-{sid}", daemon=True)

    # -- life (server's thread) --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Open the mailbox, start the thread (it connects on its own: a broker away does not
        keep the server from starting). Raises what opening the mailbox raised."""
        self._client = self._make_client()
        opened = threading.Event()
        outcomes: list[Any] = []

        def done(results: list[object]) -> None:
            outcomes.extend(results)
            opened.set()

        self._engine.run_batch(
            [lambda: self._engine.observe(PUSH_KEY, self._on_push), self._open_now], done
        )
        if not opened.wait(timeout):
            raise TimeoutError(f"server {self.server_id}: MQTT bridge not opened in {timeout} s")
        if isinstance(outcomes[1], BaseException):
            raise outcomes[1]
        self._opened(*cast(tuple[AgentId, int, tuple[str, ...], list[Outgoing]], outcomes[1]))
        self._thread.start()
        log.info(
            "server %s: MQTT bridge to %s (out %s, in %s)",
            self.server_id,
            self.settings.address,
            ",".join(self.settings.out) or "-",
            ",".join(self.settings.into) or "-",
        )

    def stop(self, timeout: float = 5.0) -> None:
        """Disconnect from the broker and end the thread (any thread). What the broker had not
        acknowledged stays in the mailbox and is sent again at the next start."""
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for sock in (self._wake_r, self._wake_w):
            sock.close()

    def figures(self, timeout: float) -> dict[str, Any]:
        """What ``aaabus status`` shows of the bridge (any thread): ``waiting`` is the items of
        its mailbox not yet acknowledged by the broker, read on the engine thread."""
        box, engine = self._box, self._engine

        def count() -> int:
            found = engine.store.agents.get((box.origin, box.stamp)) if box else None
            return found.count if isinstance(found, Mailbox) else 0

        return {
            "broker": self.settings.address,
            "connected": self.connected,
            "sent": self.sent,
            "received": self.received,
            "skipped": self.skipped,
            "refused": self.refused,
            "reconnections": self.reconnections,
            "subscribed": self.subscribed,
            "in_flight": len(self._mid_seq),
            "waiting": engine.call(count).result(timeout),
        }

    # -- engine thread -----------------------------------------------------------------------------

    def _open_now(self) -> tuple[AgentId, int, tuple[str, ...], list[Outgoing]]:
        """The bridge's mailbox (created the first time), subscribed to the out filters of
        now; the number of its last acknowledged item, the in filters subscribed at the
        broker (in this session), and the first window of items waiting."""
        store = self._engine.store
        root = store.conn.root()
        record = root.get(ROOT_KEY)
        box: Mailbox | None = None
        if record is not None:
            found = store.agents.get((record["box"].origin, record["box"].stamp))
            box = found if isinstance(found, Mailbox) else None
        send = self._engine.send
        if box is None:
            # Deployed here and now: its creation request precedes, in this server's queue,
            # the subscriptions sent for it, so it exists before its first publication.
            box = Mailbox("mqtt-bridge", None, self.backlog)
            box.push = PUSH_KEY
            record = root[ROOT_KEY] = OOBTree({"box": box.deploy(), "out": ()})
        elif box.push != PUSH_KEY:
            box.push = PUSH_KEY
        box_id = record["box"]
        rep = AgentId.topics_of(self.server_id)
        subscribed = set(record.get("out", ()))
        for topic_filter in sorted(subscribed - set(self.settings.out)):
            send(rep, Unsubscribe(topic_filter, box_id))
        for topic_filter in self.settings.out:
            if topic_filter not in subscribed:
                send(rep, Subscribe(topic_filter, box_id))
        record["out"] = self.settings.out
        stored_in = record.get("in", ()) if record.get("session") == self._session_key() else ()
        base = box.next_seq - box.count - 1
        return box_id, base, stored_in, self._take_now(box_id, base, WINDOW)

    def _session_key(self) -> str:
        return f"{self.settings.address} {self.settings.client_id}"

    def _take_now(self, box_id: AgentId, after: int, most: int) -> list[Outgoing]:
        found = self._engine.store.agents.get((box_id.origin, box_id.stamp))
        if not isinstance(found, Mailbox):
            return []
        return [self._outgoing(seq, note) for seq, note in found.take(after, most)]

    def _outgoing(self, seq: int, note: Notification) -> Outgoing:
        if not isinstance(note, Publication) or note.origin == self._mark:
            return Outgoing(seq, None)
        # The RETAIN flag it was published with (a retained copy's is set): the broker's
        # retained values follow the bus's, and an empty retained payload clears one there.
        retain = note.retain or note.retained
        return Outgoing(
            seq,
            self.settings.prefix_out + note.topic,
            payload_bytes(note.payload),
            retain,
            note.props if self.settings.protocol == 5 else None,
        )

    def _ack_now(self, upto: int) -> None:
        box_id = self._box
        if box_id is None:
            return
        found = self._engine.store.agents.get((box_id.origin, box_id.stamp))
        if isinstance(found, Mailbox):
            found.ack(upto)

    def _subscribed_now(self, filters: tuple[str, ...]) -> None:
        record = self._engine.store.conn.root().get(ROOT_KEY)
        if record is not None:
            record["session"] = self._session_key()
            record["in"] = filters

    def _on_push(self, values: list[object]) -> None:
        """Engine observer (engine thread, once durable): the mailbox grew."""
        items = [
            self._outgoing(seq, note)
            for _name, seq, note in cast(list[tuple[str, int, Notification]], values)
        ]
        self._post("items", items, 0)

    # -- hand-over (any thread) --------------------------------------------------------------------

    def _post(self, *event: Any) -> None:
        self._inbox.append(event)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or closed (stopped)
            self._wake_w.send(b"\0")

    # -- the bridge thread -------------------------------------------------------------------------

    def _make_client(self) -> Client:
        """The paho client, driven by this thread's selector (paho's external-loop API)."""
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        settings = self.settings
        v5 = settings.protocol == 5
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=settings.client_id,
            clean_session=None if v5 else False,
            protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
            manual_ack=True,
        )
        client.max_inflight_messages_set(WINDOW)
        # A bug in a callback is logged, and the bridge goes on (paho would raise it out of
        # its loop, ending this thread).
        client.suppress_exceptions = True
        client.on_log = self._paho_log
        if settings.username is not None or settings.password is not None:
            client.username_pw_set(settings.username or "", settings.password)
        if settings.tls is not None:
            client.tls_set_context(settings.tls)
        properties = None
        if v5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = SESSION_EXPIRY_S
            properties.ReceiveMaximum = WINDOW
        client.connect_async(
            settings.host,
            settings.port,
            KEEPALIVE_S,
            clean_start=False if v5 else paho.MQTT_CLEAN_START_FIRST_ONLY,
            properties=properties,
        )
        client.on_socket_open = self._socket_open
        client.on_socket_close = self._socket_close
        client.on_socket_register_write = self._want_write
        client.on_socket_unregister_write = self._no_write
        client.on_connect = self._connected
        client.on_publish = self._published
        client.on_message = self._message
        client.on_subscribe = self._subscribed
        return client

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("server %s: MQTT bridge stopped", self.server_id)
        finally:
            client, self._client = self._client, None
            if client is not None and self._sock is not None:
                with contextlib.suppress(Exception):
                    client.disconnect()
                    client.loop_write()  # sends DISCONNECT and closes the socket
            self._selector.close()

    def _loop(self) -> None:
        client = self._client
        assert client is not None
        next_misc = time.monotonic() + 1.0
        while not self._stopping:
            now = time.monotonic()
            if self._sock is None and now >= self._retry_at:
                self._connect(client)
                now = time.monotonic()
            deadline = next_misc if self._sock is not None else self._retry_at
            for key, events in self._selector.select(max(0.0, min(deadline, next_misc) - now)):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                    continue
                if events & selectors.EVENT_READ and self._sock is key.fileobj:
                    client.loop_read()
                    # TLS may hold whole packets already decrypted, which select cannot see.
                    while isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
                        client.loop_read()
                if events & selectors.EVENT_WRITE and self._sock is key.fileobj:
                    client.loop_write()
            self._flush_incoming()
            self._handle_inbox(client)
            if time.monotonic() >= next_misc:
                next_misc = time.monotonic() + 1.0
                if self._sock is not None:
                    client.loop_misc()  # keep-alive: PINGREQ, or close a silent connection

    def _connect(self, client: Client) -> None:
        self._attempts += 1
        try:
            client.reconnect()  # TCP and TLS (blocking, paho's connect timeout), then CONNECT
        except (OSError, ValueError) as exc:
            self._down(f"{type(exc).__name__}: {exc}")

    def _down(self, reason: str) -> None:
        """The broker is away: retry later; log once, then once a minute at most."""
        now = time.monotonic()
        self._retry_at = now + self._backoff.next_delay()
        if self._down_since is None:
            self._down_since = now
            self._down_logged = now
            log.warning(
                "server %s: MQTT bridge to %s is down (%s); retrying, outgoing messages "
                "wait in the bus",
                self.server_id,
                self.settings.address,
                reason,
            )
        elif now - self._down_logged >= DOWN_LOG_S:
            self._down_logged = now
            log.warning(
                "server %s: MQTT bridge: %s still unreachable after %d attempts in %.0f s (%s)",
                self.server_id,
                self.settings.address,
                self._attempts,
                now - self._down_since,
                reason,
            )

    # paho's callbacks: all on this thread (from loop_read/loop_write/loop_misc/reconnect).

    def _paho_log(self, _client: Client, _userdata: Any, level: int, text: str) -> None:
        """paho's own lines: a callback's exception as an error, the rest (socket errors this
        module reports itself, packets) at DEBUG."""
        if text.startswith("Caught exception"):
            log.error("server %s: MQTT bridge: %s", self.server_id, text)
        else:
            log.debug("server %s: paho: %s", self.server_id, text)

    def _socket_open(self, _client: Client, _userdata: Any, sock: Any) -> None:
        self._sock = sock
        self._selector.register(sock, selectors.EVENT_READ)

    def _socket_close(self, _client: Client, _userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        self._sock = None
        self.connected = False
        self._incoming.clear()  # not acknowledged: the broker sends them again
        if not self._stopping:
            reason, self._refusal = self._refusal or "connection closed", ""
            self._down(reason)

    def _want_write(self, _client: Client, _userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _no_write(self, _client: Client, _userdata: Any, sock: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(sock, selectors.EVENT_READ)

    def _connected(
        self, client: Client, _userdata: Any, flags: Any, reason: Any, _properties: Any
    ) -> None:
        if reason.is_failure:
            self.refused += 1
            self._refusal = f"CONNACK {reason}"  # the socket closes next: retried as a failure
            return
        self.connected = True
        self._generation += 1
        self._backoff.reset()
        if self._down_since is not None:
            log.warning(
                "server %s: MQTT bridge connected to %s again after %.1f s",
                self.server_id,
                self.settings.address,
                time.monotonic() - self._down_since,
            )
            self.reconnections += 1
        else:
            log.info(
                "server %s: MQTT bridge connected to %s (session present: %s)",
                self.server_id,
                self.settings.address,
                bool(flags.session_present),
            )
        self._down_since = None
        self._attempts = 0
        wanted = self.settings.into
        if not wanted:
            return
        # The broker keeps a persistent session's subscriptions: subscribing again would only
        # make it resend its retained messages, once per reconnection.
        if flags.session_present and wanted == self._stored_in:
            self.subscribed = len(wanted)
            return
        if self.settings.protocol == 5:
            from paho.mqtt.subscribeoptions import SubscribeOptions

            # no-local: the broker sends the bridge none of its own publications.
            client.subscribe([(f, SubscribeOptions(qos=1, noLocal=True)) for f in wanted])
        else:
            client.subscribe([(f, 1) for f in wanted])
        dropped = [f for f in self._stored_in if f not in wanted]
        if flags.session_present and dropped:
            client.unsubscribe(dropped)

    def _subscribed(
        self, _client: Client, _userdata: Any, _mid: int, codes: list[Any], _props: Any
    ) -> None:
        failed = [str(code) for code in codes if code.is_failure]
        if failed:
            self.refused += len(failed)
            log.warning(
                "server %s: MQTT bridge: %s refused %d of the in filters (%s)",
                self.server_id,
                self.settings.address,
                len(failed),
                ", ".join(failed),
            )
        filters = self.settings.into
        self.subscribed = len(codes) - len(failed)
        if failed or len(codes) != len(filters):
            return  # an unsubscription's answer, or a refusal: subscribed again next time
        self._stored_in = filters
        self._engine.run_batch([lambda: self._subscribed_now(filters)], _ignore, lazy=True)

    def _message(self, _client: Client, _userdata: Any, message: MQTTMessage) -> None:
        self._incoming.append(message)

    def _flush_incoming(self) -> None:
        """Publish on the bus what the broker sent since the last turn, as one batch; each
        PUBACK leaves once that batch is durable, in the order the messages came."""
        if not self._incoming:
            return
        messages, self._incoming = self._incoming, []
        ops: list[Callable[[], object]] = []
        acks: list[tuple[int, int]] = []
        sessions, mark, prefix = self._sessions, self._mark, self.settings.prefix_in
        for message in messages:
            if message.qos:
                acks.append((message.mid, message.qos))
            try:
                topic = check_topic(prefix + message.topic)
            except TopicError as exc:  # can never be published: acknowledged and dropped
                self.refused += 1
                log.warning("server %s: MQTT bridge drops a message: %s", self.server_id, exc)
                continue
            payload = bytes(message.payload)
            retain, qos = bool(message.retain), message.qos
            props = _bus_props(message.properties, time.time())

            def publish(
                topic: str = topic,
                payload: bytes = payload,
                retain: bool = retain,
                qos: int = qos,
                props: MessageProps | None = props,
            ) -> object:
                # Bounded as one user's (BRIDGE): the broker's retained topics too.
                return sessions.publish_now(
                    mark, topic, payload, retain, qos, props=props, user=BRIDGE
                )

            ops.append(publish)
        self.received += len(ops)
        generation = self._generation

        def done(outcomes: list[object]) -> None:  # engine thread, once durable
            refusals = [outcome for outcome in outcomes if isinstance(outcome, str)]
            if refusals:  # acknowledged all the same: the broker would only send it again
                log.warning(
                    "server %s: MQTT bridge drops %d retained message(s): %s",
                    self.server_id,
                    len(refusals),
                    refusals[0],
                )
            self._post("acks", generation, acks)

        # A batch even with nothing to publish: its PUBACKs must not overtake earlier ones.
        self._engine.run_batch(ops or [_nothing], done)

    def _published(
        self, _client: Client, _userdata: Any, mid: int, reason: Any, _properties: Any
    ) -> None:
        """The broker's PUBACK: the item is done; the mailbox forgets the finished prefix."""
        seq = self._mid_seq.pop(mid, None)
        if seq is None:
            return
        if reason.is_failure:  # 5.0: the broker refuses it (not authorised, quota...)
            self.refused += 1
            log.warning(
                "server %s: MQTT bridge: %s refused a message (%s); not sent again",
                self.server_id,
                self.settings.address,
                reason,
            )
        else:
            self.sent += 1
        self._outstanding[seq] = True

    def _handle_inbox(self, client: Client) -> None:
        while self._inbox:
            kind, *args = self._inbox.popleft()
            if kind == "items":
                self._items(client, cast(list[Outgoing], args[0]), cast(int, args[1]))
            elif kind == "acks":
                generation, acks = args
                # The acknowledgements of a connection that is gone would name packet ids the
                # broker may have given to other messages since; it sends those again.
                if generation == self._generation and self.connected:
                    for mid, qos in acks:
                        client.ack(mid, qos)
        self._advance()
        # Behind: take from the store once half the window is free, not at each PUBACK (a
        # batch of the engine per message while the broker is the bottleneck).
        if (
            self._known_upto > self._sent_upto
            and not self._fetching
            and len(self._outstanding) <= WINDOW // 2
        ):
            self._fetch()

    def _items(self, client: Client, items: list[Outgoing], asked: int) -> None:
        """Items pushed (``asked`` 0) or taken from the store (``asked``: how many were)."""
        if not asked:
            for item in items:
                self._pushed_max = max(self._pushed_max, item.seq)
                self._known_upto = max(self._known_upto, item.seq)
                if (
                    item.seq == self._sent_upto + 1
                    and not self._fetching
                    and len(self._outstanding) < WINDOW
                ):
                    self._hand(client, item)
            return
        self._fetching = False
        for item in items:
            if item.seq > self._sent_upto:  # a gap: items dropped at the backlog limit
                self._hand(client, item)
        if len(items) >= asked:
            # More may wait behind them (stored before this start, or while the window was
            # full): the next fetch will tell.
            self._known_upto = max(self._known_upto, self._sent_upto + 1, self._pushed_max)
        else:
            # The take found all there was when it ran; what was pushed since is still due.
            self._known_upto = max(self._sent_upto, self._pushed_max)

    def _opened(
        self, box: AgentId, base: int, stored_in: tuple[str, ...], first: list[Outgoing]
    ) -> None:
        """Server's thread, before this thread starts: the state the opening batch found."""
        self._box = box
        self._stored_in = stored_in
        self._sent_upto = self._known_upto = self._acked = base
        self._inbox.appendleft(("items", first, WINDOW))

    def _hand(self, client: Client, item: Outgoing) -> None:
        self._sent_upto = item.seq
        if item.topic is None:
            self.skipped += 1
            self._outstanding[item.seq] = True
            return
        properties = None
        if item.props is not None:
            properties = _paho_props(item.props, time.time())
            if properties is None:  # its Message Expiry Interval has run out
                self.skipped += 1
                self._outstanding[item.seq] = True
                return
        # Queued by paho while the broker is away, sent (again, DUP) at its next CONNACK.
        try:
            info = client.publish(item.topic, item.payload, 1, item.retain, properties)
        except ValueError as exc:  # paho's own limits (a payload over 256 MiB)
            self.refused += 1
            log.warning(
                "server %s: MQTT bridge cannot send on %s: %s", self.server_id, item.topic, exc
            )
            self._outstanding[item.seq] = True
            return
        self._mid_seq[info.mid] = item.seq
        self._outstanding[item.seq] = False

    def _advance(self) -> None:
        """Acknowledge to the mailbox the longest prefix the broker has (rides along with the
        next group: a crash before it only sends those items again)."""
        upto = self._acked
        outstanding = self._outstanding
        while outstanding and outstanding[next(iter(outstanding))]:
            upto, _done = outstanding.popitem(last=False)
        if upto > self._acked:
            self._acked = upto
            self._engine.run_batch([lambda: self._ack_now(upto)], _ignore, lazy=True)

    def _fetch(self) -> None:
        """Take the next items from the store (the pushes went by while the window was full
        or a fetch was under way)."""
        self._fetching = True
        self._pushed_max = 0
        box, after, most = self._box, self._sent_upto, WINDOW - len(self._outstanding)
        assert box is not None

        def done(outcomes: list[object]) -> None:
            items = outcomes[0] if isinstance(outcomes[0], list) else []
            self._post("items", items, most)

        self._engine.run_batch([lambda: self._take_now(box, after, most)], done)


def _paho_props(props: MessageProps, now: float) -> Properties | None:
    """A bus message's 5.0 properties as paho's PUBLISH properties (bridge thread); None if
    it has expired. The expiry sent is what is left of it, as a broker does."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    out = Properties(PacketTypes.PUBLISH)
    if props.expires_at is not None:
        left = math.ceil(props.expires_at - now)
        if left <= 0:
            return None
        out.MessageExpiryInterval = left
    if props.payload_format:
        out.PayloadFormatIndicator = 1
    if props.content_type is not None:
        out.ContentType = props.content_type
    if props.response_topic is not None:
        out.ResponseTopic = props.response_topic
    if props.correlation is not None:
        out.CorrelationData = props.correlation
    if props.user:
        out.UserProperty = list(props.user)
    return out


def _bus_props(properties: Any, now: float) -> MessageProps | None:
    """The 5.0 properties of a message from the broker as the bus's (None: it has none, or
    the protocol is 3.1.1)."""
    if properties is None:
        return None
    expiry = getattr(properties, "MessageExpiryInterval", None)
    correlation = getattr(properties, "CorrelationData", None)
    props = MessageProps(
        payload_format=int(getattr(properties, "PayloadFormatIndicator", 0) or 0),
        content_type=getattr(properties, "ContentType", None),
        response_topic=getattr(properties, "ResponseTopic", None),
        correlation=bytes(correlation) if correlation is not None else None,
        user=tuple((str(k), str(v)) for k, v in getattr(properties, "UserProperty", ())),
        expires_at=now + expiry if expiry is not None else None,
    )
    return None if props == MessageProps() else props


def _ignore(_outcomes: list[object]) -> None:
    """The answer of a batch nobody waits for."""


def _nothing() -> None:
    """An operation that does nothing (a batch that only orders acknowledgements)."""
