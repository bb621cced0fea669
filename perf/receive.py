"""``python -m perf receive``: the link protocol's cost per received message, alone.

No server, no socket, no disk: a sender's :class:`~aaabus.core.protocol.LinkProtocol` stamps
``count`` messages to one receiver in events (reactions) of ``burst`` siblings each; the
receiver's protocol takes the frames in order and its ZODB transaction (an in-memory
``MappingStorage``, so that no sync hides the CPU) commits every ``group`` frames, as a group
commit would. What is timed is the receiver's ``receive`` (decode, clock test, gathering or
hold-back, merge) plus those commits: the part of a receiving server's CPU per message that the
protocol's design decides (a burst's siblings are gathered in memory; before that design each
went through the persistent held-back set, and a burst cost more per message than single
messages did).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any

import transaction
import ZODB
from BTrees.OOBTree import OOBTree
from ZODB.MappingStorage import MappingStorage

from aaabus.core.clock import DomainClock
from aaabus.core.protocol import Deliver, LinkProtocol
from aaabus.core.store import PersistentQueue
from aaabus.model.ids import AgentId
from aaabus.wire.message import Message

DOMAIN = "D"


def _side(me: int) -> tuple[LinkProtocol, Any]:
    db = ZODB.DB(MappingStorage())
    tm = transaction.TransactionManager()
    root = db.open(transaction_manager=tm).root()
    root["clock"], root["wait"], root["out"] = DomainClock(2, me), OOBTree(), PersistentQueue()
    proto = LinkProtocol(
        me, {DOMAIN: (0, 1)}, {DOMAIN: root["clock"]}, {DOMAIN: root["wait"]},
        {(1 - me, DOMAIN): root["out"]},
    )  # fmt: skip
    tm.commit()
    return proto, tm


def measure(count: int, burst: int, group: int) -> float:
    """Microseconds of receiver CPU per message (``time.process_time``, one thread)."""
    sender, sender_tm = _side(0)
    receiver, tm = _side(1)
    body = pickle.dumps(("item", 0))
    frames: list[bytes] = []
    for _ in range(count // burst):
        sends = [(1, DOMAIN, Message(AgentId(0, 0, 16), AgentId(1, 1, 16), body))] * burst
        frames += [frame for _peer, frame in sender.stamp_event(sends)]
        sender._qout[1, DOMAIN].clear()  # acknowledged at once: the sender is not measured
        sender_tm.commit()
    delivered = 0
    start = time.process_time()
    for i, frame in enumerate(frames, 1):
        for event in receiver.receive(0, frame):
            if isinstance(event, Deliver):
                delivered += 1
        if i % group == 0:
            tm.commit()
    tm.commit()
    elapsed = time.process_time() - start
    if delivered != len(frames):
        raise RuntimeError(f"delivered {delivered} of {len(frames)} messages")
    return elapsed / len(frames) * 1e6


def measure_bursts(count: int, bursts: list[int], group: int, repeat: int) -> dict[str, Any]:
    """Per burst size, the median over ``repeat`` runs (the sizes interleaved)."""
    runs: dict[int, list[float]] = {burst: [] for burst in bursts}
    for _ in range(repeat):
        for burst in bursts:
            runs[burst].append(measure(count, burst, group))
    return {
        "count": count,
        "group": group,
        "repeat": repeat,
        "us_per_msg": {str(b): round(statistics.median(v), 2) for b, v in runs.items()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=20_000, help="messages per run")
    parser.add_argument(
        "--bursts", default="1,10,100,200", help="comma-separated siblings per event"
    )
    parser.add_argument("--group", type=int, default=64, help="frames per commit")
    parser.add_argument("--repeat", type=int, default=3, help="runs per burst size (medians)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def run(args: argparse.Namespace) -> int:
    try:
        bursts = [int(b) for b in args.bursts.split(",")]
    except ValueError:
        raise SystemExit(
            f"perf receive: error: --bursts takes integers, got {args.bursts!r}"
        ) from None
    if args.count < 1 or args.group < 1 or args.repeat < 1 or not all(b >= 1 for b in bursts):
        raise SystemExit("perf receive: error: --count, --group, --repeat and bursts must be >= 1")
    result = measure_bursts(args.count, bursts, args.group, args.repeat)
    if not args.json:
        for burst, us in result["us_per_msg"].items():
            print(f"events of {burst:>4} message(s): {us:6.2f} µs per message received")
    print(json.dumps(result))
    return 0
