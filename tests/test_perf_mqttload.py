"""perf/mqttload.py, the independent MQTT load client: its codec alone, then its scenarios against
a real Mosquitto with 20 devices (fan-in counts exact, idle connections, a storm), and the JSON of
``python -m perf mqtt --devices``. Skipped where Mosquitto is not installed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perf import mqttload
from perf.brokers import find_binary, start_mosquitto, stop_group
from tests.support.harness import REPO_ROOT

N = 20

needs_mosquitto = pytest.mark.skipif(
    find_binary("mosquitto") is None, reason="mosquitto is not installed (`make peers`)"
)


def test_codec_round_trips_by_hand() -> None:
    """The framer splits packets at any cut; lengths, flags and packet ids are as 3.1.1 says."""
    assert mqttload.encode_length(0) == b"\x00"
    assert mqttload.encode_length(127) == b"\x7f"
    assert mqttload.encode_length(128) == b"\x80\x01"
    assert mqttload.encode_length(268_435_455) == b"\xff\xff\xff\x7f"
    connect = mqttload.connect_packet("dev-1", 60, clean=True)
    assert connect[0] == 0x10 and connect[2:8] == b"\x00\x04MQTT" and connect[8] == 4
    assert connect[9] == 0x02  # clean session, no credentials
    assert mqttload.ack_packet(mqttload.PUBREL, 7) == b"\x62\x02\x00\x07"
    payload = b"p" * 300  # a two-byte remaining length
    stream = (
        mqttload.publish_packet(b"a/b", payload, 1, 513)
        + mqttload.ack_packet(mqttload.PUBACK, 9)
        + mqttload.PINGREQ_PACKET
    )
    for cut in range(len(stream) + 1):
        framer = mqttload.Framer()
        packets = framer.feed(stream[:cut]) + framer.feed(stream[cut:])
        assert [first for first, _ in packets] == [0x32, 0x40, 0xC0]
        topic, qos, packet_id, body = mqttload.parse_publish(*packets[0])
        assert (topic, qos, packet_id, body) == (b"a/b", 1, 513, payload)
    with pytest.raises(mqttload.ProtocolError):
        mqttload.Framer().feed(b"\x30\xff\xff\xff\xff\x01")


def test_histogram_quantiles_within_one_percent() -> None:
    hist = mqttload.Hist()
    for ms in range(1, 101):
        hist.add(ms * 1_000_000)
    merged = mqttload.Hist().merge(hist.to_json())
    assert merged.count == 100
    p50, p99 = merged.quantile_ms(0.5), merged.quantile_ms(0.99)
    assert p50 is not None and abs(p50 - 50) / 50 < 0.02
    assert p99 is not None and abs(p99 - 99) / 99 < 0.02


def test_source_addresses_one_per_twenty_thousand_devices_towards_loopback() -> None:
    assert mqttload.sources_for(100_000, "127.0.0.1") == 5
    assert mqttload.sources_for(20_000, "127.0.0.1") == 1
    assert mqttload.sources_for(100_000, "192.0.2.7") == 1  # not ours to spread
    assert mqttload.source_address(7, 1) is None
    assert mqttload.source_address(7, 5) == ("127.0.0.3", 0)


def test_devices_connect_from_the_loopback_addresses_they_are_spread_over() -> None:
    """Real sockets: a listener that answers every CONNECT with CONNACK 0 sees six devices come
    from 127.0.0.1, .2 and .3, two each, and the worker counts the same."""
    peers: list[str] = []

    class Broker(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            peers.append(transport.get_extra_info("peername")[0])

        def data_received(self, data: bytes) -> None:
            if data[0] >> 4 == mqttload.CONNECT:
                self.transport.write(b"\x20\x02\x00\x00")

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Broker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        worker = mqttload.Worker(loop)
        try:
            return await worker.op_connect(
                ids=[0, 6],
                host="127.0.0.1",
                port=port,
                prefix="spread",
                keepalive=0,
                clean=True,
                concurrency=0,
                timeout=10.0,
                start_at=0.0,
                sources=3,
            )
        finally:
            for dev in worker.devices.values():
                dev.close(disconnect=False)
            server.close()

    result = asyncio.run(run())
    assert result["connected"] == 6 and result["errors"] == {}
    spread = {"127.0.0.1": 2, "127.0.0.2": 2, "127.0.0.3": 2}
    assert result["sources"] == spread
    assert {a: peers.count(a) for a in set(peers)} == spread


@pytest.fixture(scope="module")
def mosquitto() -> Iterator[mqttload.Target]:
    if find_binary("mosquitto") is None:
        pytest.skip("mosquitto is not installed (`make peers`)")
    procs: list[Any] = []
    with tempfile.TemporaryDirectory() as work:
        try:
            ep = start_mosquitto(Path(work), procs, 10)
            pid = procs[-1].pid
            where = (ep.host, ep.port)
            yield mqttload.Target("mosquitto", where, where, pid, (pid,), None)
        finally:
            for proc in procs:
                stop_group(proc)


@needs_mosquitto
def test_fan_in_counts_every_message_once(mosquitto: mqttload.Target) -> None:
    opts = mqttload.Options(devices=N, count=30, window=5, timeout=30.0, stall_s=5.0)
    result = mqttload.run_scenarios(mosquitto, opts, ["fan_in"], processes=3)["fan_in"]
    assert result["devices"]["connected"] == N
    assert result["acked"] == result["sent"] == N * 30
    assert result["received"]["received"] == N * 30
    assert result["missing"] == 0 and result["duplicates"] == 0
    assert result["received"]["per_subscriber"] == {str(N * 30): 1}
    assert result["msgs_per_s"] > 0 and result["puback_ms"]["p50"] > 0
    # The soak's record: [seconds, acknowledged, received, RSS of the one server], the first
    # just before the start, the last as the subscriber finishes.
    first, last = result["rss_timeline"][0], result["rss_timeline"][-1]
    assert len(first) == 4 and -1.0 < first[0] <= 0 and first[1] == 0 and first[3] > 1 << 20
    assert last[1] <= N * 30 and last[2] <= N * 30 + 1  # the probe, at most


@needs_mosquitto
def test_fan_in_at_a_rate_takes_the_time_the_rate_asks(mosquitto: mqttload.Target) -> None:
    """10 messages per device at 20/s: the 10th is due 0.45 s after the first, whatever the
    broker's speed; every one still arrives once."""
    opts = mqttload.Options(devices=N, count=10, window=5, rate=20.0, timeout=30.0, stall_s=5.0)
    result = mqttload.run_scenarios(mosquitto, opts, ["fan_in"], processes=3)["fan_in"]
    assert result["acked"] == N * 10 and result["received"]["received"] == N * 10
    assert result["seconds"] >= 0.45
    assert result["missing"] == 0 and result["duplicates"] == 0


@needs_mosquitto
def test_idle_devices_stay_connected_and_are_reached(mosquitto: mqttload.Target) -> None:
    opts = mqttload.Options(devices=N, idle_seconds=0.5, timeout=30.0)
    result = mqttload.run_scenarios(mosquitto, opts, ["idle"], processes=2)["idle"]
    assert result["connected"] == N and result["refused"] == 0
    assert result["still_open"] == N and result["lost_while_idle"] == 0
    assert result["reached"] is True
    assert result["connects_per_s"] > 0 and result["threads"] >= 1


@needs_mosquitto
def test_storm_connects_every_device(mosquitto: mqttload.Target) -> None:
    """Mosquitto keeps silent connections for 90 s: here they are watched briefly and the test
    checks what the load client counts, not Mosquitto's eviction."""
    opts = mqttload.Options(devices=N, silent=10, storm_wait_s=0.5, timeout=30.0)
    result = mqttload.run_scenarios(mosquitto, opts, ["storm"], processes=2)["storm"]
    assert result["connack0"] == N and result["all_connected"] is True
    assert result["silent_opened"] == 10
    assert result["silent_closed"] == 0 and result["all_evicted"] is False


@pytest.mark.slow
@needs_mosquitto
def test_perf_mqtt_devices_json_shape() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "perf", "mqtt", "--devices", str(N), "--systems"),
            *("mosquitto", "--repetitions", "1", "--count", "20", "--fanout-count", "5"),
            *("--idle-seconds", "0.5", "--timeout", "30", "--json"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["suite"] == "mqtt-scale" and result["devices"] == N
    assert result["skipped"] == {} and result["failed"] == {}
    mosq = result["systems"]["mosquitto"]
    assert set(mosq) == {"idle", "fan_in", "fan_out"}
    assert mosq["idle"]["connected"] == N and mosq["idle"]["reached"] is True
    assert mosq["fan_in"]["missing"] == 0 and mosq["fan_in"]["received"] == N * 20
    assert mosq["fan_out"]["missing"] == 0 and mosq["fan_out"]["expected"] == N * 5
    for key in ("msgs_per_s", "puback_p50_ms", "puback_p99_ms", "cpu_us_per_msg"):
        assert key in mosq["fan_in"]
    for key in ("connects_per_s", "rss_bytes_per_conn", "threads", "idle_cpu_pct"):
        assert key in mosq["idle"]
    # aaabus is not in this run: no ratios, but the key is there.
    assert result["ratios"] == {}
    assert len(result["runs"]["mosquitto"]) == 1
