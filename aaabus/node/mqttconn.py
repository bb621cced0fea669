"""One MQTT connection of the listener (:mod:`aaabus.node.mqtt`): a device's packets in, the
bus's messages out.

Threads, three per connection, all named ``mqtt-<server>-<n>-*``:

* the **reader** (blocking socket) does the TLS handshake, reads CONNECT within the deadline,
  then every packet. What touches the store goes to the engine thread as an engine call; the
  answer that must wait for the commit (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK) is queued by
  the call's completion, on the engine thread, which never blocks on a device: the queue is
  bounded, and a device that does not read what it is sent is disconnected.
* the **writer** sends the queued packets.
* the **deliverer** moves the session's backlog to the device, at most ``aaabus.mqtt.inflight``
  QoS 1/2 messages unacknowledged at a time, and acknowledges the backlog (cumulatively, in the
  next look) as the device acknowledges it.

A protocol violation, an oversized packet, a keep-alive lapse or a closed socket ends the
connection (the reader closes the socket; the other two threads see it and end). The will is
published when the connection ends without DISCONNECT. Nothing here raises to its caller.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aaabus.errors import MqttProtocolError, TopicError
from aaabus.io import mqttpackets as mp
from aaabus.model.topicnames import check_filter
from aaabus.node.mqttsessions import Delivery, MqttSessions, packet_id

__all__ = ["ConnectionHost", "MqttConnection"]

T = TypeVar("T")

log = logging.getLogger("aaabus.mqtt")

#: Packets queued for the writer at most; beyond, the device is not reading: disconnect.
OUT_QUEUE = 4096
#: How long one look at the backlog waits for something new (also how late a cumulative
#: acknowledgement of the backlog may be committed when nothing else happens).
LOOK_WAIT = 0.5
#: How long a refused connection waits for its writer to send what was queued before it.
FLUSH_SECONDS = 1.0
_CLOSE = b""


class ConnectionHost(Protocol):
    """What a connection uses of its listener (:class:`aaabus.node.mqtt.MqttListener`)."""

    server_id: int
    sessions: MqttSessions
    max_packet: int
    connect_s: float
    inflight: int

    def call(self, fn: Callable[[], T]) -> T: ...
    def submit(self, fn: Callable[[], T]) -> Future[T]: ...
    def poll(self, look: Callable[[], tuple[bool, T]], wait: float) -> T: ...
    def refused(self, where: str, reason: str) -> None: ...
    def authenticate(self, user: str | None, password: str | None) -> bool: ...
    def take_over(self, client_id: str, conn: MqttConnection) -> None: ...
    def connected(self, conn: MqttConnection) -> None: ...
    def forget(self, conn: MqttConnection) -> None: ...


@dataclass
class _Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool


class MqttConnection:
    """One accepted socket (see the module docstring). ``start()`` runs it; ``close()`` ends it
    from any thread."""

    def __init__(self, listener: ConnectionHost, sock: socket.socket, address: str, n: int) -> None:
        self.listener = listener
        self.sock = sock
        self.address = address
        self.name = f"mqtt-{listener.server_id}-{n}"
        self.client_id = ""
        self.clean = True
        self.will: _Will | None = None
        self.closed = threading.Event()
        self._out: queue.Queue[bytes] = queue.Queue(OUT_QUEUE)
        # Delivery state (under _lock): packet id -> backlog seq awaiting the device's answer.
        self._lock = threading.Condition()
        self._inflight: dict[int, int] = {}
        self._done: set[int] = set()
        self._outstanding: deque[int] = deque()  # seqs handed to the device, in order
        self._acked = 0
        self._sent_upto = 0
        # Engine calls of this connection not yet committed: bounds what a device can queue.
        self._calls = threading.BoundedSemaphore(listener.inflight)
        self._threads: list[threading.Thread] = []

    # -- life --------------------------------------------------------------------------------------

    def start(self) -> None:
        reader = threading.Thread(target=self._read_loop, name=f"{self.name}-read", daemon=True)
        self._threads.append(reader)
        reader.start()

    def close(self) -> None:
        """End the connection (any thread); the will is the reader's business."""
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(queue.Full):
            self._out.put_nowait(_CLOSE)
        with self._lock:
            self._lock.notify_all()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _send(self, packet: bytes) -> None:
        """Queue ``packet`` for the writer (any thread, the engine's included: never blocks)."""
        if self.closed.is_set():
            return
        try:
            self._out.put_nowait(packet)
        except queue.Full:
            self.listener.refused(self.address, f"client {self.client_id!r} does not read")
            self.close()

    # -- reader ------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        graceful = False
        try:
            graceful = self._serve()
        except MqttProtocolError as exc:
            self.listener.refused(self.address, f"client {self.client_id!r}: {exc}")
            if exc.code is not None and not self.client_id:
                with contextlib.suppress(OSError):
                    self.sock.sendall(mp.connack(False, exc.code))
            self._flush(FLUSH_SECONDS)
        except (OSError, ssl.SSLError, EOFError) as exc:
            if not self.closed.is_set():
                log.debug("%s: connection ended (%s)", self.name, exc)
        except Exception:  # a bug here must end one connection, not the listener
            log.exception("%s: unexpected error; connection closed", self.name)
        finally:
            self.close()
            self._finish(graceful)

    def _flush(self, timeout: float) -> None:
        """Let the writer send what is already queued before the socket is shut (reader thread,
        on a refusal): a device refused for one packet still gets the CONNACK and acks of what
        was accepted before it, which may be in the same TCP segment."""
        writer = next((t for t in self._threads if t.name.endswith("-write")), None)
        if writer is None or self.closed.is_set():
            return
        with contextlib.suppress(queue.Full):
            self._out.put_nowait(_CLOSE)
        writer.join(timeout)

    def _finish(self, graceful: bool) -> None:
        """After the socket is done: publish the will, end a clean session, leave the listener."""
        for thread in self._threads[1:]:
            thread.join(5.0)
        if self.client_id:
            try:
                if self.will is not None and not graceful:
                    will = self.will
                    self.listener.call(
                        lambda: self.listener.sessions.publish_now(
                            self.client_id, will.topic, will.payload, will.retain, will.qos
                        )
                    )
                # Also when a newer connection took the client id over: it waits for this
                # (take_over) before it opens its session, and a clean session ends here.
                if self.clean:
                    self.listener.call(lambda: self.listener.sessions.drop_now(self.client_id))
            except Exception as exc:  # the server is stopping: a clean session dies with it
                log.debug("%s: end of session not recorded (%s)", self.name, exc)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.listener.forget(self)

    def _recv_packet(self, buffer: bytearray, deadline: float | None) -> tuple[int, bytes]:
        while True:
            found = mp.split(buffer, self.listener.max_packet)
            if found is not None:
                first, total, packet = found
                del buffer[:total]
                return first, packet
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MqttProtocolError("no CONNECT before the deadline")
                self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                if deadline is not None:
                    raise MqttProtocolError("no CONNECT before the deadline") from None
                raise MqttProtocolError("keep-alive expired") from None
            if not chunk:
                raise EOFError("closed by the device")
            buffer.extend(chunk)

    def _serve(self) -> bool:
        """The reader's work; True when the device ended with DISCONNECT."""
        deadline = time.monotonic() + self.listener.connect_s
        if isinstance(self.sock, ssl.SSLSocket):
            self.sock.settimeout(self.listener.connect_s)
            try:
                self.sock.do_handshake()
            except TimeoutError:
                raise MqttProtocolError("no TLS handshake before the CONNECT deadline") from None
        buffer = bytearray()
        first, packet = self._recv_packet(buffer, deadline)
        if first >> 4 != mp.CONNECT:
            raise MqttProtocolError("first packet is not CONNECT")
        connect = mp.decode(first, packet)
        keep_alive = self._connect(connect)
        self.sock.settimeout(keep_alive * 1.5 if keep_alive else None)
        for target, what in ((self._write_loop, "write"), (self._deliver_loop, "deliver")):
            thread = threading.Thread(target=target, name=f"{self.name}-{what}", daemon=True)
            self._threads.append(thread)
            thread.start()
        while not self.closed.is_set():
            first, packet = self._recv_packet(buffer, None)
            if self._handle(first, packet):
                return True
        return False

    def _connect(self, connect: Any) -> int:
        """Check CONNECT, open the session, answer CONNACK; returns the keep-alive."""
        listener = self.listener
        clean = bool(connect.clean_session_flag)
        if connect.client_id_is_random and not clean:
            raise MqttProtocolError(
                "empty client id with a persistent session", mp.IDENTIFIER_REJECTED
            )
        if not listener.authenticate(connect.username, connect.password):
            raise MqttProtocolError(
                f"bad credentials for user {connect.username!r}", mp.NOT_AUTHORIZED
            )
        will: _Will | None = None
        if connect.will_flag:
            topic = connect.will_topic
            if not topic or "+" in topic or "#" in topic or connect.will_qos > 2:
                raise MqttProtocolError(f"invalid will topic {topic!r} or QoS")
            will = _Will(
                topic,
                bytes(connect.will_message or b""),
                connect.will_qos,
                bool(connect.will_retain_flag),
            )
        client_id = str(connect.client_id)
        listener.take_over(client_id, self)
        present, _box = listener.call(lambda: listener.sessions.open_now(client_id, clean))
        self.client_id, self.clean, self.will = client_id, clean, will
        listener.connected(self)
        self._send(mp.connack(present, 0))
        return int(connect.keep_alive)

    def _handle(self, first: int, packet: bytes) -> bool:
        """One packet after CONNECT; True for DISCONNECT."""
        kind = first >> 4
        if kind == mp.CONNECT:
            raise MqttProtocolError("second CONNECT")
        decoded = mp.decode(first, packet)
        if kind == mp.DISCONNECT:
            self.will = None
            return True
        if kind == mp.PINGREQ:
            self._send(mp.pingresp())
        elif kind == mp.PUBLISH:
            self._publish(decoded)
        elif kind == mp.PUBREL:
            pid = decoded.packet_id
            self._engine(
                lambda: self.listener.sessions.release_now(self.client_id, pid),
                lambda _r: self._send(mp.pubcomp(pid)),
            )
        elif kind == mp.SUBSCRIBE:
            self._subscribe(decoded)
        elif kind == mp.UNSUBSCRIBE:
            filters = [str(f) for f in decoded.payload.topics]
            for topic_filter in filters:
                self._check_filter(topic_filter)
            pid = decoded.variable_header.packet_id
            self._engine(
                lambda: self.listener.sessions.unsubscribe_now(self.client_id, filters),
                lambda _r: self._send(mp.unsuback(pid)),
            )
        else:
            self._acknowledged(kind, decoded.packet_id)
        return False

    def _publish(self, packet: Any) -> None:
        qos, pid, retain = packet.qos, packet.packet_id, bool(packet.retain_flag)
        topic, payload = packet.topic_name, bytes(packet.data or b"")
        sessions, cid = self.listener.sessions, self.client_id
        qos2_id = pid if qos == 2 else None

        def publish() -> bool:
            return sessions.publish_now(cid, topic, payload, retain, qos, qos2_id)

        if qos == 0:
            self._engine(publish, None)
        elif qos == 1:
            self._engine(publish, lambda _r: self._send(mp.puback(pid)))
        else:
            self._engine(publish, lambda _r: self._send(mp.pubrec(pid)))

    def _check_filter(self, topic_filter: str) -> None:
        try:
            check_filter(topic_filter)
        except TopicError as exc:
            raise MqttProtocolError(str(exc)) from None

    def _subscribe(self, packet: Any) -> None:
        wanted: list[tuple[str, int]] = []
        for topic_filter, qos in packet.payload.topics:
            self._check_filter(str(topic_filter))
            if qos is None or not 0 <= qos <= 2:
                raise MqttProtocolError(f"SUBSCRIBE with requested QoS {qos}")
            wanted.append((str(topic_filter), int(qos)))
        pid = packet.variable_header.packet_id
        self._engine(
            lambda: self.listener.sessions.subscribe_now(self.client_id, wanted),
            lambda _r: self._send(mp.suback(pid, [q for _f, q in wanted])),
        )
        with self._lock:
            self._lock.notify_all()

    def _engine(self, fn: Callable[[], Any], then: Callable[[Any], None] | None) -> None:
        """Run ``fn`` on the engine thread; ``then(result)`` once committed (engine thread)."""
        while not self._calls.acquire(timeout=1.0):
            if self.closed.is_set():
                return
        future = self.listener.submit(fn)

        def done(f: Future[Any]) -> None:
            self._calls.release()
            exc = f.exception()
            if exc is not None:
                log.warning("%s: client %r: not committed (%s)", self.name, self.client_id, exc)
                self.close()
            elif then is not None:
                then(f.result())

        future.add_done_callback(done)

    # -- acknowledgements from the device ----------------------------------------------------------

    def _acknowledged(self, kind: int, pid: int) -> None:
        with self._lock:
            seq = self._inflight.get(pid)
            if seq is None:
                return  # unknown id (a late duplicate): nothing to do
            if kind == mp.PUBREC:
                cid = self.client_id
                self._engine(
                    lambda: self.listener.sessions.received_now(cid, seq),
                    lambda _r: self._send(mp.pubrel(pid)),
                )
                return
            del self._inflight[pid]
            self._finished(seq)
            self._lock.notify_all()

    def _finished(self, seq: int) -> None:
        """Item ``seq`` is the device's (under ``_lock``): advance the cumulative ack over the
        finished prefix (QoS 1 and 2 flows finish in order, QoS 0 at once)."""
        self._done.add(seq)
        while self._outstanding and self._outstanding[0] in self._done:
            self._acked = self._outstanding.popleft()
            self._done.discard(self._acked)

    # -- writer and deliverer ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            while True:
                packet = self._out.get()
                if packet is _CLOSE or self.closed.is_set():
                    return
                self.sock.sendall(packet)
        except OSError as exc:
            log.debug("%s: write failed (%s)", self.name, exc)
        finally:
            self.close()

    def _deliver_loop(self) -> None:
        sessions, cid, window = self.listener.sessions, self.client_id, self.listener.inflight
        try:
            while not self.closed.is_set():
                with self._lock:
                    free = window - len(self._inflight)
                    if free <= 0:
                        self._lock.wait(LOOK_WAIT)
                        continue
                    acked, after = self._acked, self._sent_upto

                def look(acked: int = acked, after: int = after, free: int = free) -> Any:
                    return sessions.take_now(cid, acked, after, free)

                for delivery in self.listener.poll(look, LOOK_WAIT):
                    self._deliver(delivery)
        except KeyError:
            self.close()  # the session was dropped: a newer connection took the client id over
        except Exception as exc:  # the server is stopping, or a bug: end this connection
            if not self.closed.is_set():
                log.warning("%s: delivery stopped (%s)", self.name, exc)
            self.close()

    def _deliver(self, item: Delivery) -> None:
        with self._lock:
            self._sent_upto = item.seq
            self._outstanding.append(item.seq)
            if item.qos <= 0:
                self._finished(item.seq)
            else:
                self._inflight[packet_id(item.seq)] = item.seq
        if item.qos < 0:
            return
        pid = packet_id(item.seq)
        if item.release:
            self._send(mp.pubrel(pid))
        else:
            self._send(
                mp.publish(
                    item.topic,
                    item.payload,
                    pid if item.qos else None,
                    item.qos,
                    item.retained,
                    False,
                )
            )
