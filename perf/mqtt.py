"""``python -m perf mqtt``: MQTT brokers measured with the same paho programs, interleaved.

For each system (an MQTT endpoint; see :class:`MqttSystem`) and QoS 1 and 2:

* **latency**: a publisher and a subscriber (two paho clients, persistent sessions, manual acks)
  on the same topic; one message at a time, from the publisher's ``publish`` call to the
  subscriber's ``on_message`` (CLOCK_MONOTONIC, one process); p50/p90/p99 of ``--rounds``
  after ``--warmup``.
* **throughput**: one publisher, one subscriber in a separate process, ``--count`` messages with
  at most ``--window`` incomplete QoS flows (``perf peers``'s MQTT stream).

Systems today: ``rabbitmq_mqtt`` (a private RabbitMQ with its MQTT plugin; clean_session=False
sessions get durable queues, and RabbitMQ syncs persistent messages before acknowledging them) and
``mosquitto`` (a private Mosquitto, which never syncs: the floor), and ``aaabus`` (two server
processes, the MQTT listener of one; :class:`AaabusMqtt`). Systems run interleaved (each
repetition runs every system once) and each figure is the median over ``--repetitions``. A
system whose broker is missing is skipped (stderr, ``"skipped"``); one that fails during a
measurement is dropped from the remaining repetitions (``"failed"``, exit status 1). Runs in the
main thread; paho clients have their network threads; brokers and client children are stopped
by PID on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from agents.pingpong import summarise
from perf.aaabus_mqtt import mqtt_bus
from perf.brokers import Endpoint, find_binary, start_mosquitto, start_rabbitmq, stop_group
from perf.harness import scratch
from perf.peers import PahoSession, mqtt_stream

QOS_LEVELS = (1, 2)


class MqttSystem(Protocol):
    """An MQTT endpoint to measure: started (and stopped) by the suite."""

    name: str

    def missing(self) -> str | None:
        """Why this system cannot run here (binary not installed), or None."""
        ...

    def endpoint(self, work: Path, window: int) -> contextlib.AbstractContextManager[Endpoint]:
        """Start the system in ``work``; yield its MQTT endpoint; stop it on exit."""
        ...


class RabbitMqtt:
    name = "rabbitmq_mqtt"

    def missing(self) -> str | None:
        if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists() and not find_binary(
            "rabbitmq-server"
        ):
            return "rabbitmq-server is not installed (`make peers` installs it)"
        return None

    @contextlib.contextmanager
    def endpoint(self, work: Path, window: int) -> Iterator[Endpoint]:
        procs: list[Any] = []
        try:
            _amqp, mqtt = start_rabbitmq(work, procs, mqtt=True)
            assert mqtt is not None  # asked for
            yield mqtt
        finally:
            for proc in reversed(procs):
                stop_group(proc)


class Mosquitto:
    name = "mosquitto"

    def missing(self) -> str | None:
        return None if find_binary("mosquitto") else "mosquitto is not installed"

    @contextlib.contextmanager
    def endpoint(self, work: Path, window: int) -> Iterator[Endpoint]:
        procs: list[Any] = []
        try:
            yield start_mosquitto(work, procs, window)
        finally:
            for proc in reversed(procs):
                stop_group(proc)


class AaabusMqtt:
    """Two aaabus server processes in one domain; the listener of s0 serves both paho clients
    (publisher and subscriber on one server, as with a single broker). Every QoS 1/2
    publication is committed (fsync'd) before its PUBACK/PUBREC, as RabbitMQ syncs."""

    name = "aaabus"

    def missing(self) -> str | None:
        return None

    @contextlib.contextmanager
    def endpoint(self, work: Path, window: int) -> Iterator[Endpoint]:
        with mqtt_bus(work, [[0, 1]], {0: max(window, 1)}) as endpoints:
            yield endpoints[0]


#: The systems, in run order.
SYSTEMS: dict[str, type[RabbitMqtt] | type[Mosquitto] | type[AaabusMqtt]] = {
    "aaabus": AaabusMqtt,
    "rabbitmq_mqtt": RabbitMqtt,
    "mosquitto": Mosquitto,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved runs per system")
    parser.add_argument("--rounds", type=int, default=300, help="measured latency messages")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured messages before")
    parser.add_argument("--count", type=int, default=5000, help="messages per throughput run")
    parser.add_argument("--window", type=int, default=200, help="incomplete QoS flows at a time")
    parser.add_argument("--payload", type=int, default=0, help="extra payload bytes per message")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated among: {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline per measurement")
    parser.add_argument("--workdir", help="keep broker data and logs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _log(message: str) -> None:
    print(f"perf mqtt: {message}", file=sys.stderr, flush=True)


def latency(
    endpoint: Endpoint, qos: int, rounds: int, warmup: int, payload: int, timeout: float
) -> dict[str, Any]:
    """Publish one message at a time; time publish call -> subscriber's on_message."""
    tag = uuid.uuid4().hex[:8]
    topic = f"aaabus-mqtt/{tag}/lat"
    arrived: queue.Queue[tuple[int, bytes]] = queue.Queue()
    # The QoS the broker actually delivered at: a broker may grant less than asked.
    delivered_qos: set[int] = set()
    subscriber_box: list[PahoSession] = []

    def on_message(msg: Any) -> None:
        arrived.put((time.perf_counter_ns(), msg.payload))
        delivered_qos.add(msg.qos)
        subscriber_box[0].client.ack(msg.mid, msg.qos)

    subscriber = PahoSession(
        endpoint, f"lat-sub-{tag}", qos, subscribe=topic, on_message=on_message
    )
    subscriber_box.append(subscriber)
    publisher = PahoSession(endpoint, f"lat-pub-{tag}", qos)
    deadline = time.monotonic() + timeout
    samples: list[int] = []
    try:
        subscriber.connect()
        publisher.connect()
        for n in range(warmup + rounds):
            body = str(n).encode() + b" " + b"x" * payload
            t0 = time.perf_counter_ns()
            publisher.client.publish(topic, body, qos=qos)
            try:
                t1, got = arrived.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"message {n} not delivered before the deadline") from None
            if got != body:
                raise RuntimeError(f"message {n}: got {got[:20]!r}")
            if n >= warmup:
                samples.append(t1 - t0)
    finally:
        publisher.close()
        subscriber.close()
    return {
        "rounds": len(samples),
        "latency_ms": summarise(samples),
        "delivered_qos": sorted(delivered_qos),
    }


def _chosen(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(
            f"perf mqtt: error: unknown system(s) {unknown or text!r}; "
            f"--systems takes a comma-separated list among: {', '.join(SYSTEMS)}"
        )
    return names


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions, per QoS: latency p50/p90/p99 and throughput."""
    out: dict[str, Any] = {}
    for qos in QOS_LEVELS:
        key = f"qos{qos}"
        reps = [r[key] for r in runs if key in r]
        out[key] = {
            "latency_ms": {
                p: _median([r["latency"]["latency_ms"][p] for r in reps])
                for p in ("p50", "p90", "p99")
            },
            "msgs_per_s": _median(
                [r["throughput"]["msgs_per_s"] for r in reps if r["throughput"]["msgs_per_s"]]
            ),
        }
    return out


def ratios_vs(
    ours: dict[str, Any] | None, peer: dict[str, Any] | None, peer_name: str
) -> dict[str, float | None]:
    """``latency_qosN_vs_PEER`` (p50 time ÷ peer's: above 1 slower) and ``throughput_qosN_vs_PEER``
    (rate ÷ peer's: above 1 faster), the shape of aaabus's ratios to come."""
    out: dict[str, float | None] = {}
    for qos in QOS_LEVELS:
        a = (ours or {}).get(f"qos{qos}") or {}
        b = (peer or {}).get(f"qos{qos}") or {}
        lat_a, lat_b = (
            (a.get("latency_ms") or {}).get("p50"),
            (b.get("latency_ms") or {}).get("p50"),
        )
        thr_a, thr_b = a.get("msgs_per_s"), b.get("msgs_per_s")
        out[f"latency_qos{qos}_vs_{peer_name}"] = lat_a / lat_b if lat_a and lat_b else None
        out[f"throughput_qos{qos}_vs_{peer_name}"] = thr_a / thr_b if thr_a and thr_b else None
    return out


def run(args: argparse.Namespace) -> int:
    if min(args.repetitions, args.rounds, args.count, args.window) < 1 or args.warmup < 0:
        raise SystemExit("perf mqtt: error: counts must be positive")
    names = _chosen(args.systems)
    runs: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(scratch(args.workdir))
        endpoints: dict[str, Endpoint] = {}
        for name in names:
            system = SYSTEMS[name]()
            reason = system.missing()
            if reason is None:
                try:
                    endpoints[name] = stack.enter_context(system.endpoint(work / name, args.window))
                    _log(f"{name} at {endpoints[name].host}:{endpoints[name].port}")
                except (OSError, RuntimeError) as exc:
                    reason = f"could not start: {type(exc).__name__}: {exc}"
            if reason is not None:
                skipped[name] = reason
                _log(f"skipping {name}: {reason}")
        for rep in range(args.repetitions):
            for name, endpoint in endpoints.items():
                if name in failed:
                    continue
                _log(f"repetition {rep + 1}/{args.repetitions}: {name}")
                measured: dict[str, Any] = {}
                try:
                    for qos in QOS_LEVELS:
                        a = args
                        measured[f"qos{qos}"] = {
                            "latency": latency(
                                endpoint, qos, a.rounds, a.warmup, a.payload, a.timeout
                            ),
                            "throughput": mqtt_stream(
                                endpoint, qos, a.count, a.window, a.payload, a.timeout
                            ),
                        }
                except Exception as exc:  # one broker's failure must not lose the others'
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    _log(f"{name} failed, dropped from the remaining repetitions: {failed[name]}")
                    continue
                runs.setdefault(name, []).append(measured)
    systems = {name: summary(runs[name]) if runs.get(name) else None for name in names}
    ratios = {
        name: ratios_vs(systems[name], systems.get("rabbitmq_mqtt"), "rabbitmq")
        for name in names
        if name != "rabbitmq_mqtt"
    }
    if not args.json:
        _print_table(systems)
    print(
        json.dumps(
            {
                "suite": "mqtt",
                "repetitions": args.repetitions,
                "rounds": args.rounds,
                "warmup": args.warmup,
                "count": args.count,
                "window": args.window,
                "payload": args.payload,
                "skipped": skipped,
                "failed": failed,
                "systems": systems,
                "runs": runs,
                "ratios_vs_rabbitmq": ratios,
                # The flat figures: aaabus's ratios to RabbitMQ's MQTT plugin.
                "ratios": ratios.get("aaabus") or {},
            }
        )
    )
    return 1 if failed else 0


def _print_table(systems: dict[str, dict[str, Any] | None]) -> None:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'system':<16}{'qos':>4}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'msgs/s':>10}")
    for name, s in systems.items():
        if s is None:
            print(f"{name:<16}  skipped or failed")
            continue
        for qos in QOS_LEVELS:
            q = s[f"qos{qos}"]
            lat = "".join(cell(q["latency_ms"][p], "9.3f") for p in ("p50", "p90", "p99"))
            print(f"{name:<16}{qos:>4}{lat}{cell(q['msgs_per_s'], '10.0f')}")
