"""``python -m perf match``: what matching costs the topic representative as its tables grow.

A topic representative (``aaabus.topics.representative``) finds the subscriptions of a
publication, and the retained copies of a new subscription, in tries of topic levels
(``aaabus.topics.trie``): the cost should follow the topic's depth, not the number of filters or
retained topics held. This suite checks it on the real code path.

For each size N (``--sizes``, default 10 and 10,000) it builds, in a real file store
(``open_store("file")``, records vetted by the trust policy), a representative of server 0 with:

* N local subscriptions, one agent each, a mix of ``site/<i>/+/temp``, ``site/<i>/#`` and
  ``fleet/<i>/status``;
* the same N filters announced by server 1 (its neighbour), as remote interest;
* N retained topics, a mix of ``site/<i>/hall/temp`` and ``fleet/<i>/status``;

closes the store and opens it again (the representative is loaded from its records, as after a
restart), then times, with the sizes interleaved in ``--repeat`` rounds:

* ``publish``: one reaction of the representative to a ``Publish`` on ``site/<k>/hall/temp``,
  which exactly one local filter and one remote filter select: one delivery, one relay;
* ``subscribe``: one reaction to a ``Subscribe`` to ``+/<k>/status``, a filter new to the
  representative that exactly one retained topic matches: the filter entered in the tables
  and the trie, its announcement relayed, one retained copy sent. The ``Unsubscribe`` that
  follows each one (untimed) takes it back out.

Each reaction is timed alone (median over every one); its sends are recorded, not sent. Beside
them, the trie lookups alone (``match`` of both filter tries, ``matching`` of the retained one)
and what scanning the tables with ``aaabus.model.topicnames.matches`` costs, the way the
representative matched before the tries.

Prints a table, then one JSON line (``--json``: only that line): ``publish_us`` and
``subscribe_us`` by size, ``publish_ratio`` and ``subscribe_ratio`` (largest size over
smallest), the lookups and scans by size, and ``ok``: both ratios at most 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aaabus.config.trust import TrustPolicy
from aaabus.core.store import open_store
from aaabus.model.context import running
from aaabus.model.ids import TOPICS_STAMP, AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication, Publish, Subscribe, Unsubscribe
from aaabus.model.topicnames import matches
from aaabus.testing.context import RecordingContext
from aaabus.topics.messages import InterestChange, Relay
from aaabus.topics.representative import TopicRepresentative
from perf.harness import scratch

#: The ratio of the largest size's cost to the smallest's that the suite accepts.
ACCEPTED_RATIO = 2.0

#: Reactions per commit while building: a server commits every reaction, which would make
#: building 10,000 filters take minutes for nothing the measurement depends on.
BUILD_BATCH = 1000

ME = AgentId.topics_of(0)
PUBLISHER = AgentId(0, 0, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument(
        "--sizes", default="10,10000", help="comma-separated numbers of filters (and retained)"
    )
    parser.add_argument("--publications", type=int, default=2000, help="timed per size and round")
    parser.add_argument("--subscriptions", type=int, default=300, help="timed per size and round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, sizes interleaved")
    parser.add_argument("--workdir", help="keep the stores here (default: a temporary dir)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _filter(i: int) -> str:
    return ("site/{i}/+/temp", "site/{i}/#", "fleet/{i}/status")[i % 3].format(i=i)


def _retained_topic(i: int) -> str:
    return ("site/{i}/hall/temp", "fleet/{i}/status")[i % 2].format(i=i)


class Bench:
    """One size: the store, its representative, and the publication and subscription timed.

    The key ``k``, near the middle, is odd and a multiple of 3: ``site/<k>/hall/temp`` is then
    selected by ``site/<k>/+/temp`` alone and ``+/<k>/status`` selects ``fleet/<k>/status``
    alone (``size`` at least 4)."""

    def __init__(self, directory: Path, size: int) -> None:
        self.directory = directory
        self.size = size
        self.k = 6 * (size // 12) + 3
        self.topic = f"site/{self.k}/hall/temp"
        self.topic_filter = f"+/{self.k}/status"
        self.subscriber = AgentId(0, 0, 17)
        self.ctx = RecordingContext(ME)
        self._build()
        self.store = open_store("file", directory, 0, TrustPolicy())
        rep = self.store.agents[(0, TOPICS_STAMP)]
        assert isinstance(rep, TopicRepresentative)
        self.rep = rep
        self._check()

    def _build(self) -> None:
        store = open_store("file", self.directory, 0, TrustPolicy())
        try:
            rep = TopicRepresentative({1: 1}, backlog=10)
            rep._aaabus_id = ME
            store.agents[(0, TOPICS_STAMP)] = rep
            notes: list[tuple[AgentId, Notification]] = []
            for i in range(self.size):
                notes.append((AgentId(0, 0, 1000 + i), Subscribe(_filter(i))))
                notes.append((PUBLISHER, Publish(_retained_topic(i), {"v": i}, retain=True)))
            filters = tuple(_filter(i) for i in range(self.size))
            relay = Relay((0,), InterestChange(1, filters, add=True))
            notes.append((AgentId.topics_of(1), relay))
            with running(self.ctx):
                for done, (sender, note) in enumerate(notes, 1):
                    rep.react(sender, note)
                    if done % BUILD_BATCH == 0:
                        store.commit()
                        self.ctx.sent.clear()
            store.commit()
        finally:
            store.close()

    def _check(self) -> None:
        """The publication and the subscription timed each select exactly one key."""
        self.ctx.sent.clear()
        with running(self.ctx):
            self.rep.react(PUBLISHER, Publish(self.topic, 0))
        sent = [(to, type(note).__name__) for to, note in self.ctx.sent]
        want = [(AgentId(0, 0, 1000 + self.k), "Publication"), (AgentId.topics_of(1), "Relay")]
        assert sent == want, sent
        self.ctx.sent.clear()
        with running(self.ctx):
            self.rep.react(self.subscriber, Subscribe(self.topic_filter))
            self.rep.react(self.subscriber, Unsubscribe(self.topic_filter))
        copies = [n for _, n in self.ctx.sent if isinstance(n, Publication)]
        assert [n.topic for n in copies] == [f"fleet/{self.k}/status"], copies
        self.store.abort()

    def publish(self, count: int) -> list[int]:
        """Nanoseconds of ``count`` reactions to the publication, each timed alone."""
        rep, sent, note = self.rep, self.ctx.sent, Publish(self.topic, 0)
        times = []
        with running(self.ctx):
            for _ in range(count):
                start = time.perf_counter_ns()
                rep.react(PUBLISHER, note)
                times.append(time.perf_counter_ns() - start)
                sent.clear()
        return times

    def subscribe(self, count: int) -> list[int]:
        """Nanoseconds of ``count`` reactions to the subscription, each timed alone (each is
        taken back by an untimed unsubscription; the round's changes are aborted after)."""
        rep, sent, subscriber = self.rep, self.ctx.sent, self.subscriber
        on, off = Subscribe(self.topic_filter), Unsubscribe(self.topic_filter)
        times = []
        with running(self.ctx):
            for _ in range(count):
                start = time.perf_counter_ns()
                rep.react(subscriber, on)
                times.append(time.perf_counter_ns() - start)
                rep.react(subscriber, off)
                sent.clear()
        self.store.abort()
        return times

    def lookups(self, count: int) -> dict[str, float]:
        """Median µs of the trie lookups alone, and of the scans the representative did
        before them (``matches`` over every filter, or every retained topic)."""
        rep, topic, topic_filter = self.rep, self.topic, self.topic_filter

        def match() -> object:
            return rep.local_trie.match(topic), rep.remote_trie.match(topic)

        def scan() -> object:
            local = [f for f in rep.local if matches(f, topic)]
            return local, [f for f in rep.remote if matches(f, topic)]

        def retained_scan() -> object:
            return [t for t in rep.retained if matches(topic_filter, t)]

        scans = max(1, count // max(1, self.size // 100))  # a scan of 10,000 is slow: fewer
        return {
            "match_us": _median_us(match, count),
            "scan_us": _median_us(scan, scans),
            "matching_us": _median_us(lambda: rep.retained_trie.matching(topic_filter), count),
            "retained_scan_us": _median_us(retained_scan, scans),
        }

    def close(self) -> None:
        self.store.close()


def _median_us(call: Callable[[], object], count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def run(args: argparse.Namespace) -> int:
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < 4:
        raise SystemExit("perf match: error: --sizes takes at least two sizes, each at least 4")
    with scratch(args.workdir) as work:
        benches = [Bench(work / f"n{size}", size) for size in sizes]
        try:
            publish: dict[int, list[int]] = {size: [] for size in sizes}
            subscribe: dict[int, list[int]] = {size: [] for size in sizes}
            for _ in range(args.repeat):
                for bench in benches:
                    publish[bench.size] += bench.publish(args.publications)
                    subscribe[bench.size] += bench.subscribe(args.subscriptions)
            lookups = {bench.size: bench.lookups(args.publications) for bench in benches}
        finally:
            for bench in benches:
                bench.close()
    publish_us = {size: statistics.median(publish[size]) / 1000 for size in sizes}
    subscribe_us = {size: statistics.median(subscribe[size]) / 1000 for size in sizes}
    small, large = sizes[0], sizes[-1]
    result: dict[str, Any] = {
        "sizes": sizes,
        "publish_us": {str(s): round(publish_us[s], 2) for s in sizes},
        "subscribe_us": {str(s): round(subscribe_us[s], 2) for s in sizes},
        "publish_ratio": round(publish_us[large] / publish_us[small], 3),
        "subscribe_ratio": round(subscribe_us[large] / subscribe_us[small], 3),
    }
    for name in ("match_us", "matching_us", "scan_us", "retained_scan_us"):
        result[name] = {str(s): round(lookups[s][name], 2) for s in sizes}
    result["accepted_ratio"] = ACCEPTED_RATIO
    result["ok"] = max(result["publish_ratio"], result["subscribe_ratio"]) <= ACCEPTED_RATIO
    if not args.json:
        print("median µs per operation (a reaction of the representative, or a lookup alone)")
        print(
            f"{'size':>7} {'publish':>9} {'trie match':>11} {'scan before':>12} "
            f"{'subscribe':>10} {'trie matching':>14} {'scan before':>12}"
        )
        for s in sizes:
            print(
                f"{s:>7} {publish_us[s]:>9.2f} {lookups[s]['match_us']:>11.2f} "
                f"{lookups[s]['scan_us']:>12.2f} {subscribe_us[s]:>10.2f} "
                f"{lookups[s]['matching_us']:>14.2f} {lookups[s]['retained_scan_us']:>12.2f}"
            )
        print(
            f"{large} vs {small}: publish x{result['publish_ratio']}, subscribe "
            f"x{result['subscribe_ratio']} (accepted: at most x{ACCEPTED_RATIO:g})"
        )
    print(json.dumps(result))
    return 0
