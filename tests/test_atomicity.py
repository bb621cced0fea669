"""A reaction is all or nothing, whatever fails inside it: regressions of creations whose
``on_init`` sends and then raises (two servers in one process, real stores on disk)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import (
    AgentDeleteAck,
    AgentDeleteRequest,
    AgentId,
    AgentServer,
    ExceptionNotification,
    UnknownAgent,
)
from aaabus.config.reader import load_config
from aaabus.node.inprocess import InProcessBus
from tests.support.agents import (
    Deployer,
    Go,
    InitSender,
    Leaving,
    Marker,
    Poke,
    Probe,
    Recorder,
    Seen,
)
from tests.support.harness import Inbox


@pytest.fixture
def two_servers(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[InProcessBus]:
    # A long group bound: the deployer's reaction and the factory's must share one group.
    config = load_config(make_config("flat", 2, properties={"aaabus.engine.max_group_ms": "2000"}))
    with InProcessBus(config, store_kind="file", storage_root=tmp_path) as bus:
        yield bus


def _labels(inbox: Inbox, count: int) -> list[str]:
    labels = []
    for _ in range(count):
        note = inbox.get()
        assert isinstance(note, Seen) and isinstance(note.note, Marker), note
        labels.append(note.note.label)
    return labels


def _setup(bus: InProcessBus) -> tuple[AgentId, Inbox]:
    inbox = Inbox()
    bus[1].add_listener(inbox)
    recorder = bus[1].deploy(Recorder())
    deployer = bus[0].deploy(Deployer(recorder))
    # A first message through: the link is up, so that frames leave right after their commit
    # (a link coming up later sends only what the store kept, which would hide a phantom).
    bus[0].send(deployer, Marker("warm-up"))
    assert _labels(inbox, 1) == ["warm-up"]
    return deployer, inbox


def test_failed_creation_sends_no_phantom_and_loses_nothing_after(
    two_servers: InProcessBus,
) -> None:
    """A remote send staged earlier in the group, then a creation whose on_init sends and
    raises: the creation's send must vanish, and the next send must not reuse its number."""
    bus = two_servers
    deployer, inbox = _setup(bus)
    bus[0].send(deployer, Go(before="before"))
    bus[0].send(deployer, Marker("after"))
    labels = _labels(inbox, 3)
    failed = [label for label in labels if label.startswith("create failed")]
    assert failed == ["create failed: RuntimeError: on_init failed after sending"]
    # The failed creation's reply and "after" are independent: either may come first.
    assert labels[0] == "before" and sorted(labels[1:]) == sorted([failed[0], "after"])
    _assert_counts_match(bus)


def test_failed_creation_alone_in_a_group_leaves_the_channel_sending(
    two_servers: InProcessBus,
) -> None:
    """The creation's send is the first remote send of its group: rolling it back must not
    leave the channel believing that a flush is scheduled, or it never sends again."""
    bus = two_servers
    deployer, inbox = _setup(bus)
    bus[0].send(deployer, Go())
    bus[0].send(deployer, Marker("after"))
    labels = _labels(inbox, 2)
    failed = [label for label in labels if label.startswith("create failed: RuntimeError")]
    assert len(failed) == 1 and sorted(labels) == sorted([failed[0], "after"])
    _assert_counts_match(bus)


def test_on_init_of_a_rolled_back_reaction_runs_again(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """on_init(False) sends, the reaction around it fails once without touching the agent:
    the replay must run on_init again, or what it sent is lost with the rollback."""
    config = load_config(make_config("flat", 2))
    with InProcessBus(config, store_kind="file", storage_root=tmp_path) as bus:
        inbox = Inbox()
        bus[1].add_listener(inbox)
        sender = bus[0].deploy(InitSender(bus[1].deploy(Recorder())))
        bus[0].send(sender, Marker("first"))
        assert _labels(inbox, 1) == ["first"]
    with InProcessBus(config, store_kind="file", storage_root=tmp_path) as bus:
        inbox = Inbox()
        bus[1].add_listener(inbox)
        engine = bus[0].engine
        assert engine is not None
        engine.failpoints.arm("engine.reacted")  # once: the group is replayed
        bus[0].send(sender, Marker("second"))
        assert _labels(inbox, 2) == ["init", "second"]
        assert engine.failpoints.fired("engine.reacted") == 1
        _assert_counts_match(bus)


def test_deploy_from_outside_survives_a_replayed_group(two_servers: InProcessBus) -> None:
    """The caller's agent object learns its id inside the group: if the group is replayed,
    the deployment must run again rather than find the object 'already deployed'."""
    bus = two_servers
    inbox = Inbox()
    bus[1].add_listener(inbox)
    engine = bus[0].engine
    assert engine is not None
    engine.failpoints.arm("engine.commit")
    recorder = bus[1].deploy(Recorder())
    deployer = bus[0].deploy(Deployer(recorder))  # its first commit fails: replayed
    assert engine.failpoints.fired("engine.commit") == 1
    bus[0].send(deployer, Marker("works"))
    assert _labels(inbox, 1) == ["works"]


def test_a_failing_on_delete_keeps_the_agent_and_reports_to_the_sender(
    two_servers: InProcessBus, caplog: pytest.LogCaptureFixture
) -> None:
    """on_delete sends, then raises: the deletion and the send vanish, the requester gets an
    exception notification, the log has one line naming the agent; a later delete works."""
    bus = two_servers
    inbox = Inbox()
    bus[0].add_listener(inbox)
    probe = bus[0].deploy(Probe())
    leaving = bus[1].deploy(Leaving(probe))

    def received() -> object:
        seen = inbox.get()
        assert isinstance(seen, Seen) and seen.by == probe, seen
        return seen.note

    with caplog.at_level(logging.WARNING, logger="aaabus"):
        bus[0].send(probe, Poke(leaving, AgentDeleteRequest()))
        report = received()
    assert isinstance(report, ExceptionNotification), report
    assert report.target == leaving and report.error_type == "RuntimeError"
    assert report.error_message == "not leaving"
    lines = [r.getMessage() for r in caplog.records if str(leaving) in r.getMessage()]
    assert len(lines) == 1 and "RuntimeError: not leaving" in lines[0], lines
    # Still there, and the rolled-back goodbye was never delivered.
    bus[0].send(probe, Poke(leaving, Marker("comply")))
    bus[0].send(probe, Poke(leaving, AgentDeleteRequest()))
    goodbye, ack = received(), received()
    assert goodbye == Marker("goodbye") and ack == AgentDeleteAck(leaving)
    bus[0].send(probe, Poke(leaving, Marker("anyone?")))
    gone = received()
    assert isinstance(gone, UnknownAgent) and gone.target == leaving
    _assert_counts_match(bus)


def _assert_counts_match(bus: InProcessBus) -> None:
    """Once idle, every committed send was delivered once: the sums agree on both sides."""

    def counts(server: AgentServer) -> tuple[int, int]:
        engine = server.engine
        assert engine is not None
        return engine.stats.sent, engine.stats.reactions

    totals = [server.call(functools.partial(counts, server)) for server in bus.servers.values()]
    sent = sum(t[0] for t in totals)
    delivered = sum(t[1] for t in totals)
    assert sent == delivered, (sent, delivered)
