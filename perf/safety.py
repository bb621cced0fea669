"""``python -m perf safety``: what one synchronous replica costs, beside RabbitMQ quorum queues.

In one run (issue 42, "the cost of safety"):

* aaabus, remote ping-pong and stream (``perf.pingpong``, ``perf.stream``) on ``--config``,
  without replicas and with one replica per server (``aaabus.replication.sync`` default 1: a
  commit waits for that replica's disk);
* a three-node RabbitMQ cluster started here on 127.0.0.1 (one private epmd on a free port,
  nodes ``safety-<pid>-a|b|c@localhost`` sharing a private cookie, joined with ``rabbitmqctl
  join_cluster``), quorum queues replicated on the three nodes: the same ping-pong and stream
  as ``perf peers`` (publisher confirms, persistent messages), then a stream during which the
  node that leads the queue is SIGKILLed (its process group, by PID). The publisher, connected
  to that node, reconnects to a survivor and resends what was not confirmed; ``recover_ms`` is
  from the kill to the first confirmed publish after it. The queue is then drained: a confirmed
  sequence number missing is lost, one seen twice is duplicated.

Every node and the epmd stop by PID at the end, also on error or interrupt. aaabus's own
failover (a replica taking over a killed primary) is measured by ``python -m perf failover
--peers``, beside this same cluster's kill (:mod:`perf.failover`): ``aaabus_failover`` stays null
here. Prints a small table (unless ``--json``) and one JSON line last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from perf.brokers import (
    RabbitNode,
    rabbitmqctl,
    start_epmd,
    start_rabbitmq_node,
    stop_group,
    wait_rabbitmq,
)
from perf.peers import _body, _persistent, _pika_params, _seq, rabbit_pingpong, rabbit_stream

QUORUM = {"x-queue-type": "quorum"}
#: Seconds the kill stream waits for one confirm before it reconnects and resends.
CONFIRM_DEADLINE = 5.0
#: The body that closes the kill stream (sequence numbers are digits).
END = b"end"
NODES = ("a", "b", "c")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument(
        "--config", default="domains/flat-2.xml", help="aaabus bus (remote ping-pong, stream)"
    )
    parser.add_argument("--rounds", type=int, default=1000, help="measured ping-pong rounds")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured rounds before")
    # 50,000: a stream of 5,000 (about 0.1 s) measured mostly the replicated server's start,
    # not its steady rate (perf/RESULTS.md, "The cost of safety", issue 42).
    parser.add_argument("--count", type=int, default=50000, help="messages per stream")
    parser.add_argument(
        "--window", type=int, default=200, help="RabbitMQ: unconfirmed publishes / unacked"
    )
    parser.add_argument(
        "--kill-count", type=int, default=2000, help="messages of the stream the leader dies in"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline of each part (s)")
    parser.add_argument("--workdir", help="keep the nodes' data and logs here (default: temp)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def run(args: argparse.Namespace) -> int:
    if min(args.rounds, args.count, args.window, args.kill_count) < 2 or args.warmup < 0:
        raise SystemExit(
            "perf safety: error: --rounds, --count, --window, --kill-count must be ≥ 2"
        )
    ours = _measure_aaabus(args)
    theirs = measure_quorum_cluster(args)
    result = _summary(args, ours, theirs)
    if not args.json:
        _print_table(result)
    print(json.dumps(result))
    return 0


def measure_quorum_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """Start the three-node cluster, measure its ping-pong, stream and leader kill, stop every
    node and the epmd by PID (also on error); the figures, with the PIDs that were stopped."""
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.workdir) / "rabbitmq"
            if args.workdir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aaabus-safety-")))
        )
        procs: list[subprocess.Popen[Any]] = []
        try:
            theirs = _measure_quorum(args, work, procs)
        finally:
            for proc in reversed(procs):
                stop_group(proc)
    theirs["pids"] = [proc.pid for proc in procs]
    return theirs


def quorum_defaults(workdir: str | None) -> argparse.Namespace:
    """This suite's default options (``workdir`` apart): what another suite that puts RabbitMQ
    beside its own run (``perf failover --peers``) measures it with."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    args.workdir = workdir
    return args


# aaabus -------------------------------------------------------------------------------------


def _measure_aaabus(args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """The remote ping-pong and the stream with 0, then 1 replica per server, each beside the
    floor of a durable ping-pong with as many mirrors (:mod:`perf.floor`): by replicas."""
    from perf import floor, pingpong, stream
    from perf.brokers import free_ports
    from perf.peers import _child

    out: dict[int, dict[str, Any]] = {}
    for replicas in (0, 1):
        with tempfile.TemporaryDirectory(prefix="aaabus-safety-floor-") as work:
            rtts = floor.pingpong(
                _child,
                Path(work),
                args.rounds,
                args.warmup,
                args.timeout,
                replicated=bool(replicas),
                ports=free_ports,
            )
        pp = pingpong.run(args.config, "remote", args.rounds, warmup=args.warmup, replicas=replicas)
        st = stream.run(args.config, args.count, replicas=replicas, timeout=args.timeout)
        out[replicas] = {
            "pingpong_ms": {k: pp["rtt_ms"][k] for k in ("p50", "p99")},
            "floor_pingpong_ms": {"p50": round(statistics.median(rtts) / 1e6, 4)},
            "stream_msgs_per_s": st["msgs_per_s"],
            "stream_out_of_order": st["out_of_order"],
        }
    return out


# RabbitMQ quorum queues ---------------------------------------------------------------------


def _measure_quorum(
    args: argparse.Namespace, work: Path, procs: list[subprocess.Popen[Any]]
) -> dict[str, Any]:
    nodes = start_cluster(work, procs)
    first = nodes[0].amqp
    pp = rabbit_pingpong(first, args.rounds, args.warmup, 0, args.timeout, QUORUM)
    st = rabbit_stream(first, args.count, args.window, 0, args.timeout, QUORUM)
    kill = kill_leader_during_stream(nodes, args.kill_count, args.timeout)
    return {
        "nodes": [node.name for node in nodes],
        "pingpong_ms": {k: pp["rtt_ms"][k] for k in ("p50", "p99")},
        "stream_msgs_per_s": st["msgs_per_s"],
        "stream_lost": st["count"] - st["received"],
        "kill": kill,
    }


def start_cluster(work: Path, procs: list[subprocess.Popen[Any]]) -> list[RabbitNode]:
    """Three RabbitMQ nodes on 127.0.0.1 in one cluster; every process is in ``procs``."""
    epmd_port = start_epmd(work / "epmd", procs)
    cookie = secrets.token_hex(16)
    nodes = [
        start_rabbitmq_node(
            work / f"rabbit-{n}",
            procs,
            f"safety-{os.getpid()}-{n}@localhost",
            epmd_port,
            cookie=cookie,
            wait=False,
        )
        for n in NODES
    ]
    for node in nodes:  # they boot side by side
        wait_rabbitmq(node)
    for node in nodes[1:]:
        rabbitmqctl(node, "stop_app")
        rabbitmqctl(node, "join_cluster", nodes[0].name)
        rabbitmqctl(node, "start_app")
    status = rabbitmqctl(nodes[0], "cluster_status", "--formatter", "json")
    running = set(json.loads(status)["running_nodes"])
    if running != {node.name for node in nodes}:
        raise RuntimeError(f"rabbitmq cluster incomplete: running {sorted(running)}")
    return nodes


def queue_leader(node: RabbitNode, queue: str) -> str:
    """The node name that leads quorum queue ``queue``, asked of ``node``."""
    out = rabbitmqctl(node, "list_queues", "name", "leader", "--no-table-headers", "--quiet")
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == queue:
            return fields[1]
    raise RuntimeError(f"quorum queue {queue} has no leader in: {out.strip()[-300:]}")


def kill_leader_during_stream(
    nodes: list[RabbitNode], count: int, timeout: float
) -> dict[str, Any]:
    """Publish ``count`` sequence numbers one confirm at a time to a quorum queue, connected to
    its leader; SIGKILL the leader's process group halfway; reconnect to a survivor and resend
    the unconfirmed one; then drain the queue and count what is lost and duplicated."""
    import pika

    queue = f"aaabus-safety-k-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(_pika_params(nodes[0].amqp))
    conn.channel().queue_declare(queue, durable=True, arguments=QUORUM)
    conn.close()
    leader = queue_leader(nodes[0], queue)
    victim = next(node for node in nodes if node.name == leader)
    survivors = [node for node in nodes if node is not victim]
    deadline = time.monotonic() + timeout
    confirmed: set[int] = set()
    t_kill = t_resume = 0.0
    reconnects = nacks = give_ups = 0
    target = victim
    conn = pika.BlockingConnection(_pika_params(target.amqp))
    ch: Any = conn.channel()
    ch.confirm_delivery()
    seq = 0
    while seq < count:
        if seq == count // 2 and not t_kill:
            os.killpg(victim.proc.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            victim.proc.wait(30)
        if time.monotonic() > deadline:
            raise TimeoutError(f"rabbitmq kill stream: {seq}/{count} after {timeout:.0f}s")
        if ch is None:  # the last reconnection failed
            conn, ch, reconnects = _reconnect(conn, survivors, reconnects)
            continue
        # BlockingChannel waits for a confirm without a deadline; a quorum queue's channel whose
        # leader died under it has been seen to never confirm (RabbitMQ 3.10). A timer of the
        # connection's own I/O loop (which basic_publish runs while it waits) gives up on it.
        overdue = conn._impl.ioloop.call_later(CONFIRM_DEADLINE, _give_up)
        try:
            ch.basic_publish("", queue, _body(seq, 0), _persistent())
        except _ConfirmOverdue:
            give_ups += 1
            _log(f"publish {seq}: no confirm after {CONFIRM_DEADLINE:.0f}s; reconnecting")
            conn, ch, reconnects = _reconnect(conn, survivors, reconnects)
            continue
        except pika.exceptions.NackError:
            # Refused. A channel that saw the leader die can keep refusing after the election
            # (RabbitMQ 3.10, seen here for minutes): resend on a fresh one.
            nacks += 1
            conn, ch, reconnects = _reconnect(conn, survivors, reconnects)
            continue
        except pika.exceptions.AMQPError as exc:
            # The node went away: reconnect to a survivor, resend this number.
            _log(f"publish {seq}: {type(exc).__name__}; reconnecting")
            conn, ch, reconnects = _reconnect(conn, survivors, reconnects)
            continue
        conn._impl.ioloop.remove_timeout(overdue)
        confirmed.add(seq)
        if t_kill and not t_resume:
            t_resume = time.monotonic()
        seq += 1
    with contextlib.suppress(Exception):
        conn.close()
    received = _drain(survivors[0], queue, deadline)
    distinct = set(received)
    return {
        "messages": count,
        "confirmed": len(confirmed),
        "received": len(received),
        "lost": len(confirmed - distinct),
        "duplicated": len(received) - len(distinct),
        "recover_ms": round(1000 * (t_resume - t_kill), 1),
        "killed": victim.name,
        "reconnects": reconnects,
        "nacks": nacks,
        "confirm_timeouts": give_ups,
    }


class _ConfirmOverdue(Exception):
    """Raised by the confirm timer inside ``basic_publish``: it waited too long."""


def _give_up() -> None:
    raise _ConfirmOverdue


def _reconnect(conn: Any, survivors: list[RabbitNode], reconnects: int) -> tuple[Any, Any, int]:
    """Drop ``conn``; a new confirming channel on the next survivor (or, if that one refuses,
    the dead ``conn`` again: the next publish fails and comes back here). Returns the
    connection, its channel and the reconnection count."""
    import pika

    with contextlib.suppress(Exception):
        conn.close()
    target = survivors[reconnects % len(survivors)]
    try:
        conn = pika.BlockingConnection(_pika_params(target.amqp))
        ch = conn.channel()
        ch.confirm_delivery()
    except pika.exceptions.AMQPError:
        return conn, None, reconnects + 1
    return conn, ch, reconnects + 1


def _drain(node: RabbitNode, queue: str, deadline: float) -> list[int]:
    """Every sequence number in ``queue`` (consumed and acked), in delivery order.

    An end marker, published with a confirm after the stream, closes it: the queue is FIFO, so
    whatever it still holds of the stream comes before the marker (a message count read from
    the queue is no such bound while it settles after a leader change)."""
    import pika

    conn = pika.BlockingConnection(_pika_params(node.amqp))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", queue, END, _persistent())
        ch.basic_qos(prefetch_count=500)
        seqs: list[int] = []
        for method, _props, body in ch.consume(queue, inactivity_timeout=0.5):
            if method is not None:
                ch.basic_ack(method.delivery_tag)
                if body == END:
                    break
                seqs.append(_seq(body))
            if time.monotonic() > deadline:
                raise TimeoutError(f"rabbitmq drain: {len(seqs)} read, no end marker by then")
        ch.cancel()
        ch.queue_delete(queue)
        return seqs
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _log(message: str) -> None:
    print(f"perf safety: {message}", file=sys.stderr, flush=True)


# Result -------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _summary(
    args: argparse.Namespace, ours: dict[int, dict[str, Any]], theirs: dict[str, Any]
) -> dict[str, Any]:
    plain, replica = ours[0], ours[1]
    pp_ratio = _ratio(replica["pingpong_ms"]["p50"], plain["pingpong_ms"]["p50"])
    st_ratio = _ratio(replica["stream_msgs_per_s"], plain["stream_msgs_per_s"])
    vs_quorum = _ratio(replica["pingpong_ms"]["p50"], theirs["pingpong_ms"]["p50"])
    # What one mirror costs a durable ping-pong with no bus at all, on this machine in this run:
    # the physical part of the replica's price (a network hop, a second sync on the same disk).
    floor_ratio = _ratio(replica["floor_pingpong_ms"]["p50"], plain["floor_pingpong_ms"]["p50"])
    return {
        "config": str(args.config),
        "rounds": args.rounds,
        "count": args.count,
        "kill_count": args.kill_count,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "aaabus": plain,
        "aaabus_replica": replica,
        "rabbitmq_quorum": theirs,
        # A replica taking over a killed primary is ``perf failover --peers``'s to measure,
        # under its checked traffic: no kill here, no figure; never a made-up one.
        "aaabus_failover": None,
        "ratios": {
            "pingpong_p50_replica_vs_without": pp_ratio,
            "stream_replica_vs_without": st_ratio,
            "pingpong_p50_replica_vs_rabbitmq_quorum": vs_quorum,
            "floor_p50_mirrored_vs_plain": floor_ratio,
            "pingpong_p50_vs_floor": _ratio(
                plain["pingpong_ms"]["p50"], plain["floor_pingpong_ms"]["p50"]
            ),
            "pingpong_p50_replica_vs_mirrored_floor": _ratio(
                replica["pingpong_ms"]["p50"], replica["floor_pingpong_ms"]["p50"]
            ),
        },
        "lost": {
            "rabbitmq_quorum_stream": theirs["stream_lost"],
            "rabbitmq_quorum_kill": theirs["kill"]["lost"],
            "aaabus_failover": None,
        },
        "acceptance": {
            "pingpong_replica_le_1_5x": None if pp_ratio is None else pp_ratio <= 1.5,
            "stream_replica_ge_0_7x": None if st_ratio is None else st_ratio >= 0.7,
            "pingpong_le_0_8x_quorum": None if vs_quorum is None else vs_quorum <= 0.8,
            "nothing_lost_where_they_lose_nothing": None,  # needs aaabus_failover
        },
    }


def _print_table(r: dict[str, Any]) -> None:
    rows = [
        ("aaabus, no replica", r["aaabus"]),
        ("aaabus, 1 sync replica", r["aaabus_replica"]),
        ("RabbitMQ quorum, 3 nodes", r["rabbitmq_quorum"]),
    ]
    print(f"{'system':26} {'pp p50 ms':>10} {'pp p99 ms':>10} {'stream msg/s':>13}")
    for name, row in rows:
        pp = row["pingpong_ms"]
        print(f"{name:26} {pp['p50']:10.3f} {pp['p99']:10.3f} {row['stream_msgs_per_s']:13.0f}")
    kill = r["rabbitmq_quorum"]["kill"]
    print(
        f"RabbitMQ leader {kill['killed']} SIGKILLed mid-stream: recovered in "
        f"{kill['recover_ms']:.0f} ms, {kill['lost']} lost, {kill['duplicated']} duplicated "
        f"of {kill['confirmed']} confirmed; aaabus failover: see perf failover --peers"
    )
    print("ratios: " + ", ".join(f"{k} {v}" for k, v in r["ratios"].items()))
    print(f"load average: {r['loadavg']}")
