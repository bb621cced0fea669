"""``python -m perf <suite>``: the benchmarks of aaabus. Each prints one JSON object last."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from collections.abc import Sequence

from aaabus.errors import AaabusError


def _cmd_pingpong(args: argparse.Namespace) -> int:
    from perf.pingpong import compare_stores, run

    if args.stores:
        compared = compare_stores(
            args.config,
            args.test,
            args.rounds,
            args.stores.split(","),
            args.repeat,
            payload=args.payload,
            warmup=args.warmup,
            properties=_properties(args.property),
            replicas=args.replicas,
        )
        if not args.json:
            runs = ", ".join(f"{k} {v:.3f} ms" for k, v in compared["p50_ms"].items())
            print(f"{args.test} ping-pong p50 (median of {args.repeat} interleaved runs): {runs}")
        print(json.dumps(compared))
        return 0
    result = run(
        args.config,
        args.test,
        args.rounds,
        payload=args.payload,
        warmup=args.warmup,
        workdir=args.workdir,
        properties=_properties(args.property),
        breakdown=args.breakdown,
        replicas=args.replicas,
    )
    rtts = result.pop("rtts_ns")
    if not args.json:
        r = result["rtt_ms"]
        print(
            f"{args.test} ping-pong over {result['servers']} server(s), {len(rtts)} rounds: "
            f"p50 {r['p50']:.3f} ms, p90 {r['p90']:.3f} ms, p99 {r['p99']:.3f} ms, "
            f"mean {r['mean']:.3f} ms; wall {result['wall_ms_per_round']:.3f} ms/round"
        )
    print(json.dumps(result))
    return 0


def _cmd_stream(args: argparse.Namespace) -> int:
    from perf.stream import compare, run

    if args.against:
        compared = compare(
            args.config,
            args.count,
            _properties(args.against),
            args.repeat,
            burst=args.burst,
            payload=args.payload,
            properties=_properties(args.property),
        )
        if not args.json:
            med = compared["median_msgs_per_s"]
            print(
                f"stream, median of {args.repeat} interleaved runs: off {med['off']:.0f} msgs/s, "
                f"on {med['on']:.0f} msgs/s; overhead {compared['overhead_pct']:.1f} % of "
                f"throughput, {compared['cpu_overhead_pct']:.1f} % of CPU per message"
            )
        print(json.dumps(compared))
        return 0
    result = run(
        args.config,
        args.count,
        to=args.to,
        burst=args.burst,
        payload=args.payload,
        window=args.window,
        workdir=args.workdir,
        properties=_properties(args.property),
        timeout=args.timeout,
        sample_every=args.sample_every,
        samples=args.samples,
        replicas=args.replicas,
    )
    if not args.json:
        print(
            f"stream of {result['count']} notifications s0 -> s{result['to']}: "
            f"{result['msgs_per_s']:.0f} msgs/s ({result['seconds']:.2f} s), "
            f"{result['out_of_order']} out of order"
        )
    print(json.dumps(result))
    return 0


def _properties(pairs: list[str] | None) -> dict[str, str]:
    props: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"perf: error: --property takes NAME=VALUE, got {pair!r}")
        props[name] = value
    return props


def _cmd_demo(args: argparse.Namespace) -> int:
    from perf.demo import run_demo

    return run_demo()


_MODULE_SUITES = [
    ("sweep", "perf.sweep", "scaling sweep: topologies x sizes x tests x clock modes"),
    ("synth", "perf.synth", "write synthetic traces with known growth laws"),
    ("analyze", "aaabus.analysis.analyze", "aaabus analyze: traces to tables, fits and plots"),
    ("synth-traffic", "perf.synth_traffic", "write synthetic traffic traces with known groups"),
    ("plan", "aaabus.analysis.plan", "aaabus plan: traffic traces to domains (a3.xml), their cost"),
    ("groups", "perf.groups", "a workload in groups on flat, star, tree and planned domains"),
    ("torture", "perf.torture", "crash schedules with an independent causality checker"),
    ("peers", "perf.peers", "aaabus vs RabbitMQ and Mosquitto: ping-pong and stream, interleaved"),
    ("codecs", "perf.codecs", "wire formats: encode+decode per notification, aaabus vs the rest"),
    ("commit", "perf.commit", "one store commit: raw floor, FileStorage, LogStorage, interleaved"),
    ("receive", "perf.receive", "the link protocol's CPU per received message, by event size"),
    ("mqtt", "perf.mqtt", "MQTT brokers, same paho programs: latency and throughput at QoS 1, 2"),
    ("topics", "perf.topics", "publish/subscribe: one remote subscriber, fan-out, next to stream"),
    ("match", "perf.match", "topic matching: a publication, a subscription, 10 vs 10,000 filters"),
    ("edge", "perf.edge", "three WAN sites: does a subscriber read an answer before its question?"),
    ("roam", "perf.roam", "a device moving between three sites under SIGKILLs: lost, duplicated"),
    ("console", "perf.console", "the console's page on a bus of 150 servers: load time"),
    ("attack", "perf.attack", "what an attacker's bytes cost an MQTT listener: CPU, store, RSS"),
    ("safety", "perf.safety", "a sync replica's cost, beside RabbitMQ quorum queues on 3 nodes"),
    ("failover", "perf.failover", "primaries killed, stores wiped, under checked traffic"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__)
    sub = parser.add_subparsers(dest="suite", required=True)
    pp = sub.add_parser("pingpong", help="round-trip latency: local, remote or broadcast")
    pp.add_argument("--config", required=True, help="bus description (a3.xml); driver on server 0")
    pp.add_argument("--test", choices=["local", "remote", "broadcast"], default="local")
    pp.add_argument("--rounds", type=int, default=1000)
    pp.add_argument("--warmup", type=int, default=50)
    pp.add_argument("--payload", type=int, default=0, help="payload bytes per notification")
    pp.add_argument("--workdir", help="keep stores and config here (default: a temporary dir)")
    pp.add_argument("--json", action="store_true", help="print only the JSON line")
    pp.add_argument("--property", action="append", help="NAME=VALUE added to the config")
    pp.add_argument(
        "--stores",
        help="KIND,KIND...: the test once per store kind, interleaved; p50s and their ratios",
    )
    pp.add_argument("--repeat", type=int, default=3, help="with --stores: runs per kind")
    pp.add_argument(
        "--breakdown",
        action="store_true",
        help="trace every hop; breakdown_us: where one hop's p50 time goes (see perf/README.md)",
    )
    pp.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="give every server N replicas (issue 42; sync: --property aaabus.replication.sync)",
    )
    pp.set_defaults(func=_cmd_pingpong)
    st = sub.add_parser("stream", help="one-way persistent throughput, end to end")
    st.add_argument("--config", required=True, help="bus description; producer on server 0")
    st.add_argument("--count", type=int, default=50000)
    st.add_argument("--to", type=int, help="consumer's server (default: the highest id)")
    st.add_argument("--burst", type=int, default=200, help="notifications sent per reaction")
    st.add_argument("--payload", type=int, default=0)
    st.add_argument("--workdir")
    st.add_argument("--json", action="store_true")
    st.add_argument("--property", action="append", help="NAME=VALUE added to the config")
    st.add_argument(
        "--against",
        action="append",
        help="NAME=VALUE: runs without and with these properties, interleaved; their medians",
    )
    st.add_argument("--repeat", type=int, default=3, help="with --against: runs per side")
    st.add_argument("--timeout", type=float, default=600.0, help="deadline of the stream (s)")
    st.add_argument(
        "--window", type=int, default=0, help="flow control: most items unconsumed (0: open loop)"
    )
    st.add_argument(
        "--sample-every", type=float, default=0.0, help="seconds between store/RSS samples"
    )
    st.add_argument("--samples", help="JSON-lines file the samples are appended to")
    st.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="give every server N replicas (issue 42; sync: --property aaabus.replication.sync)",
    )
    st.set_defaults(func=_cmd_stream)
    demo = sub.add_parser("demo", help="what `make demo` runs")
    demo.set_defaults(func=_cmd_demo)
    # Suites that live in their own module: each offers add_arguments(parser) and run(args).
    # plan and analyze are the product's commands (aaabus.analysis), kept here under their old
    # names: the same code, the same JSON line.
    for name, module, help_text in _MODULE_SUITES:
        parser_ = sub.add_parser(name, help=help_text)
        suite = importlib.import_module(module)
        suite.add_arguments(parser_)
        parser_.set_defaults(func=suite.run)
    args = parser.parse_args(argv)
    _stop_cleanly_on_signals()
    try:
        code: int = args.func(args)
        return code
    except AaabusError as exc:
        print(f"perf {args.suite}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"perf {args.suite}: interrupted; every server started was stopped", file=sys.stderr)
        return 130


def _stop_cleanly_on_signals() -> None:
    """SIGTERM, and SIGINT even when the launching shell ignored it (as ``cmd &`` does), raise
    KeyboardInterrupt in the main thread: every suite's ``with`` blocks then stop the servers
    they started, which an unhandled SIGTERM would leave behind."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    sys.exit(main())
