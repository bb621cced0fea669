"""Topics between real server processes: outside consumers, durability, restarts, the shell."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from aaabus import Client, Publication, ServerUnreachable, UnknownAgent
from aaabus.model.ids import AgentId
from aaabus.testing.topicload import (
    CausalPeer,
    Do,
    History,
    Received,
    Start,
    Tell,
    Told,
    TopicProbe,
    check_topics,
    expected_deliveries,
)
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, aaabus_cli
from tests.support.topics import wait_until

# Real server processes, subprocesses: not in the fast lane (make check).
pytestmark = pytest.mark.slow

# Two domains joined by router 1: D0 = {0, 1}, D1 = {1, 2}.
LINE = [[0, 1], [1, 2]]


def knows_filters(config: Path, server: int, count: int) -> bool:
    """Whether ``server``'s representative knows ``count`` filters of other servers."""
    with Client(config, server) as client:
        return int(client.status()["topics"]["remote_filters"]) >= count


def knows(config: Path, server: int, subscriptions: int) -> bool:
    """Whether ``server`` knows ``subscriptions`` (filter, other server) pairs."""
    with Client(config, server) as client:
        return int(client.status()["topics"]["remote_subscriptions"]) == subscriptions


def test_client_subscription_is_exact_across_ten_sigkills_of_its_server(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config(layout=LINE)
    total = 400
    rng = random.Random(15)
    got: list[object] = []
    with Bus(config, [0, 1, 2], tmp_path / "store", cwd=REPO_ROOT) as bus:
        consumer = Client(config, 2, timeout=60)
        subscription = consumer.subscribe("load/#", name="exact")
        wait_until("s0 knows the filter", lambda: knows_filters(config, 0, 1))
        published = threading.Event()

        def publish() -> None:
            with Client(config, 0) as producer:
                for i in range(total):
                    producer.publish(f"load/{i % 7}", i)
            published.set()

        producer = threading.Thread(target=publish, name="test-publisher", daemon=True)
        producer.start()
        kills = 0
        try:
            while len(got) < total:
                if kills < 10 and len(got) >= kills * total // 12:
                    bus[2].kill()  # between two fetches, or in the middle of one
                    kills += 1
                    bus[2].start().wait_ready(30)
                try:
                    publication = subscription.get(timeout=rng.uniform(0.01, 0.2))
                except ServerUnreachable:
                    continue  # resumes where it stopped: the next get asks for what follows
                if publication is not None:
                    got.append(publication.payload)
            subscription.ack()
        finally:
            consumer.close()
        producer.join(60)
    assert published.is_set()
    assert kills == 10
    # One publisher: its publications arrive in order; exactly once each.
    assert got == list(range(total))


def test_agent_subscription_outlives_a_restart_of_the_subscribers_server(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config(layout=LINE)
    with Bus(config, [0, 1, 2], tmp_path / "store", cwd=REPO_ROOT) as bus:
        with Client(config, 2) as client:
            probe = client.deploy(TopicProbe("probe", ["news/+"]), server=2)
        wait_until("s0 knows the filter", lambda: knows_filters(config, 0, 1))
        bus[2].kill()
        with Client(config, 0) as client:  # published while the subscriber's server is down
            for i in range(3):
                client.publish(f"news/{i}", f"item {i}")
        bus[2].start().wait_ready(30)
        with Client(config, 0) as client:
            client.publish("news/late", "after the restart")

            def report() -> list[tuple[str, Any, tuple[str, ...], bool]] | None:
                reply = client.request(probe, Do("report", ""), timeout=10)
                assert isinstance(reply, Received)
                return reply.items if len(reply.items) >= 4 else None

            items = wait_until("probe received all four", report)
    assert [(topic, payload) for topic, payload, _f, _r in items] == [
        ("news/0", "item 0"),
        ("news/1", "item 1"),
        ("news/2", "item 2"),
        ("news/late", "after the restart"),
    ]


def test_request_returns_the_reply_or_the_bus_error(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config(layout=LINE)
    with Bus(config, [0, 1, 2], tmp_path / "store", cwd=REPO_ROOT), Client(config, 0) as client:
        probe = client.deploy(TopicProbe("probe"), server=2)
        reply = client.request(probe, Do("report", ""), timeout=20)
        assert reply == Received([])
        missing = AgentId(2, 2, 999)
        error = client.request(missing, Do("report", ""), timeout=20)
        assert isinstance(error, UnknownAgent) and error.target == missing
        # The reply mailboxes are gone once the requests returned.
        wait_until("mailboxes closed", lambda: client.status()["topics"]["mailboxes"] == 0)


def test_boot_declaration_and_shell_commands_with_a_named_subscription_that_resumes(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    declare = (
        '<service class="aaabus.topics.declare:declare" '
        """args='{"retain": {"cfg/mode": "eco"}, "mailboxes": {"audit": "cfg/#"}}'/>"""
    )
    config = make_config(layout=LINE, extra={2: declare})
    with Bus(config, [0, 1, 2], tmp_path / "store", cwd=REPO_ROOT):
        wait_until("s0 knows the filter", lambda: knows_filters(config, 0, 1))
        for i in range(3):
            run = aaabus_cli("publish", str(config), f"cfg/{i}", f"text {i}", "--via", "0")
            assert run.returncode == 0, run.stderr
        first = aaabus_cli(
            "subscribe", str(config), "cfg/#", "--via", "2", "--name", "audit", "--count", "2"
        )
        assert first.returncode == 0, first.stderr
        # The declared mailbox got the retained value at boot, then the publications.
        assert first.stdout.splitlines() == ["eco", "text 0"]
        again = aaabus_cli(
            "subscribe", str(config), "cfg/#", "--via", "2", "--name", "audit", "--count", "2"
        )
        assert again.stdout.splitlines() == ["text 1", "text 2"], again.stderr
        other = aaabus_cli("subscribe", str(config), "x/#", "--via", "2", "--name", "audit")
        assert other.returncode == 2
        assert other.stderr.strip().count("\n") == 0
        assert "exists with filter 'cfg/#'" in other.stderr
        with Client(config, 2) as client:
            client.unsubscribe("audit")
            wait_until("deleted", lambda: client.status()["topics"]["mailboxes"] == 0)
        bad = aaabus_cli("subscribe", str(config), "cfg/#/x", "--via", "2")
        assert bad.returncode == 2
        assert bad.stderr.strip() == (
            "aaabus subscribe: error: topic filter 'cfg/#/x': "
            "# must be the last level (e.g. site/#)"
        )


def test_an_unnamed_subscription_is_deleted_when_closed_and_payloads_are_publications(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config(layout=[[0, 1]])
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT), Client(config, 1) as client:
        with client.subscribe("a/+") as subscription:
            wait_until("s0 knows the filter", lambda: knows_filters(config, 0, 1))
            with Client(config, 0) as producer:
                producer.publish("a/b", b"bytes too")
            publication = next(subscription)
            assert isinstance(publication, Publication)
            assert (publication.topic, publication.payload) == ("a/b", b"bytes too")
            assert publication.publisher == AgentId.server_of(0)
        wait_until("mailbox deleted", lambda: client.status()["topics"]["mailboxes"] == 0)


# A tree of two-server domains (see tests/test_topics_causal.py for why two).
TREE_OF_PAIRS = [[0, 1], [1, 2], [1, 3]]


def test_causal_contract_between_server_processes_over_a_tree_of_domains(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config(layout=TREE_OF_PAIRS)
    rng = random.Random(42)
    topics = ["t/a", "t/b", "u/c", "v"]
    choices = ["t/#", "t/+", "+/c", "u/#", "#", "v"]
    filters: dict[int, set[str]] = {}
    with Bus(config, range(4), tmp_path / "store", cwd=REPO_ROOT), Client(config, 0) as client:
        peers = []
        for sid in range(4):
            for k in range(2):
                mine = rng.sample(choices, 2)
                filters.setdefault(sid, set()).update(mine)
                peer = CausalPeer(f"p{sid}.{k}", 42, mine, topics, 0.5)
                peers.append(client.deploy(peer, server=sid))
        for sid in range(4):
            owed = sum(len(fs) for other, fs in filters.items() if other != sid)
            wait_until(f"s{sid} knows every subscription", partial(knows, config, sid, owed))
        for peer_id in peers:
            client.send(peer_id, Start(3, 2))

        def histories() -> list[History] | None:
            told = [client.request(p, Tell(), timeout=20) for p in peers]
            hs = [t.history for t in told if isinstance(t, Told)]
            started = all(len(h[2]) >= 3 for h in hs)
            done = sum(len(h[3]) for h in hs) == expected_deliveries(hs)
            return hs if started and done else None

        hs = wait_until("every owed delivery made", histories, timeout=60)
    assert sum(len(h[3]) for h in hs) > 30, "the workload is too small to mean anything"
    bad = check_topics(hs)
    assert not bad, "\n".join(f"{who}: {report.summary()}" for who, report in bad.items())
