"""``python -m perf mqtt``: MQTT brokers measured with the same paho programs, interleaved.

For each system (an MQTT endpoint; see :class:`MqttSystem`) and QoS 1 and 2:

* **latency**: a publisher and a subscriber (two paho clients, persistent sessions, manual acks)
  on the same topic; one message at a time, from the publisher's ``publish`` call to the
  subscriber's ``on_message`` (CLOCK_MONOTONIC, one process); p50/p90/p99 of ``--rounds``
  after ``--warmup``.
* **throughput**: one publisher, one subscriber in a separate process, ``--count`` messages with
  at most ``--window`` incomplete QoS flows (``perf peers``'s MQTT stream).

Both in MQTT 3.1.1 and in 5.0 (``--protocol 3,5``, the default: the same programs, paho in
MQTTv5 with the same persistent sessions), for the systems that speak it (RabbitMQ 3.10's plugin
is 3.1.1 only): ``"mqtt5"`` beside each system's 3.1.1 figures, and in ``"ratios"`` what 5.0
costs per message against 3.1.1 on the same system in the same run.

Systems today: ``rabbitmq_mqtt`` (a private RabbitMQ with its MQTT plugin; clean_session=False
sessions get durable queues, and RabbitMQ syncs persistent messages before acknowledging them) and
``mosquitto`` (a private Mosquitto, which never syncs: the floor), and ``aaabus`` (two server
processes, the MQTT listener of one; :class:`AaabusMqtt`). Systems run interleaved (each
repetition runs every system once) and each figure is the median over ``--repetitions``. A
system whose broker is missing is skipped (stderr, ``"skipped"``); one that fails during a
measurement is dropped from the remaining repetitions (``"failed"``, exit status 1). Runs in the
main thread; paho clients have their network threads; brokers and client children are stopped
by PID on exit, also on failure or Ctrl-C.

**Scale** (``--devices N``; :func:`run_scale`): the same systems, each started afresh for every
repetition (interleaved), driven by the independent load client of perf/mqttload.py (its own
MQTT codec, asyncio, thousands of connections per process, several processes): ``idle`` (N
devices connect at once and idle: connect rate, the holding process's RSS per connection,
threads and CPU, then one publication must reach one of them), ``fan_in`` (N devices publish
``--count`` QoS 1 messages each, ``--window`` in flight, one subscriber of ``dev/+/data`` counts
them: PUBACKs/s, PUBACK latency, server CPU per message) and ``fan_out`` (one publisher, N
subscribers). aaabus: the N devices on the listener of s0, the single client on s1's. **Storm**
(``--storm N``): N devices connect at once while ``--silent`` connections from the same address
never send CONNECT: do all devices get CONNACK 0, are the silent ones closed by the deadline?
The last line of stdout is one JSON object (see perf/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import queue
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from aaabus.mqtt.batchtrace import MARKS, stages
from aaabus.tools.launch import Bus
from perf import floor, mqttload
from perf.aaabus_mqtt import mqtt_bus, mqtt_servers
from perf.agents.pingpong import summarise
from perf.brokers import (
    NOFILE_HARD,
    Endpoint,
    find_binary,
    start_mosquitto,
    start_rabbitmq,
    stop_group,
)
from perf.harness import scratch
from perf.peers import PahoSession, mqtt_stream

QOS_LEVELS = (1, 2)
#: ``--protocol`` values: MQTT 3.1.1 (paho's protocol level 4) and 5.0.
PROTOCOLS = {"3": 4, "5": 5}


class MqttSystem(Protocol):
    """An MQTT endpoint to measure: started (and stopped) by the suite."""

    name: str
    #: The MQTT versions it speaks (paho's protocol levels: 4, 3.1.1; 5, 5.0).
    protocols: tuple[int, ...]

    def missing(self) -> str | None:
        """Why this system cannot run here (binary not installed), or None."""
        ...

    def endpoint(self, work: Path, window: int) -> contextlib.AbstractContextManager[Endpoint]:
        """Start the system in ``work``; yield its MQTT endpoint; stop it on exit."""
        ...

    def scale(
        self, work: Path, settings: ScaleSettings
    ) -> contextlib.AbstractContextManager[mqttload.Target]:
        """Start the system for the scale scenarios; yield what the load client needs."""
        ...


@dataclasses.dataclass(frozen=True)
class ScaleSettings:
    """How a system is configured for ``--devices``/``--storm``."""

    connections: int  # the most connections it must hold at once (devices + others + slack)
    window: int  # messages in flight towards one subscriber
    backlog: int  # messages one subscriber's queue must keep
    connect_ms: int  # aaabus: the CONNECT deadline
    per_address: int | None  # aaabus: connections awaiting CONNECT per address (None: default)
    max_waiting: int | None  # aaabus: connections awaiting CONNECT in all (None: default)


def _known(prop: str) -> bool:
    """Whether this checkout's server knows property ``prop`` (the listener's settings change
    with it; a server refuses a configuration with an unknown property)."""
    from aaabus.config.settings import find

    try:
        find(prop)
    except ValueError:
        return False
    return True


def _session_member(session: int, comm: str, timeout: float = 30.0) -> int:
    """The PID of the process named ``comm`` in session ``session`` (the broker's start script
    runs the Erlang VM as a child: its RSS and CPU are the VM's, not the script's)."""
    deadline = time.monotonic() + timeout
    while True:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            if name == comm and int(fields[3]) == session:
                return int(entry.name)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no process {comm!r} in session {session}")
        time.sleep(0.2)  # the VM is being exec'd: nothing to wait on but /proc


class ServerFailed(RuntimeError):
    """A system's server process exited during a scale run: its own account (exit status, last
    output lines), in one line."""


def _tail(lines: Iterable[str], keep: int = 3) -> str:
    """The last ``keep`` non-blank output lines joined into one line (or "no output")."""
    kept = [line.strip() for line in lines if line.strip()][-keep:]
    return " | ".join(kept) or "no output"


@contextlib.contextmanager
def _blame_servers(exited: Callable[[], str | None]) -> Iterator[None]:
    """Around a scale run: when it fails and ``exited()`` says a server process is gone, raise
    ServerFailed with the server's account, not what the load client saw of it (a zombie's empty
    /proc entry, refused connections). A failure with every server alive propagates as it is."""
    try:
        yield
    except Exception as exc:
        why = exited()
        if why is None:
            raise
        raise ServerFailed(f"{why}; the load client saw {type(exc).__name__}: {exc}") from exc


def _broker_exited(name: str, proc: subprocess.Popen[Any], log: Path | None) -> str | None:
    """A broker process's exit status and the tail of its log, or None while it runs."""
    code = proc.poll()
    if code is None:
        return None
    lines = log.read_text(errors="replace").splitlines() if log and log.exists() else []
    return f"{name} exited with status {code}: {_tail(lines)}"


def _bus_exited(bus: Bus) -> str | None:
    """The first aaabus server process that exited: its status and last output lines."""
    for sid, proc in bus.servers.items():
        if not proc.running():
            code = proc.stop()  # reaps it and drains its output
            return f"server {sid} exited with status {code}: {_tail(proc.lines)}"
    return None


class RabbitMqtt:
    name = "rabbitmq_mqtt"
    #: The MQTT versions it speaks: RabbitMQ's plugin has 5.0 from 3.13 on; `make peers`
    #: installs Debian's 3.10.
    protocols = (4,)

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

    @contextlib.contextmanager
    def scale(self, work: Path, settings: ScaleSettings) -> Iterator[mqttload.Target]:
        procs: list[Any] = []
        try:
            _amqp, mqtt = start_rabbitmq(work, procs, mqtt=True, nofile=NOFILE_HARD)
            assert mqtt is not None  # asked for
            beam = _session_member(procs[-1].pid, "beam.smp")
            where = (mqtt.host, mqtt.port)
            # RabbitMQ closes a connection that sent no CONNECT after 10 s (measured with
            # 3.10: its MQTT handshake timeout; not configured here).
            yield mqttload.Target(self.name, where, where, beam, (beam,), RABBITMQ_CONNECT_S)
        finally:
            for proc in reversed(procs):
                stop_group(proc)


class Mosquitto:
    name = "mosquitto"
    protocols = (4, 5)

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

    @contextlib.contextmanager
    def scale(self, work: Path, settings: ScaleSettings) -> Iterator[mqttload.Target]:
        procs: list[Any] = []
        try:
            # -1 is mosquitto's default (no limit); said explicitly, as the brokers' configs are
            # compared. Its file limit is what bounds it: raised to the hard limit.
            ep = start_mosquitto(
                work,
                procs,
                settings.window,
                extra_conf="max_connections -1\n",
                nofile=NOFILE_HARD,
            )
            pid = procs[-1].pid
            where = (ep.host, ep.port)
            log = work / "mosquitto" / "mosquitto.log"
            with _blame_servers(lambda: _broker_exited("mosquitto", procs[-1], log)):
                yield mqttload.Target(self.name, where, where, pid, (pid,), MOSQUITTO_CONNECT_S)
        finally:
            for proc in reversed(procs):
                stop_group(proc)


class AaabusMqtt:
    """Two aaabus server processes in one domain; the listener of s0 serves both paho clients
    (publisher and subscriber on one server, as with a single broker). Every QoS 1/2
    publication is committed (fsync'd) before its PUBACK/PUBREC, as RabbitMQ syncs."""

    name = "aaabus"
    protocols = (4, 5)

    def missing(self) -> str | None:
        return None

    @contextlib.contextmanager
    def endpoint(self, work: Path, window: int) -> Iterator[Endpoint]:
        with mqtt_bus(work, [[0, 1]], {0: max(window, 1)}) as endpoints:
            yield endpoints[0]

    @contextlib.contextmanager
    def scale(self, work: Path, settings: ScaleSettings) -> Iterator[mqttload.Target]:
        """Both servers with a listener: the N devices on s0's, the single client on s1's (a
        device's publication crosses the bus to reach the subscriber, and back for fan-out)."""
        props = {
            "aaabus.mqtt.max_connections": str(settings.connections),
            "aaabus.mqtt.connect_ms": str(settings.connect_ms),
            "aaabus.topics.backlog": str(settings.backlog),
        }
        if settings.per_address is not None:
            props["aaabus.mqtt.per_address"] = str(settings.per_address)
        if settings.max_waiting is not None and _known("aaabus.mqtt.max_waiting"):
            props["aaabus.mqtt.max_waiting"] = str(settings.max_waiting)
        if _known("aaabus.mqtt.connections_per_address"):  # every device is on 127.0.0.1
            props["aaabus.mqtt.connections_per_address"] = str(settings.connections)
        window = max(settings.window, 1)
        with mqtt_servers(
            work, [[0, 1]], {0: window, 1: window}, properties=props, nofile=NOFILE_HARD
        ) as bus:
            devices, single = bus.endpoints[0], bus.endpoints[1]
            with _blame_servers(lambda: _bus_exited(bus.bus)):
                yield mqttload.Target(
                    self.name,
                    (devices.host, devices.port),
                    (single.host, single.port),
                    bus.pids[0],
                    (bus.pids[0], bus.pids[1]),
                    settings.connect_ms / 1000,
                )


#: The scale scenarios, in run order (idle first: the RSS per connection of a fresh server).
SCALE_SCENARIOS = ("idle", "fan_in", "fan_out")

#: Connections a server gets beyond the scenario's own (probes, the single client, stragglers).
SLACK = 100

#: The CONNECT deadlines of the peers, which have no setting for it. RabbitMQ 3.10's MQTT plugin
#: closes a silent connection after 10 s; Mosquitto 2.0 applies a new connection the default
#: keep-alive of 60 s and closes it after 1.5 times that (both measured: 10.0 s and 94.8 s, the
#: latter with mosquitto's keep-alive check running every few seconds).
RABBITMQ_CONNECT_S = 10.0
MOSQUITTO_CONNECT_S = 90.0

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
    parser.add_argument(
        "--count",
        type=int,
        help="messages per throughput run (5000); with --devices, per device in fan-in (100)",
    )
    parser.add_argument(
        "--window",
        type=int,
        help="incomplete QoS flows at a time (200); with --devices, per device (10)",
    )
    parser.add_argument("--payload", type=int, default=0, help="extra payload bytes per message")
    parser.add_argument(
        "--protocol",
        default="3,5",
        help="MQTT versions of the single-client runs, comma-separated among 3 (3.1.1), 5 (5.0)",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated among: {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline per measurement")
    parser.add_argument("--workdir", help="keep broker data and logs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="QoS 1 latency on aaabus with its listener traced: where one round trip's p50 "
        "time goes (breakdown_us), beside the same run's floor (a durable write here and the "
        "clients' own part) and, if rabbitmq_mqtt is among --systems, RabbitMQ's round trip "
        "(see perf/README.md)",
    )
    scale = parser.add_argument_group("scale (perf/mqttload.py's load client; see perf/README.md)")
    scale.add_argument("--devices", type=int, help="N devices: the idle, fan-in, fan-out scenarios")
    scale.add_argument(
        "--scenarios",
        default=",".join(SCALE_SCENARIOS),
        help=f"with --devices, comma-separated among: {', '.join(SCALE_SCENARIOS)}",
    )
    scale.add_argument("--fanout-count", type=int, default=20, help="fan-out: publications")
    scale.add_argument("--idle-seconds", type=float, default=10.0, help="idle: how long")
    scale.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="fan-in: messages per second per device at most (0, the default: by --window)",
    )
    scale.add_argument(
        "--clean-subscribers",
        action="store_true",
        help="subscribers with clean sessions (default: persistent, as the paho programs)",
    )
    scale.add_argument(
        "--clients", type=int, help="load worker processes for the devices (default: by N)"
    )
    scale.add_argument(
        "--storm", type=int, help="N devices connect at once beside --silent silent connections"
    )
    scale.add_argument("--silent", type=int, default=200, help="storm: connections that never talk")
    scale.add_argument(
        "--connect-ms",
        type=int,
        help="aaabus: CONNECT deadline (connect_ms; default: 5000 for --storm, 5 ms per device, "
        "at least 5000 for --devices)",
    )
    scale.add_argument(
        "--per-address",
        type=int,
        help="aaabus: per_address (storm: the listener's default; scale: N + slack)",
    )
    scale.add_argument(
        "--max-waiting",
        type=int,
        help="aaabus: max_waiting where the server has it (storm: its default; scale: N + slack)",
    )


def _log(message: str) -> None:
    print(f"perf mqtt: {message}", file=sys.stderr, flush=True)


def latency(
    endpoint: Endpoint,
    qos: int,
    rounds: int,
    warmup: int,
    payload: int,
    timeout: float,
    protocol: int = 4,
) -> dict[str, Any]:
    """Publish one message at a time; time publish call -> subscriber's on_message (both
    clients in MQTT ``protocol``: 4, 3.1.1, or 5)."""
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
        endpoint, f"lat-sub-{tag}", qos, subscribe=topic, on_message=on_message, protocol=protocol
    )
    subscriber_box.append(subscriber)
    publisher = PahoSession(endpoint, f"lat-pub-{tag}", qos, protocol=protocol)
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


def summary(runs: list[dict[str, Any]], *, mqtt5: bool = False) -> dict[str, Any]:
    """Medians over the repetitions, per QoS: latency p50/p90/p99 and throughput (of the 5.0
    runs, under each run's ``"mqtt5"``, with ``mqtt5``)."""
    if mqtt5:
        runs = [r["mqtt5"] for r in runs if "mqtt5" in r]
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


def mqtt5_vs_mqtt311(system: dict[str, Any] | None) -> dict[str, float | None]:
    """What 5.0 costs against 3.1.1 on one system: ``mqtt5_cost_qosN_vs_mqtt311`` (3.1.1's
    throughput ÷ 5.0's, the time per message of 5.0 ÷ 3.1.1's: above 1, 5.0 costs more) and
    ``mqtt5_latency_qosN_vs_mqtt311`` (p50 ÷ p50)."""
    out: dict[str, float | None] = {}
    for qos in QOS_LEVELS:
        old = (system or {}).get(f"qos{qos}") or {}
        new = ((system or {}).get("mqtt5") or {}).get(f"qos{qos}") or {}
        thr_old, thr_new = old.get("msgs_per_s"), new.get("msgs_per_s")
        lat_old = (old.get("latency_ms") or {}).get("p50")
        lat_new = (new.get("latency_ms") or {}).get("p50")
        out[f"mqtt5_cost_qos{qos}_vs_mqtt311"] = thr_old / thr_new if thr_old and thr_new else None
        out[f"mqtt5_latency_qos{qos}_vs_mqtt311"] = (
            lat_new / lat_old if lat_old and lat_new else None
        )
    return out


def _protocols(text: str) -> list[int]:
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    if not chosen or any(n not in PROTOCOLS for n in chosen):
        raise SystemExit(
            f"perf mqtt: error: --protocol {text!r}: a comma-separated list among 3 (MQTT 3.1.1) "
            "and 5 (MQTT 5.0)"
        )
    return sorted({PROTOCOLS[n] for n in chosen})


def run(args: argparse.Namespace) -> int:
    if args.devices is not None or args.storm is not None:
        return run_scale(args)
    if args.breakdown:
        return run_breakdown(args)
    protocols = _protocols(args.protocol)
    args.count = 5000 if args.count is None else args.count
    args.window = 200 if args.window is None else args.window
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
                    for protocol in protocols:
                        if protocol not in SYSTEMS[name].protocols:
                            continue
                        # 3.1.1's figures where they always were; 5.0's under "mqtt5".
                        into = measured if protocol == 4 else measured.setdefault("mqtt5", {})
                        for qos in QOS_LEVELS:
                            a = args
                            into[f"qos{qos}"] = {
                                "latency": latency(
                                    endpoint,
                                    qos,
                                    a.rounds,
                                    a.warmup,
                                    a.payload,
                                    a.timeout,
                                    protocol,
                                ),
                                "throughput": mqtt_stream(
                                    endpoint,
                                    qos,
                                    a.count,
                                    a.window,
                                    a.payload,
                                    a.timeout,
                                    protocol,
                                ),
                            }
                except Exception as exc:  # one broker's failure must not lose the others'
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    _log(f"{name} failed, dropped from the remaining repetitions: {failed[name]}")
                    continue
                runs.setdefault(name, []).append(measured)
    systems: dict[str, dict[str, Any] | None] = {}
    for name in names:
        figures = systems[name] = summary(runs[name]) if runs.get(name) else None
        if figures is not None and any("mqtt5" in r for r in runs[name]):
            figures["mqtt5"] = summary(runs[name], mqtt5=True)
    ratios = {
        name: ratios_vs(systems[name], systems.get("rabbitmq_mqtt"), "rabbitmq")
        for name in names
        if name != "rabbitmq_mqtt"
    }
    mqtt5 = {
        name: mqtt5_vs_mqtt311(systems[name])
        for name in names
        if 5 in protocols and 5 in SYSTEMS[name].protocols
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
                "protocols": ["3.1.1" if p == 4 else "5.0" for p in protocols],
                "skipped": skipped,
                "failed": failed,
                "systems": systems,
                "runs": runs,
                "ratios_vs_rabbitmq": ratios,
                "ratios_mqtt5_vs_mqtt311": mqtt5,
                # The issues' flat figures: aaabus's ratios to RabbitMQ's MQTT plugin, and what
                # 5.0 costs aaabus per message against 3.1.1.
                "ratios": {**(ratios.get("aaabus") or {}), **(mqtt5.get("aaabus") or {})},
            }
        )
    )
    return 1 if failed else 0


def run_breakdown(args: argparse.Namespace) -> int:
    """``--breakdown``: ``--repetitions`` QoS 1 latency runs on aaabus (MQTT 3.1.1, a fresh
    bus each, its listener traced: ``aaabus.trace``), and where a round trip's time goes: per
    run, then per stage the median of the runs (a busy spell of the shared disk hits one run's
    ``sync`` and its round trip together, not the others')."""
    if min(args.repetitions, args.rounds) < 1 or args.warmup < 0:
        raise SystemExit("perf mqtt: error: counts must be positive")
    runs: list[dict[str, Any]] = []
    # The publications' batches: how many the listener's loop ran itself, and of those how
    # many wrote their delivery before their PUBACK (aaabus.mqtt.batches: all of them).
    batches = {"traced": 0, "run_by_the_loop": 0, "delivered_before_answered": 0}
    peers = [name for name in _chosen(args.systems) if name == "rabbitmq_mqtt"]
    theirs: list[float] = []
    syncs: list[float] = []
    with contextlib.ExitStack() as stack:
        peer = None
        if peers and RabbitMqtt().missing() is None:
            peer = stack.enter_context(RabbitMqtt().endpoint(stack.enter_context(scratch()), 200))
        for rep in range(args.repetitions):
            _log(f"breakdown {rep + 1}/{args.repetitions}")
            runs.append(_breakdown_run(args, batches))
            # The same run's floor: a durable write here (the log store's pwrite + fdatasync
            # of one small record), and the peer's QoS 1 round trip between the same clients.
            with scratch(args.workdir) as work:
                syncs.append(_write_sync_p50_us(work / "floor.journal", args.rounds))
            if peer is not None:
                measured = latency(peer, 1, args.rounds, args.warmup, args.payload, args.timeout)
                theirs.append(measured["latency_ms"]["p50"])
    stages_run = [key for key in runs[0] if key != "latency_ms_p50"]
    ours = statistics.median(r["latency_ms_p50"] for r in runs)
    wire = statistics.median(r["clients_and_wire"] for r in runs)
    floor_us = wire + statistics.median(syncs)
    result = {
        "suite": "mqtt-breakdown",
        "repetitions": args.repetitions,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "latency_ms_p50": ours,
        "breakdown_us": {
            key: round(statistics.median(r.get(key, 0.0) for r in runs), 1) for key in stages_run
        },
        "runs": runs,
        "batches": batches,
        # What no broker that syncs before its PUBACK can beat here: the same clients and
        # loopback (clients_and_wire) plus one durable write of this disk, now.
        "floor": {
            "write_sync_us_p50": round(statistics.median(syncs), 1),
            "floor_ms": round(floor_us / 1000, 3),
            "rabbitmq_mqtt_qos1_p50_ms": statistics.median(theirs) if theirs else None,
        },
        "ratios": {
            "qos1_p50_vs_floor": round(ours * 1000 / floor_us, 3),
            "qos1_p50_vs_rabbitmq": round(ours / statistics.median(theirs), 3) if theirs else None,
            "floor_vs_rabbitmq": (
                round(floor_us / 1000 / statistics.median(theirs), 3) if theirs else None
            ),
        },
    }
    if not args.json:
        print(f"QoS 1 round trip p50 {result['latency_ms_p50']:.3f} ms; µs per stage:")
        for stage, value in result["breakdown_us"].items():
            print(f"  {stage:<20}{value:>10}")
    print(json.dumps(result))
    return 0


def _breakdown_run(args: argparse.Namespace, batches: dict[str, int]) -> dict[str, Any]:
    """One traced QoS 1 latency run on a fresh aaabus: its p50 and stages; counts its
    publications' batches into ``batches``."""
    with scratch(args.workdir) as work:
        props = {"aaabus.trace": "trace"}  # relative to the bus's a3.xml: work/trace
        with mqtt_servers(work, [[0, 1]], {0: 200}, properties=props) as bus:
            measured = latency(
                bus.endpoints[0], 1, args.rounds, args.warmup, args.payload, args.timeout
            )
        # The servers have stopped: the trace is complete. The publications' batches are
        # those followed by a delivery; the warm-up's are the first of them.
        lines = (work / "trace" / "mqtt-s0.jsonl").read_text().splitlines()
        traced = [m for m in map(json.loads, filter(None, lines)) if "delivered" in m]
    p50 = measured["latency_ms"]["p50"]
    counted = traced[-args.rounds :]
    inline = [m for m in counted if m.get("inline")]
    batches["traced"] += len(counted)
    batches["run_by_the_loop"] += len(inline)
    batches["delivered_before_answered"] += sum(
        1 for m in inline if m["delivered"] <= m.get("answered", m["delivered"])
    )
    return {"latency_ms_p50": p50, **batch_breakdown(counted, p50)}


def _write_sync_p50_us(path: Path, rounds: int) -> float:
    """The p50 of one small record's ``pwrite`` + ``fdatasync`` in ``path`` (perf.floor's
    journal file, preallocated: the log store's own kind of write)."""
    journal = floor.Journal(path)
    try:
        times = []
        for _ in range(rounds):
            started = time.perf_counter_ns()
            journal.append()
            times.append((time.perf_counter_ns() - started) / 1000)
    finally:
        journal.close()
    return float(statistics.median(times))


def batch_breakdown(records: list[dict[str, int]], p50_ms: float) -> dict[str, float]:
    """Per stage of :data:`aaabus.mqtt.batchtrace.MARKS`, the p50 in µs over the batches that
    passed it; ``server`` (the batches' read → delivery, p50), and ``clients_and_wire``: the
    round trip's p50 less ``server`` (two paho clients, their threads, loopback TCP)."""
    per_stage: dict[str, list[float]] = {stage: [] for _mark, stage in MARKS}
    server: list[float] = []
    for marks in records:
        for stage, ns in stages(marks).items():
            per_stage[stage].append(ns / 1000)
        if "delivered" in marks:
            server.append((marks["delivered"] - marks["read"]) / 1000)
    out = {
        stage: round(statistics.median(values), 1) for stage, values in per_stage.items() if values
    }
    total = round(statistics.median(server), 1) if server else 0.0
    out["server"] = total
    out["clients_and_wire"] = round(p50_ms * 1000 - total, 1)
    return out


def _print_table(systems: dict[str, dict[str, Any] | None]) -> None:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    head = f"{'system':<16}{'mqtt':>6}{'qos':>4}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
    print(f"{head}{'msgs/s':>10}")
    for name, s in systems.items():
        if s is None:
            print(f"{name:<16}  skipped or failed")
            continue
        for version, figures in (("3.1.1", s), ("5.0", s.get("mqtt5"))):
            if figures is None:
                continue
            for qos in QOS_LEVELS:
                q = figures[f"qos{qos}"]
                if q["msgs_per_s"] is None and q["latency_ms"]["p50"] is None:
                    continue  # not measured (--protocol)
                lat = "".join(cell(q["latency_ms"][p], "9.3f") for p in ("p50", "p90", "p99"))
                print(f"{name:<16}{version:>6}{qos:>4}{lat}{cell(q['msgs_per_s'], '10.0f')}")


# -- scale: --devices N and --storm N ---------------------------------------------------------


def _scale_options(args: argparse.Namespace) -> tuple[int, mqttload.Options, list[str]]:
    if args.devices is not None and args.storm is not None:
        raise SystemExit("perf mqtt: error: --devices and --storm are separate runs")
    n = args.storm if args.storm is not None else args.devices
    count = 100 if args.count is None else args.count
    window = 10 if args.window is None else args.window
    if min(n, count, window, args.repetitions, args.fanout_count) < 1 or args.silent < 0:
        raise SystemExit("perf mqtt: error: counts must be positive")
    if args.rate < 0:
        raise SystemExit(f"perf mqtt: error: --rate {args.rate:g} is negative; give 0 or more")
    if args.storm is not None:
        scenarios = ["storm"]
    else:
        scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
        unknown = [x for x in scenarios if x not in SCALE_SCENARIOS]
        if unknown or not scenarios:
            raise SystemExit(
                f"perf mqtt: error: unknown scenario(s) {unknown or args.scenarios!r}; "
                f"--scenarios takes a comma-separated list among: {', '.join(SCALE_SCENARIOS)}"
            )
    opts = mqttload.Options(
        devices=n,
        count=count,
        window=window,
        qos=1,
        payload=args.payload,
        fanout_count=args.fanout_count,
        idle_seconds=args.idle_seconds,
        rate=args.rate,
        persistent_subscribers=not args.clean_subscribers,
        silent=args.silent,
        timeout=args.timeout,
    )
    return n, opts, scenarios


def run_scale(args: argparse.Namespace) -> int:
    """``--devices`` / ``--storm``: each system started afresh per repetition, interleaved."""
    n, opts, scenarios = _scale_options(args)
    names = _chosen(args.systems)
    storm = args.storm is not None
    settings = ScaleSettings(
        connections=n + opts.silent + SLACK if storm else n + SLACK,
        window=opts.window,
        backlog=max(100_000, n * opts.count + SLACK),
        # The storm measures the deadline; the other scenarios measure what N devices cost
        # once connected, and N devices connecting at once take N / (connects per second)
        # (10,000 took 1.2 s on a quiet machine, 58 s for 19,500 on a loaded one): a
        # deadline shorter than that closes devices still queued for their CONNECT.
        # At most the setting's bound, an hour.
        connect_ms=args.connect_ms or (5000 if storm else min(3_600_000, max(5000, 5 * n))),
        # The storm tests the per-address table as configured. The other scenarios' devices
        # all come from 127.0.0.1 only because they run on one machine (real devices come from
        # as many addresses): the table must not turn them away.
        per_address=args.per_address if storm or args.per_address else n + SLACK,
        max_waiting=args.max_waiting if storm or args.max_waiting else n + SLACK,
    )
    processes = None if args.clients is None else args.clients + 1
    _soft, nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    if nofile != resource.RLIM_INFINITY and nofile < settings.connections:
        # Every connection is a descriptor of the process that holds it; the servers get this
        # process's hard limit (raised as their soft one) and cannot go beyond it.
        _log(
            f"warning: a server process may open {nofile} files (ulimit -Hn) but {n} devices "
            f"need {settings.connections}: expect at most ~{nofile - 100} connected; raise the "
            "hard limit (as root: ulimit -Hn, or LimitNOFILE= in a systemd unit)"
        )
    runs: dict[str, list[dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name in names:
        reason = SYSTEMS[name]().missing()
        if reason is not None:
            skipped[name] = reason
            _log(f"skipping {name}: {reason}")
    t0 = time.monotonic()
    with scratch(args.workdir) as work:
        for rep in range(args.repetitions):
            for name in names:
                if name in skipped or name in failed:
                    continue
                _log(f"repetition {rep + 1}/{args.repetitions}: {name}, {', '.join(scenarios)}")
                try:
                    with SYSTEMS[name]().scale(work / f"{name}-{rep}", settings) as target:
                        result = mqttload.run_scenarios(target, opts, scenarios, processes)
                except Exception as exc:  # one system's failure must not lose the others'
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    _log(f"{name} failed, dropped from the remaining repetitions: {failed[name]}")
                    continue
                runs.setdefault(name, []).append(result)
    systems = {name: scale_summary(runs[name]) if runs.get(name) else None for name in names}
    ours = systems.get("aaabus")
    ratios = {
        f"aaabus/{peer}": scale_ratios(ours, systems.get(peer))
        for peer in ("rabbitmq_mqtt", "mosquitto")
        if peer in names and "aaabus" in names
    }
    if not args.json:
        _print_scale_table(systems, scenarios)
    print(
        json.dumps(
            {
                "suite": "mqtt-storm" if storm else "mqtt-scale",
                "devices": n,
                "scenarios": scenarios,
                "count": opts.count,
                "window": opts.window,
                "fanout_count": opts.fanout_count,
                "idle_seconds": opts.idle_seconds,
                "silent": opts.silent if storm else None,
                "repetitions": args.repetitions,
                "settings": dataclasses.asdict(settings),
                "nofile_hard": None if nofile == resource.RLIM_INFINITY else nofile,
                "seconds": time.monotonic() - t0,
                "skipped": skipped,
                "failed": failed,
                "systems": systems,
                "ratios": ratios,
                "runs": runs,
            }
        )
    )
    return 1 if failed else 0


def _med(runs: list[dict[str, Any]], *path: str) -> float | None:
    """The median over the repetitions of the figure at ``path`` (None where absent)."""
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            values.append(float(value))
    return _median(values)


def _worst(runs: list[dict[str, Any]], *path: str) -> float | None:
    values = [v for v in (_med([r], *path) for r in runs) if v is not None]
    return max(values) if values else None


def _every(runs: list[dict[str, Any]], *path: str) -> bool | None:
    values = []
    for run in runs:
        value: Any = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, bool):
            values.append(value)
    return all(values) if values else None


def scale_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario, the medians over the repetitions (losses and failures: the worst)."""
    out: dict[str, Any] = {}
    if any("idle" in r for r in runs):
        out["idle"] = {
            "connected": _med(runs, "idle", "connected"),
            "refused": _worst(runs, "idle", "refused"),
            "connects_per_s": _med(runs, "idle", "connects_per_s"),
            "connect_p99_ms": _med(runs, "idle", "connect", "connect_ms", "p99"),
            "rss_bytes_per_conn": _med(runs, "idle", "rss_bytes_per_conn"),
            "threads": _med(runs, "idle", "threads"),
            "idle_cpu_pct": _med(runs, "idle", "idle_cpu_pct"),
            "lost_while_idle": _worst(runs, "idle", "lost_while_idle"),
            "reached": _every(runs, "idle", "reached"),
        }
    if any("fan_in" in r for r in runs):
        out["fan_in"] = {
            "connected": _med(runs, "fan_in", "devices", "connected"),
            "refused": _worst(runs, "fan_in", "devices", "refused_total"),
            "msgs_per_s": _med(runs, "fan_in", "msgs_per_s"),
            "puback_p50_ms": _med(runs, "fan_in", "puback_ms", "p50"),
            "puback_p99_ms": _med(runs, "fan_in", "puback_ms", "p99"),
            "delivery_p50_ms": _med(runs, "fan_in", "delivery_ms", "p50"),
            "delivery_p99_ms": _med(runs, "fan_in", "delivery_ms", "p99"),
            "delivered_per_s": _med(runs, "fan_in", "delivered_per_s"),
            "expected": _med(runs, "fan_in", "expected"),
            "received": _med(runs, "fan_in", "received", "received"),
            "missing": _worst(runs, "fan_in", "missing"),
            "duplicates": _worst(runs, "fan_in", "duplicates"),
            "cpu_us_per_msg": _med(runs, "fan_in", "cpu_us_per_msg"),
            "client_cpu_pct_max": _med(runs, "fan_in", "client_cpu_pct_max"),
        }
    if any("fan_out" in r for r in runs):
        out["fan_out"] = {
            "connected": _med(runs, "fan_out", "subscribers", "connected"),
            "refused": _worst(runs, "fan_out", "subscribers", "refused_total"),
            "deliveries_per_s": _med(runs, "fan_out", "deliveries_per_s"),
            "latency_p50_ms": _med(runs, "fan_out", "latency_ms", "p50"),
            "latency_p99_ms": _med(runs, "fan_out", "latency_ms", "p99"),
            "expected": _med(runs, "fan_out", "expected"),
            "missing": _worst(runs, "fan_out", "missing"),
            "duplicates": _worst(runs, "fan_out", "duplicates"),
            "cpu_us_per_delivery": _med(runs, "fan_out", "cpu_us_per_delivery"),
            "client_cpu_pct_max": _med(runs, "fan_out", "client_cpu_pct_max"),
        }
    if any("storm" in r for r in runs):
        worst_connack = [r["storm"]["connack0"] for r in runs if "storm" in r]
        worst_evicted = [r["storm"]["silent_closed_in_time"] for r in runs if "storm" in r]
        out["storm"] = {
            "devices": runs[0]["storm"]["devices"],
            "connack0": min(worst_connack),
            "all_connected": _every(runs, "storm", "all_connected"),
            "connects_per_s": _med(runs, "storm", "connect", "connects_per_s"),
            "silent": runs[0]["storm"]["silent_opened"],
            "silent_closed_in_time": min(worst_evicted),
            "deadline_s": runs[0]["storm"]["deadline_s"],
            "silent_closed_min_s": _med(runs, "storm", "silent_closed_after_s", "min"),
            "silent_closed_p50_s": _med(runs, "storm", "silent_closed_after_s", "p50"),
            "silent_closed_max_s": _worst(runs, "storm", "silent_closed_after_s", "max"),
            "all_evicted": _every(runs, "storm", "all_evicted"),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def scale_ratios(ours: dict[str, Any] | None, peer: dict[str, Any] | None) -> dict[str, Any]:
    """aaabus's figures over the peer's: above 1 is more (faster for rates; slower, heavier or
    busier for latency, RSS, CPU)."""
    a, b = ours or {}, peer or {}

    def get(s: dict[str, Any], scenario: str, key: str) -> float | None:
        value = (s.get(scenario) or {}).get(key)
        return value if isinstance(value, int | float) else None

    pairs = {
        "throughput": ("fan_in", "msgs_per_s"),
        "p50": ("fan_in", "puback_p50_ms"),
        "p99": ("fan_in", "puback_p99_ms"),
        "cpu_per_msg": ("fan_in", "cpu_us_per_msg"),
        "fanout_throughput": ("fan_out", "deliveries_per_s"),
        "fanout_p50": ("fan_out", "latency_p50_ms"),
        "connect_rate": ("idle", "connects_per_s"),
        "rss_per_conn": ("idle", "rss_bytes_per_conn"),
        "idle_cpu": ("idle", "idle_cpu_pct"),
        "storm_connect_rate": ("storm", "connects_per_s"),
    }
    return {k: _ratio(get(a, *where), get(b, *where)) for k, where in pairs.items()}


#: The table's rows: (scenario, key, label, format).
_ROWS = (
    ("idle", "connected", "idle: connected", ".0f"),
    ("idle", "refused", "idle: refused", ".0f"),
    ("idle", "connects_per_s", "idle: connects/s", ".0f"),
    ("idle", "rss_bytes_per_conn", "idle: RSS bytes/conn", ".0f"),
    ("idle", "threads", "idle: threads", ".0f"),
    ("idle", "idle_cpu_pct", "idle: CPU % of a core", ".2f"),
    ("idle", "reached", "idle: publication reached", ""),
    ("fan_in", "connected", "fan-in: connected", ".0f"),
    ("fan_in", "msgs_per_s", "fan-in: PUBACKs/s", ".0f"),
    ("fan_in", "puback_p50_ms", "fan-in: PUBACK p50 ms", ".2f"),
    ("fan_in", "puback_p99_ms", "fan-in: PUBACK p99 ms", ".2f"),
    ("fan_in", "delivered_per_s", "fan-in: delivered/s", ".0f"),
    ("fan_in", "delivery_p50_ms", "fan-in: delivery p50 ms", ".2f"),
    ("fan_in", "missing", "fan-in: missing", ".0f"),
    ("fan_in", "duplicates", "fan-in: duplicates", ".0f"),
    ("fan_in", "cpu_us_per_msg", "fan-in: server CPU µs/msg", ".1f"),
    ("fan_in", "client_cpu_pct_max", "fan-in: load client CPU %", ".0f"),
    ("fan_out", "connected", "fan-out: subscribers", ".0f"),
    ("fan_out", "deliveries_per_s", "fan-out: deliveries/s", ".0f"),
    ("fan_out", "latency_p50_ms", "fan-out: latency p50 ms", ".2f"),
    ("fan_out", "latency_p99_ms", "fan-out: latency p99 ms", ".2f"),
    ("fan_out", "missing", "fan-out: missing", ".0f"),
    ("fan_out", "duplicates", "fan-out: duplicates", ".0f"),
    ("storm", "connack0", "storm: CONNACK 0", ".0f"),
    ("storm", "connects_per_s", "storm: connects/s", ".0f"),
    ("storm", "silent", "storm: silent opened", ".0f"),
    ("storm", "silent_closed_in_time", "storm: silent closed in time", ".0f"),
    ("storm", "deadline_s", "storm: deadline s", ".1f"),
    ("storm", "silent_closed_min_s", "storm: first silent closed s", ".2f"),
    ("storm", "silent_closed_max_s", "storm: last silent closed s", ".2f"),
    ("storm", "all_connected", "storm: all devices in", ""),
    ("storm", "all_evicted", "storm: all silent evicted", ""),
)


def _print_scale_table(systems: dict[str, dict[str, Any] | None], scenarios: list[str]) -> None:
    names = list(systems)
    print(f"{'':<30}" + "".join(f"{n:>16}" for n in names))
    for scenario, key, label, spec in _ROWS:
        if scenario not in scenarios:
            continue
        cells = []
        for name in names:
            value = ((systems[name] or {}).get(scenario) or {}).get(key)
            if value is None:
                cells.append("-")
            elif isinstance(value, bool) or not spec:
                cells.append("yes" if value else "NO")
            else:
                cells.append(format(value, spec))
        print(f"{label:<30}" + "".join(f"{c:>16}" for c in cells))
