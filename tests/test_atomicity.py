"""A reaction is all or nothing, whatever fails inside it: regressions of creations whose
``on_init`` sends and then raises (two servers in one process, real stores on disk)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import AgentId
from aaabus.config import load_config
from aaabus.inprocess import InProcessBus
from tests.conftest import Inbox
from tests.support.agents import Deployer, Go, InitSender, Marker, Recorder, Seen


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


def test_failed_creation_sends_no_phantom_and_loses_nothing_after(two_servers) -> None:
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


def test_failed_creation_alone_in_a_group_leaves_the_channel_sending(two_servers) -> None:
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


def test_deploy_from_outside_survives_a_replayed_group(two_servers) -> None:
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


def _assert_counts_match(bus: InProcessBus) -> None:
    """Once idle, every committed send was delivered once: the sums agree on both sides."""
    sent = sum(server.call(lambda s=server: s.engine.stats.sent) for server in bus.servers.values())
    delivered = sum(
        server.call(lambda s=server: s.engine.stats.reactions) for server in bus.servers.values()
    )
    assert sent == delivered, (sent, delivered)
