"""``python -m perf peers``: aaabus against RabbitMQ and Mosquitto on the same two measurements.

The two measurements of ``perf pingpong --test remote`` and ``perf stream`` are repeated over
durable brokers, interleaved with aaabus runs (aaabus, rabbitmq, mosquitto QoS 2, mosquitto
QoS 0, aaabus, ...) so that a noisy neighbour hurts every system alike; each figure is the median
over the repetitions.

* RabbitMQ: durable classic queues, persistent messages (delivery_mode=2), publisher confirms,
  manual acks. Ping-pong: the ping client (this process) publishes to queue A and waits for the
  confirm, a pong client in a *separate process* consumes A, publishes to queue B, waits for that
  confirm and only then acks A; the ping client consumes B (manual ack) and stops the clock.
  Stream: this process publishes ``count`` messages with at most ``window`` unconfirmed, a
  consumer process acks each one; rate = count / (last consumed - first published).
* floor (ping-pong only): two processes over TCP, each syncing one record per hop received, no
  bus (:mod:`perf.floor`): what any bus with aaabus's durability rule pays at least.
* Mosquitto: the same shapes over MQTT 3.1.1 with persistent sessions (clean_session=False),
  QoS 2 (and QoS 0 for reference), manual acks (PUBCOMP/PUBACK sent by the application).

By default the suite starts its *own* brokers (when their binaries are installed) in a temporary
directory, on free ports bound to 127.0.0.1 only, and stops them by PID at the end, also on
failure or Ctrl-C. ``--rabbitmq HOST:PORT`` / ``--mosquitto HOST:PORT`` use running brokers
instead; ``off`` skips one. A missing binary, client library or unreachable broker is reported on
stderr and that peer is skipped; aaabus is always measured. The last line printed is one JSON
object with the raw figures and the ratios (aaabus / peer; null for a skipped peer).

Children of the suite (pong and consumer clients) run this module as ``python -m perf.peers
ROLE JSON``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perf import floor
from perf.agents.pingpong import summarise
from perf.brokers import (
    Endpoint,
    reachable,
    start_mosquitto,
    start_rabbitmq,
    stop_group,
)
from perf.harness import REPO_ROOT

#: The peers, in the order they run inside one repetition (after aaabus).
PEERS = ("rabbitmq", "mosquitto_qos2", "mosquitto_qos0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument(
        "--config", default="domains/flat-2.xml", help="aaabus bus (remote ping-pong, stream)"
    )
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved runs per system")
    parser.add_argument("--rounds", type=int, default=300, help="measured ping-pong rounds")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured rounds before")
    parser.add_argument("--count", type=int, default=5000, help="messages per stream")
    parser.add_argument(
        "--window", type=int, default=200, help="unconfirmed publishes / unacked deliveries"
    )
    parser.add_argument("--payload", type=int, default=0, help="extra payload bytes per message")
    parser.add_argument(
        "--rabbitmq",
        default="auto",
        help="'auto' (start a private broker if installed), 'off', or HOST:PORT of a running one",
    )
    parser.add_argument(
        "--mosquitto",
        default="auto",
        help="'auto' (start a private broker if installed), 'off', or HOST:PORT of a running one",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="deadline of each single measurement (s)"
    )
    parser.add_argument("--workdir", help="keep broker data and logs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _log(message: str) -> None:
    print(f"perf peers: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Client children, always stopped by the PID we got when starting them (brokers: perf.brokers).


def _stop_child(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@dataclass
class Brokers:
    """The brokers available for this invocation, and the processes started for them."""

    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)


def _parse_endpoint(text: str) -> Endpoint:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"perf peers: error: expected 'auto', 'off' or HOST:PORT, got {text!r}")
    return Endpoint(host or "127.0.0.1", int(port))


def _client_missing(peer: str) -> str | None:
    module = "pika" if peer == "rabbitmq" else "paho.mqtt.client"
    try:
        __import__(module)
    except ImportError:
        return f"Python client {module.split('.')[0]} is not installed (`make peers` installs it)"
    return None


@contextlib.contextmanager
def brokers_for(args: argparse.Namespace, work: Path) -> Iterator[Brokers]:
    """Find or start each broker; on exit stop every process started here, by PID."""
    brokers = Brokers()
    try:
        for kind, choice in (("rabbitmq", args.rabbitmq), ("mosquitto", args.mosquitto)):
            names = ["rabbitmq"] if kind == "rabbitmq" else ["mosquitto_qos2", "mosquitto_qos0"]
            reason = "disabled by --" + kind if choice == "off" else _client_missing(names[0])
            endpoint: Endpoint | None = None
            t_start = time.monotonic()
            if reason is None and choice == "auto":
                started = len(brokers.procs)
                try:
                    if kind == "rabbitmq":
                        endpoint, _ = start_rabbitmq(work, brokers.procs)
                    else:
                        endpoint = start_mosquitto(work, brokers.procs, args.window)
                except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
                    reason = f"could not start a private {kind}: {exc}"
                    # Half-started: stop it now rather than let it eat CPU during the runs.
                    for proc in reversed(brokers.procs[started:]):
                        stop_group(proc)
                    del brokers.procs[started:]
            elif reason is None:
                endpoint = _parse_endpoint(choice)
                if not reachable(endpoint.host, endpoint.port):
                    reason = f"{kind} not reachable at {endpoint.host}:{endpoint.port}"
            for name in names:
                if reason is None and endpoint is not None:
                    brokers.endpoints[name] = endpoint
                else:
                    brokers.skipped[name] = reason or "unavailable"
            if reason is not None:
                _log(f"skipping {kind}: {reason}")
            elif endpoint is not None:
                _log(
                    f"{kind} at {endpoint.host}:{endpoint.port} ({time.monotonic() - t_start:.1f}s)"
                )
        yield brokers
    finally:
        # Brokers first (reverse start order: RabbitMQ before its epmd).
        for proc in reversed(brokers.procs):
            stop_group(proc)


# --------------------------------------------------------------------------------------------
# Client children: ``python -m perf.peers ROLE JSON``; they print "ready" once subscribed and
# one JSON line at the end.


def _spawn(role: str, params: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "perf.peers", role, json.dumps(params)],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _await_ready(proc: subprocess.Popen[str], role: str, timeout: float) -> None:
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"client {role} not ready after {timeout:.0f}s")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            line = proc.stdout.readline()
            if line.strip() == "ready":
                return
            if not line:  # EOF: the child died before subscribing
                proc.wait(10)
                raise RuntimeError(f"client {role} failed: {proc.stderr.read().strip()[-800:]}")


def _await_result(proc: subprocess.Popen[str], role: str, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stderr is not None
    # The child writes one short line (and at worst a traceback): the pipes cannot fill up, so
    # waiting first is safe, and reading through the same buffered files loses nothing.
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"client {role} gave no result after {timeout:.0f}s") from None
    lines = proc.stdout.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = proc.stderr.read().strip()[-800:]
        raise RuntimeError(f"client {role} failed ({proc.returncode}): {err}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@contextlib.contextmanager
def _child(role: str, params: dict[str, Any], timeout: float) -> Iterator[subprocess.Popen[str]]:
    proc = _spawn(role, params)
    try:
        _await_ready(proc, role, min(timeout, 60.0))
        yield proc
    finally:
        _stop_child(proc)


def _body(seq: int, payload: int) -> bytes:
    return str(seq).encode() + b" " + b"x" * payload


def _seq(body: bytes) -> int:
    return int(body.split(b" ", 1)[0])


# RabbitMQ ------------------------------------------------------------------------------------


def _pika_params(endpoint: Endpoint) -> Any:
    import pika

    return pika.ConnectionParameters(
        host=endpoint.host,
        port=endpoint.port,
        credentials=pika.PlainCredentials("guest", "guest"),
        heartbeat=0,  # a long measurement must not be cut by a missed heartbeat
        blocked_connection_timeout=60,
    )


def _persistent() -> Any:
    import pika

    return pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)


def _rabbit_next(gen: Iterator[Any], deadline: float) -> tuple[Any, bytes]:
    """The next delivery of a ``BlockingChannel.consume`` generator, before ``deadline``."""
    while True:
        method, _props, body = next(gen)
        if method is not None:
            return method, body
        if time.monotonic() > deadline:
            raise TimeoutError("no delivery before the deadline")


@contextlib.contextmanager
def _rabbit_queues(
    endpoint: Endpoint, *names: str, arguments: dict[str, Any] | None = None
) -> Iterator[None]:
    """Declare fresh durable queues, and delete them afterwards (a shared broker stays clean).
    ``arguments``: the declaration's (``{"x-queue-type": "quorum"}`` for quorum queues)."""
    import pika

    conn = pika.BlockingConnection(_pika_params(endpoint))
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_declare(name, durable=True, arguments=arguments)
            ch.queue_purge(name)
        yield
        for name in names:
            ch.queue_delete(name)
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def rabbit_pingpong(
    endpoint: Endpoint,
    rounds: int,
    warmup: int,
    payload: int,
    timeout: float,
    queue_arguments: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import pika

    tag = uuid.uuid4().hex[:8]
    qa, qb = f"aaabus-peers-a-{tag}", f"aaabus-peers-b-{tag}"
    deadline = time.monotonic() + timeout
    params = {"host": endpoint.host, "port": endpoint.port, "a": qa, "b": qb}
    with (
        _rabbit_queues(endpoint, qa, qb, arguments=queue_arguments),
        _child("rabbit-pong", params, timeout) as pong,
    ):
        conn = pika.BlockingConnection(_pika_params(endpoint))
        try:
            ch = conn.channel()
            ch.confirm_delivery()  # basic_publish now returns once the broker has it on disk
            gen = ch.consume(qb, auto_ack=False, inactivity_timeout=0.5)
            rtts: list[int] = []
            t_wall = time.perf_counter_ns()
            for n in range(warmup + rounds):
                if n == warmup:
                    t_wall = time.perf_counter_ns()
                t0 = time.perf_counter_ns()
                ch.basic_publish("", qa, _body(n, payload), _persistent())
                method, body = _rabbit_next(gen, deadline)
                t1 = time.perf_counter_ns()
                ch.basic_ack(method.delivery_tag)
                if _seq(body) != n:
                    raise RuntimeError(f"round {n} got ball {_seq(body)}")
                if n >= warmup:
                    rtts.append(t1 - t0)
            wall = time.perf_counter_ns() - t_wall
            ch.basic_publish("", qa, b"stop", _persistent())
            ch.cancel()
        finally:
            with contextlib.suppress(Exception):
                conn.close()
        _await_result(pong, "pong", max(1.0, deadline - time.monotonic()))
    return _pingpong_result(rtts, wall)


def rabbit_stream(
    endpoint: Endpoint,
    count: int,
    window: int,
    payload: int,
    timeout: float,
    queue_arguments: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import pika

    queue_name = f"aaabus-peers-s-{uuid.uuid4().hex[:8]}"
    params = {
        "host": endpoint.host,
        "port": endpoint.port,
        "queue": queue_name,
        "count": count,
        "window": window,
        "timeout": timeout,
    }
    with (
        _rabbit_queues(endpoint, queue_name, arguments=queue_arguments),
        _child("rabbit-consume", params, timeout) as consumer,
    ):
        # Pipelined confirms need the asynchronous connection: the blocking one waits for each.
        pending: set[int] = set()
        state: dict[str, Any] = {"sent": 0, "confirmed": 0, "error": None}
        conn = pika.SelectConnection(_pika_params(endpoint))
        channel: list[Any] = []

        def publish_more() -> None:
            ch = channel[0]
            while state["sent"] < count and len(pending) < window:
                if state["sent"] == 0:
                    state["t_first"] = time.monotonic()
                ch.basic_publish("", queue_name, _body(state["sent"], payload), _persistent())
                state["sent"] += 1
                pending.add(state["sent"])  # delivery tags count from 1

        def on_confirm(frame: Any) -> None:
            method = frame.method
            if isinstance(method, pika.spec.Basic.Nack):
                state["error"] = f"broker nacked delivery {method.delivery_tag}"
                conn.close()
                return
            done = (
                [t for t in pending if t <= method.delivery_tag]
                if method.multiple
                else [method.delivery_tag]
            )
            pending.difference_update(done)
            state["confirmed"] += len(done)
            if state["confirmed"] >= count:
                state["t_confirmed"] = time.monotonic()
                conn.close()
            else:
                publish_more()

        def on_channel(ch: Any) -> None:
            channel.append(ch)
            ch.confirm_delivery(ack_nack_callback=on_confirm, callback=lambda _f: publish_more())

        def on_timeout() -> None:
            state["error"] = f"{state['confirmed']}/{count} confirmed after {timeout:.0f}s"
            conn.close()

        def on_open_error(_conn: Any, exc: BaseException) -> None:
            state["error"] = f"cannot connect: {exc}"
            conn.ioloop.stop()

        conn.add_on_open_callback(lambda c: c.channel(on_open_callback=on_channel))
        conn.add_on_open_error_callback(on_open_error)
        conn.add_on_close_callback(lambda _c, _exc: conn.ioloop.stop())
        conn.ioloop.call_later(timeout, on_timeout)
        conn.ioloop.start()
        if state["error"]:
            raise RuntimeError(f"rabbitmq stream: {state['error']}")
        consumed = _await_result(consumer, "consumer", timeout)
    return _stream_result(count, state, consumed)


def _rabbit_pong_child(p: dict[str, Any]) -> dict[str, Any]:
    import pika

    conn = pika.BlockingConnection(_pika_params(Endpoint(p["host"], p["port"])))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_qos(prefetch_count=1)
    gen = ch.consume(p["a"], auto_ack=False, inactivity_timeout=0.5)
    print("ready", flush=True)
    served = 0
    deadline = time.monotonic() + 3600  # the parent kills us sooner if it gives up
    while True:
        method, body = _rabbit_next(gen, deadline)
        if body == b"stop":
            ch.basic_ack(method.delivery_tag)
            break
        # Forward durably first, then ack: a crash in between resends, never loses.
        ch.basic_publish("", p["b"], body, _persistent())
        ch.basic_ack(method.delivery_tag)
        served += 1
    ch.cancel()
    conn.close()
    return {"served": served}


def _rabbit_consume_child(p: dict[str, Any]) -> dict[str, Any]:
    import pika

    conn = pika.BlockingConnection(_pika_params(Endpoint(p["host"], p["port"])))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=p["window"])
    gen = ch.consume(p["queue"], auto_ack=False, inactivity_timeout=0.5)
    print("ready", flush=True)
    deadline = time.monotonic() + p["timeout"]
    received = out_of_order = 0
    expected = 0
    t_last = 0.0
    while received < p["count"]:
        method, body = _rabbit_next(gen, deadline)
        ch.basic_ack(method.delivery_tag)
        seq = _seq(body)
        out_of_order += seq != expected
        expected = seq + 1
        received += 1
        t_last = time.monotonic()
    ch.cancel()
    conn.close()
    return {"received": received, "out_of_order": out_of_order, "t_last": t_last}


# Mosquitto -----------------------------------------------------------------------------------


class PahoSession:
    """A paho client with a persistent session, its network loop in a thread, manual acks.

    Deliveries land in ``inbox`` (or go to ``on_message`` when given); ``connect`` returns once
    the broker has acknowledged the subscription. ``protocol``: 4 for MQTT 3.1.1, 5 for 5.0
    (the same persistent session: Clean Start 0 and a Session Expiry Interval of an hour).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        client_id: str,
        qos: int,
        subscribe: str | None = None,
        on_message: Callable[[Any], None] | None = None,
        window: int = 20,
        protocol: int = 4,
    ) -> None:
        import paho.mqtt.client as mqtt

        self.qos = qos
        self.protocol = protocol
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._subscribed = threading.Event()
        self._topic = subscribe
        self._handler = on_message or self.inbox.put
        if protocol == 5:
            self.client = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=mqtt.MQTTv5,
                manual_ack=True,
            )
        else:
            self.client = mqtt.Client(
                mqtt.CallbackAPIVersion.VERSION2,
                client_id=client_id,
                clean_session=False,  # the broker keeps the subscription and queue across drops
                protocol=mqtt.MQTTv311,
                manual_ack=True,
            )
        self.client.max_inflight_messages_set(window)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_a: self._subscribed.set()
        self.client.on_message = lambda _c, _u, msg: self._handler(msg)
        self.endpoint = endpoint

    def _on_connect(self, client: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if reason.is_failure:
            return
        if self._topic is None:
            self._subscribed.set()
        else:
            client.subscribe(self._topic, qos=self.qos)

    def connect(self, timeout: float = 30.0) -> None:
        if self.protocol == 5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600  # persistent, as clean_session=False in 3.1.1
            self.client.connect(
                self.endpoint.host,
                self.endpoint.port,
                keepalive=60,
                clean_start=False,
                properties=props,
            )
        else:
            self.client.connect(self.endpoint.host, self.endpoint.port, keepalive=60)
        # paho leaves Nagle on; with it, the small back-to-back packets of a QoS 2 flow wait
        # for delayed TCP acks (~40 ms). pika, RabbitMQ and aaabus all disable it.
        sock = self.client.socket()
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.client.loop_start()
        if not self._subscribed.wait(timeout):
            self.close()
            raise TimeoutError(f"mosquitto: no connection/subscription after {timeout:.0f}s")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


def mqtt_pingpong(
    endpoint: Endpoint, qos: int, rounds: int, warmup: int, payload: int, timeout: float
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    ta, tb = f"aaabus-peers/{tag}/a", f"aaabus-peers/{tag}/b"
    deadline = time.monotonic() + timeout
    params = {"host": endpoint.host, "port": endpoint.port, "a": ta, "b": tb, "qos": qos}
    params["id"] = f"aaabus-pong-{tag}"
    with _child("mqtt-pong", params, timeout) as pong:
        ping = PahoSession(endpoint, f"aaabus-ping-{tag}", qos, subscribe=tb)
        ping.connect()
        rtts: list[int] = []
        lost = 0
        try:
            t_wall = time.perf_counter_ns()
            for n in range(warmup + rounds):
                if n == warmup:
                    t_wall = time.perf_counter_ns()
                t0 = time.perf_counter_ns()
                info = ping.client.publish(ta, _body(n, payload), qos=qos)
                info.wait_for_publish(max(0.1, deadline - time.monotonic()))
                try:
                    # QoS 0 may lose a ball; a round gets a few seconds, then counts as lost.
                    wait = 5.0 if qos == 0 else max(0.1, deadline - time.monotonic())
                    while True:
                        msg = ping.inbox.get(timeout=wait)
                        ping.client.ack(msg.mid, msg.qos)
                        if _seq(msg.payload) == n:
                            break  # older balls (after a lost round) are dropped
                except queue.Empty:
                    if qos != 0:
                        raise TimeoutError(f"mosquitto qos{qos}: round {n} timed out") from None
                    lost += 1
                    continue
                t1 = time.perf_counter_ns()
                if n >= warmup:
                    rtts.append(t1 - t0)
            wall = time.perf_counter_ns() - t_wall
            ping.client.publish(ta, b"stop", qos=qos).wait_for_publish(10.0)
        finally:
            ping.close()
        _await_result(pong, "pong", max(1.0, deadline - time.monotonic()))
    result = _pingpong_result(rtts, wall)
    result["lost"] = lost
    return result


def mqtt_stream(
    endpoint: Endpoint,
    qos: int,
    count: int,
    window: int,
    payload: int,
    timeout: float,
    protocol: int = 4,
) -> dict[str, Any]:
    """``count`` messages from a publisher here to a subscriber in a child process, at most
    ``window`` incomplete; ``protocol``: 4 (MQTT 3.1.1) or 5 (5.0) for both clients."""
    tag = uuid.uuid4().hex[:8]
    topic = f"aaabus-peers/{tag}/s"
    params = {
        "host": endpoint.host,
        "port": endpoint.port,
        "topic": topic,
        "qos": qos,
        "count": count,
        "window": window,
        "timeout": timeout,
        "id": f"aaabus-consume-{tag}",
        "protocol": protocol,
    }
    with _child("mqtt-consume", params, timeout) as consumer:
        # Our own window rather than paho's queue: paho rescans every queued message on each
        # acknowledgement, which would measure paho rather than the broker.
        slots = threading.Semaphore(window)
        producer = PahoSession(
            endpoint, f"aaabus-produce-{tag}", qos, window=window, protocol=protocol
        )
        producer.client.on_publish = lambda *_a: slots.release()
        producer.connect()
        state: dict[str, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            state["t_first"] = time.monotonic()
            infos = []
            for n in range(count):
                if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"mosquitto qos{qos}: {n}/{count} published in time")
                infos.append(producer.client.publish(topic, _body(n, payload), qos=qos))
            for info in infos:
                info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            state["t_confirmed"] = time.monotonic()
        finally:
            producer.close()
        consumed = _await_result(consumer, "consumer", timeout)
    return _stream_result(count, state, consumed)


def _mqtt_pong_child(p: dict[str, Any]) -> dict[str, Any]:
    client = PahoSession(Endpoint(p["host"], p["port"]), p["id"], p["qos"], subscribe=p["a"])
    client.connect()
    print("ready", flush=True)
    served = 0
    try:
        while True:
            msg = client.inbox.get(timeout=3600)  # the parent kills us sooner if it gives up
            if msg.payload == b"stop":
                client.client.ack(msg.mid, msg.qos)
                break
            # Forward (completed QoS flow) first, then ack: the same order as over RabbitMQ.
            client.client.publish(p["b"], msg.payload, qos=p["qos"]).wait_for_publish(60.0)
            client.client.ack(msg.mid, msg.qos)
            served += 1
    finally:
        client.close()
    return {"served": served}


def _mqtt_consume_child(p: dict[str, Any]) -> dict[str, Any]:
    state = {"received": 0, "out_of_order": 0, "expected": 0, "t_last": 0.0}
    done = threading.Event()
    client_box: list[PahoSession] = []

    def on_message(msg: Any) -> None:
        client_box[0].client.ack(msg.mid, msg.qos)
        seq = _seq(msg.payload)
        state["out_of_order"] += seq != state["expected"]
        state["expected"] = seq + 1
        state["received"] += 1
        state["t_last"] = time.monotonic()
        if state["received"] >= p["count"]:
            done.set()

    client = PahoSession(
        Endpoint(p["host"], p["port"]),
        p["id"],
        p["qos"],
        subscribe=p["topic"],
        on_message=on_message,
        window=p["window"],
        protocol=p.get("protocol", 4),
    )
    client_box.append(client)
    client.connect()
    print("ready", flush=True)
    deadline = time.monotonic() + p["timeout"]
    try:
        while not done.wait(0.5) and time.monotonic() < deadline:
            # QoS 0 may lose messages: stop 3 s after the last one rather than wait for all.
            if p["qos"] == 0 and state["t_last"] and time.monotonic() - state["t_last"] > 3.0:
                break
    finally:
        client.close()
    if p["qos"] > 0 and state["received"] < p["count"]:
        raise TimeoutError(f"{state['received']}/{p['count']} received in time")
    return {k: state[k] for k in ("received", "out_of_order", "t_last")}


# --------------------------------------------------------------------------------------------
# Results.


def _pingpong_result(rtts_ns: list[int], wall_ns: int) -> dict[str, Any]:
    return {
        "rounds": len(rtts_ns),
        "rtt_ms": summarise(rtts_ns),
        "wall_ms_per_round": wall_ns / 1e6 / max(1, len(rtts_ns)),
    }


def _stream_result(
    count: int, produced: dict[str, Any], consumed: dict[str, Any]
) -> dict[str, Any]:
    seconds = consumed["t_last"] - produced["t_first"]
    received = int(consumed["received"])
    return {
        "count": count,
        "received": received,
        "out_of_order": consumed["out_of_order"],
        "seconds": seconds,
        "msgs_per_s": received / seconds if seconds > 0 else None,
        "publish_seconds": produced["t_confirmed"] - produced["t_first"],
    }


def _measure_aaabus(args: argparse.Namespace) -> dict[str, Any]:
    from perf import pingpong, stream

    pp = pingpong.run(args.config, "remote", args.rounds, warmup=args.warmup, payload=args.payload)
    st = stream.run(args.config, args.count, payload=args.payload)
    return {
        "pingpong": {
            k: pp[k] for k in ("rounds", "rtt_ms", "wall_ms_per_round", "driver_cpu_us_per_round")
        },
        "stream": {k: st[k] for k in ("count", "seconds", "msgs_per_s", "out_of_order")},
    }


def _measure_floor(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rtts = floor.pingpong(_child, work, args.rounds, args.warmup, args.timeout)
    return {"pingpong": _pingpong_result(rtts, sum(rtts))}


def _measure_peer(name: str, endpoint: Endpoint, args: argparse.Namespace) -> dict[str, Any]:
    a = args
    if name == "rabbitmq":
        pp = rabbit_pingpong(endpoint, a.rounds, a.warmup, a.payload, a.timeout)
        st = rabbit_stream(endpoint, a.count, a.window, a.payload, a.timeout)
    else:
        qos = int(name[-1])
        pp = mqtt_pingpong(endpoint, qos, a.rounds, a.warmup, a.payload, a.timeout)
        st = mqtt_stream(endpoint, qos, a.count, a.window, a.payload, a.timeout)
    return {"pingpong": pp, "stream": st}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of each figure."""
    return {
        "pingpong_ms": {
            k: _median([r["pingpong"]["rtt_ms"][k] for r in runs])
            for k in ("p50", "p90", "p99", "mean")
        },
        "pingpong_wall_ms_per_round": _median([r["pingpong"]["wall_ms_per_round"] for r in runs]),
        "stream_msgs_per_s": _median([r["stream"]["msgs_per_s"] for r in runs if "stream" in r]),
        # aaabus only: the CPU its ping-pong driver's server spends per round (user + system).
        "pingpong_driver_cpu_us": _median([_cpu_us(r["pingpong"]) for r in runs]),
    }


def _cpu_us(pingpong: dict[str, Any]) -> float | None:
    cpu = pingpong.get("driver_cpu_us_per_round")
    return None if cpu is None else cpu["user"] + cpu["system"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def ratios(systems: dict[str, dict[str, Any] | None]) -> dict[str, float | None]:
    """aaabus time / peer time for the ping-pong p50; aaabus rate / peer rate for the stream.

    A ping-pong ratio above 1 means aaabus is slower; a stream ratio above 1, faster.
    """
    ours = systems["aaabus"] or {}
    out: dict[str, float | None] = {}
    for peer in PEERS:
        theirs = systems.get(peer) or {}
        out[f"pingpong_vs_{peer}"] = _ratio(
            (ours.get("pingpong_ms") or {}).get("p50"), (theirs.get("pingpong_ms") or {}).get("p50")
        )
        out[f"stream_vs_{peer}"] = _ratio(
            ours.get("stream_msgs_per_s"), theirs.get("stream_msgs_per_s")
        )
    floor_p50 = ((systems.get("floor") or {}).get("pingpong_ms") or {}).get("p50")
    out["pingpong_vs_floor"] = _ratio((ours.get("pingpong_ms") or {}).get("p50"), floor_p50)
    # What the driver's server alone spends in CPU per round, against the floor's whole round
    # trip: a round trip is no shorter than the CPU work of one of its servers (one I/O thread
    # runs it, under one GIL), whatever overlaps with the syncs. It includes the I/O thread's
    # polling for a notice (aaabus.link.notice_spin_us), at most the breakdown's notice_wait.
    cpu_us = ours.get("pingpong_driver_cpu_us")
    out["driver_cpu_vs_floor"] = _ratio(cpu_us, floor_p50 * 1000 if floor_p50 else None)
    rabbit_p50 = ((systems.get("rabbitmq") or {}).get("pingpong_ms") or {}).get("p50")
    out["floor_vs_rabbitmq"] = _ratio(floor_p50, rabbit_p50)
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print_table(systems: dict[str, dict[str, Any] | None], rat: dict[str, float | None]) -> None:
    print(f"{'system':<16}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'msgs/s':>10}")
    for name, s in systems.items():
        if s is None:
            print(f"{name:<16}  skipped")
            continue
        pp = s["pingpong_ms"]
        cells = "".join(_fmt(pp[k], "9.3f") for k in ("p50", "p90", "p99", "mean"))
        print(f"{name:<16}{cells}{_fmt(s['stream_msgs_per_s'], '10.0f')}")
    for peer in PEERS:
        pp, st = rat[f"pingpong_vs_{peer}"], rat[f"stream_vs_{peer}"]
        print(
            f"aaabus vs {peer}: ping-pong p50 time x{_fmt(pp, '.2f')}, "
            f"stream rate x{_fmt(st, '.2f')}"
        )
    print(
        f"aaabus vs floor (two processes, one sync per hop): ping-pong p50 time "
        f"x{_fmt(rat['pingpong_vs_floor'], '.2f')}; floor vs rabbitmq "
        f"x{_fmt(rat['floor_vs_rabbitmq'], '.2f')}"
    )


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if min(args.repetitions, args.rounds, args.count, args.window) < 1 or args.warmup < 0:
        raise SystemExit("perf peers: error: counts must be positive")
    runs: dict[str, list[dict[str, Any]]] = {"aaabus": [], "floor": [], **{p: [] for p in PEERS}}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        # A SIGTERM (make interrupted, CI timeout) unwinds like Ctrl-C, so the brokers stop too.
        previous = signal.signal(signal.SIGTERM, _terminate)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aaabus-peers-")))
        brokers = stack.enter_context(brokers_for(args, work))
        for rep in range(args.repetitions):
            # Interleaved, so that drift in the machine's load spreads over every system.
            _log(f"repetition {rep + 1}/{args.repetitions}: aaabus")
            t0 = time.monotonic()
            runs["aaabus"].append(_measure_aaabus(args))
            _log(f"aaabus done in {time.monotonic() - t0:.1f}s")
            runs["floor"].append(_measure_floor(args, work))
            for peer in PEERS:
                endpoint = brokers.endpoints.get(peer)
                if endpoint is None or peer in failed:
                    continue
                _log(f"repetition {rep + 1}/{args.repetitions}: {peer}")
                try:
                    t0 = time.monotonic()
                    runs[peer].append(_measure_peer(peer, endpoint, args))
                    _log(f"{peer} done in {time.monotonic() - t0:.1f}s")
                except Exception as exc:  # a peer's failure must not lose aaabus's figures
                    failed[peer] = f"{type(exc).__name__}: {exc}"
                    _log(f"{peer} failed, dropped from the remaining repetitions: {failed[peer]}")
    systems: dict[str, dict[str, Any] | None] = {
        name: _summary(r) if r else None for name, r in runs.items()
    }
    rat = ratios(systems)
    if not args.json:
        _print_table(systems, rat)
    result = {
        "suite": "peers",
        "config": str(args.config),
        "repetitions": args.repetitions,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "count": args.count,
        "window": args.window,
        "payload": args.payload,
        "pong": "separate process",
        "skipped": brokers.skipped,
        "failed": failed,
        "systems": systems,
        "runs": runs,
        "ratios": rat,
    }
    print(json.dumps(result))
    return 1 if failed else 0


_CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "rabbit-pong": _rabbit_pong_child,
    "rabbit-consume": _rabbit_consume_child,
    "mqtt-pong": _mqtt_pong_child,
    "mqtt-consume": _mqtt_consume_child,
    "floor-pong": floor.pong_child,
    "floor-mirror": floor.mirror_child,
}


def _child_main(argv: list[str]) -> int:
    role, params = argv[0], json.loads(argv[1])
    print(json.dumps(_CHILDREN[role](params)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
