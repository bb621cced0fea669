"""``python -m perf topics``: publish/subscribe throughput and latency, next to ``perf stream``.

Three runs on real server processes, one after the other in the same invocation (so that the
machine's load is comparable):

* ``one_remote``: one publisher on s0, one subscriber on s1 (a flat domain of two servers);
* ``fanout``: one publisher on s0, ``--subscribers`` subscribers (default 100) spread evenly over
  ``--servers`` servers (default 10, one flat domain), s0 included;
* ``stream``: ``perf stream``'s one-way notifications s0 -> s1 on the same two-server layout,
  the floor that ``one_remote`` pays topics on top of (the representative's reactions on both
  sides).

Each topic run is done twice: open loop (``--burst`` publications per reaction, as fast as the
publisher's server commits) for ``msgs_per_s`` — deliveries per second, from the first
publication's reaction to the last delivery — and ``latency_ms_loaded``; then paced (one
publication at a time, the next once every subscriber has answered, ``--rounds`` of them) for
``latency_ms``, from the publishing reaction to each subscriber's reaction on an idle bus
(p50, p99, mean over every delivery). The last line is JSON: the ``one_remote`` figures at the
top level (``msgs_per_s``, ``latency_ms``), each run under its name, and ``ratio_to_stream``.

With ``--peers`` (default: ``mosquitto,rabbitmq_mqtt``, each where installed; ``none`` for none),
the same two fan-outs run on each peer broker right after aaabus's, subscribers as MQTT clients
there (the independent load client of ``perf mqtt``, perf/mqttload.py: QoS 1, persistent
subscribers, one publisher with ``--window`` publications in flight): 1 -> 1 and 1 ->
``--subscribers``. Their deliveries/s and latencies land under ``peers``, and ``ratios`` holds
aaabus's deliveries/s over each peer's (``fanout_vs_mosquitto`` >= 1.0: aaabus delivers at least
as fast as a broker that never syncs). Peers have no servers to spread subscribers over: one
broker holds them all, as a deployment of one broker would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from aaabus.config.topology import generate
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus, free_port_base
from perf import stream
from perf.agents.topics import Blaster, Go, Sink
from perf.harness import REPO_ROOT, scratch, wait_for_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument("--count", type=int, default=5000, help="publications of one_remote")
    parser.add_argument(
        "--fanout-count", type=int, default=300, help="publications of the fan-out run"
    )
    parser.add_argument("--subscribers", type=int, default=100, help="subscribers of fan-out")
    parser.add_argument("--servers", type=int, default=10, help="servers of the fan-out run")
    parser.add_argument("--burst", type=int, default=50, help="publications per reaction")
    parser.add_argument("--rounds", type=int, default=200, help="publications of paced runs")
    parser.add_argument("--payload", type=int, default=0, help="padding bytes per publication")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each run (s)")
    parser.add_argument(
        "--peers",
        default="mosquitto,rabbitmq_mqtt",
        help="brokers that run the same fan-outs with MQTT subscribers (none: no peer)",
    )
    parser.add_argument(
        "--window", type=int, default=100, help="peers: the publisher's QoS 1 messages in flight"
    )
    parser.add_argument("--workdir", help="keep stores and configs here (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _config(path: Path, servers: int) -> Path:
    text = generate(
        "flat",
        servers,
        domain_size=max(servers, 2),
        base_port=free_port_base(3 * servers + 3),
        properties={"aaabus.trust": "perf.agents"},
    )
    path.write_text(text)
    return path


def measure(
    work: Path,
    servers: int,
    subscribers: int,
    count: int,
    rounds: int,
    burst: int,
    payload: int,
    timeout: float,
) -> dict[str, Any]:
    """One publisher on s0, ``subscribers`` sinks spread over ``servers`` servers: an open-loop
    run of ``count`` publications, then a paced one of ``rounds``."""
    loaded = _run(work / "open", servers, subscribers, count, burst, payload, 0, timeout)
    paced = _run(work / "paced", servers, subscribers, rounds, 1, payload, subscribers, timeout)
    return {**loaded, "latency_ms_loaded": loaded["latency_ms"], "latency_ms": paced["latency_ms"]}


def _run(
    work: Path,
    servers: int,
    subscribers: int,
    count: int,
    burst: int,
    payload: int,
    acks: int,
    timeout: float,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    config = _config(work / "a3.xml", servers)
    ids = list(range(servers))
    # One remote subscriber: on s1. Many: round robin over every server, s0 included.
    places = [1] if subscribers == 1 else [i % servers for i in range(subscribers)]
    outs = [work / f"sink-{k}.json" for k in range(subscribers)]
    with Bus(config, ids, work / "store", cwd=REPO_ROOT) as bus, Client(config, 0) as client:
        for place, out in zip(places, outs, strict=True):
            client.deploy(Sink(count, str(out), ack=acks > 0), server=place)
        blaster = client.deploy(Blaster(), server=0)
        remote = len(set(places) - {0})
        _wait_interest(client, remote, timeout)
        client.send(blaster, Go(count, burst, payload, acks))
        results = [wait_for_file(out, bus, timeout) for out in outs]
    start = min(r["first_ns"] for r in results)
    end = max(r["last_ns"] for r in results)
    latencies = sorted(ns for r in results for ns in r["latencies_ns"])
    deliveries = sum(r["count"] for r in results)
    seconds = (end - start) / 1e9
    return {
        "servers": servers,
        "subscribers": subscribers,
        "publications": count,
        "deliveries": deliveries,
        "out_of_order": sum(r["out_of_order"] for r in results),
        "seconds": seconds,
        "msgs_per_s": deliveries / seconds,
        "publications_per_s": count / seconds,
        "latency_ms": {
            "p50": _quantile(latencies, 0.50) / 1e6,
            "p99": _quantile(latencies, 0.99) / 1e6,
            "mean": statistics.fmean(latencies) / 1e6,
        },
    }


def _wait_interest(client: Client, servers: int, timeout: float) -> None:
    """Until s0's representative knows the subscriptions of ``servers`` other servers."""
    deadline = time.monotonic() + timeout
    while client.status()["topics"]["remote_servers"] < servers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"subscriptions of {servers} servers not known at s0")
        time.sleep(0.05)  # another process's state, read through its admin port: poll it


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def _quantile(values: list[int], q: float) -> float:
    return float(values[min(len(values) - 1, int(q * len(values)))])


def _peers(text: str) -> list[str]:
    from perf.mqtt import SYSTEMS

    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in SYSTEMS or n == "aaabus"]
    if unknown:
        peers = ", ".join(n for n in SYSTEMS if n != "aaabus")
        raise SystemExit(
            f"perf topics: error: unknown peer(s) {unknown}; --peers takes a comma-separated "
            f"list among: {peers} (or none)"
        )
    return names


def peer_fanout(
    name: str, work: Path, subscribers: int, count: int, window: int, timeout: float
) -> dict[str, Any]:
    """One publisher and ``subscribers`` MQTT subscribers of one topic on peer broker ``name``
    (QoS 1, persistent subscribers): deliveries/s, latency, missing and duplicates."""
    from perf import mqttload
    from perf.mqtt import SLACK, SYSTEMS, ScaleSettings

    settings = ScaleSettings(
        connections=subscribers + SLACK,
        window=window,
        backlog=max(100_000, count + SLACK),
        connect_ms=10_000,
        per_address=None,
        max_waiting=None,
    )
    opts = mqttload.Options(
        devices=subscribers,
        window=window,
        qos=1,
        fanout_count=count,
        persistent_subscribers=True,
        timeout=timeout,
    )
    with SYSTEMS[name]().scale(work, settings) as target:
        out = mqttload.run_scenarios(target, opts, ["fan_out"])["fan_out"]
    return {
        "subscribers": subscribers,
        "publications": out["acked"],
        "deliveries": out["received"]["received"],
        "missing": out["missing"],
        "duplicates": out["duplicates"],
        "msgs_per_s": out["deliveries_per_s"],
        "latency_ms": out["latency_ms"],
    }


def run(args: argparse.Namespace) -> int:
    from perf.mqtt import SYSTEMS

    peers = _peers(args.peers)
    skipped: dict[str, str] = {}
    for name in list(peers):
        reason = SYSTEMS[name]().missing()
        if reason is not None:
            skipped[name] = reason
            peers.remove(name)
    with scratch(args.workdir) as work:
        one = measure(
            work / "one_remote",
            2,
            1,
            args.count,
            args.rounds,
            args.burst,
            args.payload,
            args.timeout,
        )
        # Each peer right after aaabus's run of the same shape: a busy machine hurts them alike.
        peer_one = {
            name: peer_fanout(name, work / f"{name}-one", 1, args.count, args.window, args.timeout)
            for name in peers
        }
        fan = measure(
            work / "fanout",
            args.servers,
            args.subscribers,
            args.fanout_count,
            max(1, args.rounds // 4),
            args.burst,
            args.payload,
            args.timeout,
        )
        peer_fan = {
            name: peer_fanout(
                name,
                work / f"{name}-fan",
                args.subscribers,
                args.fanout_count,
                args.window,
                args.timeout,
            )
            for name in peers
        }
        streamed = stream.run(
            _config(work / "stream.xml", 2),
            args.count,
            payload=args.payload,
            workdir=str(work / "stream"),
            timeout=args.timeout,
        )
    result = {
        "msgs_per_s": one["msgs_per_s"],
        "latency_ms": one["latency_ms"],
        "one_remote": one,
        "fanout": fan,
        "stream": {k: streamed[k] for k in ("count", "msgs_per_s", "seconds", "out_of_order")},
        "ratio_to_stream": one["msgs_per_s"] / streamed["msgs_per_s"],
        "peers": {name: {"one_remote": peer_one[name], "fanout": peer_fan[name]} for name in peers},
        "ratios": {
            **{
                f"one_remote_vs_{name}": _ratio(one["msgs_per_s"], peer_one[name]["msgs_per_s"])
                for name in peers
            },
            **{
                f"fanout_vs_{name}": _ratio(fan["msgs_per_s"], peer_fan[name]["msgs_per_s"])
                for name in peers
            },
        },
        "skipped": skipped,
    }
    if not args.json:
        for name, figures in (("one remote subscriber", one), ("fan-out", fan)):
            lat, loaded = figures["latency_ms"], figures["latency_ms_loaded"]
            print(
                f"{name}: {figures['subscribers']} subscriber(s) on {figures['servers']} servers, "
                f"{figures['msgs_per_s']:.0f} deliveries/s (latency p50 {loaded['p50']:.1f} ms "
                f"in that flood); paced latency p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"
            )
        print(
            f"stream s0 -> s1: {streamed['msgs_per_s']:.0f} msgs/s; topics/stream "
            f"{result['ratio_to_stream']:.2f}"
        )
        for name in peers:
            for run_name in ("one_remote", "fanout"):
                peer = result["peers"][name][run_name]
                lat = peer["latency_ms"]
                print(
                    f"{name} {run_name}: {peer['subscribers']} MQTT subscriber(s), "
                    f"{peer['msgs_per_s'] or 0:.0f} deliveries/s, p50 {lat['p50'] or 0:.2f} ms, "
                    f"p99 {lat['p99'] or 0:.2f} ms; aaabus/{name} "
                    f"{result['ratios'][f'{run_name}_vs_{name}'] or 0:.2f}"
                )
    print(json.dumps(result))
    return 0
