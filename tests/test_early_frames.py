"""Early frames (aaabus.core.early): frames leave before their group is durable, marked
tentative, and nothing a receiver commits ever derives from one its sender might lose.

The notice board alone (threads, deadlines), then a real server on a log store fed frames by
hand over real connections from peers the test plays (:class:`~aaabus.testing.fuzz.FakePeer`:
the sender's crash is then a closed socket, at an exact moment), then two real servers whose
frames are watched on their way to the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.reader import load_config
from aaabus.config.secret import load_secret
from aaabus.core.clock import DomainClock
from aaabus.core.early import LATE_FOR_S, EarlyLinks, Incoming
from aaabus.errors import DependencyLost
from aaabus.model.ids import AgentId
from aaabus.node.inprocess import InProcessBus
from aaabus.node.server import AgentServer
from aaabus.testing.fuzz import FakePeer
from aaabus.wire.codec import encode_note
from aaabus.wire.linkframes import (
    DURABLE_FRAME,
    TENTATIVE_FRAME,
    encode_ack,
    encode_data,
    encode_state,
)
from aaabus.wire.message import Message
from tests.support.agents import Inc
from tests.support.topics import wait_until

TIMEOUT = 10.0


# -- the notice board ------------------------------------------------------------------------


class Frame:
    """A stand-in for an engine input, told apart by identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, _engine: Any) -> None:
        raise AssertionError("the board never runs a frame")

    def __repr__(self) -> str:
        return self.name


F1, F2, F3, F4, F5 = (Frame(f"frame {n}") for n in range(1, 6))


class Board:
    """An :class:`EarlyLinks` whose released frames are recorded, as the engine would get them,
    and whose clock (for lateness) is the test's."""

    def __init__(self, **caps: int) -> None:
        self.released: list[list[Any]] = []
        self.now = 1000.0
        self.links = EarlyLinks(self.released.append, clock=lambda: self.now, **caps)


def _read(links: EarlyLinks, peer: int, frames: int, tentative: bool = True) -> Incoming:
    """Read ``frames`` data frames from ``peer`` as the I/O thread does; their connection."""
    conn = links.connection(peer)
    conn.tentative = tentative
    conn.received += frames
    return conn


def _late(links: EarlyLinks, frames: int) -> Incoming:
    """Connection 0, up, with ``frames`` tentative frames read, whose sender a group waited for
    past the budget: it is late."""
    links.up(0)
    conn = _read(links, 0, frames)
    with pytest.raises(DependencyLost, match="did not say within"):
        links.wait({conn: 1}, budget_s=0.01)
    return conn


def _waiter(links: EarlyLinks, deps: dict[Incoming, int], budget_s: float = TIMEOUT) -> Any:
    """Run ``links.wait(deps)`` on a thread, and return once it sleeps; the returned holder
    gets its outcome."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            links.wait(deps, budget_s)
            outcome["result"] = "durable"
        except DependencyLost as exc:
            outcome["result"] = exc

    thread = threading.Thread(target=run, name="waiter")
    thread.start()
    outcome["thread"] = thread
    wait_until("the waiter sleeps", lambda: links.sleeping == 1, TIMEOUT)
    return outcome


def test_a_wait_returns_once_the_notice_vouches_for_every_frame_applied() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 3)
    outcome = _waiter(links, {conn: 3})
    assert "result" not in outcome
    links.durable(conn)  # the DURABLE frame: every frame read before it is durable
    outcome["thread"].join(TIMEOUT)
    assert outcome["result"] == "durable"
    assert links.admit((conn, 3), True, F3, 1) == "apply"


def test_a_notice_vouches_only_for_the_frames_before_it() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 2)
    links.durable(conn)
    _read(links, 0, 1)  # a third frame, of the sender's next group
    outcome = _waiter(links, {conn: 3})
    links.down(0)
    outcome["thread"].join(TIMEOUT)
    assert isinstance(outcome["result"], DependencyLost)
    assert links.admit((conn, 2), True, F2, 1) == "apply"
    assert links.admit((conn, 3), True, F3, 1) == "drop"


def test_a_connection_replaced_before_the_notice_fails_the_wait() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 1)
    outcome = _waiter(links, {conn: 1})
    links.up(0)  # the peer dialled again: the old connection is gone with what it did not vouch
    outcome["thread"].join(TIMEOUT)
    assert isinstance(outcome["result"], DependencyLost)
    assert "closed" in str(outcome["result"])
    assert links.admit((conn, 1), True, F1, 1) == "drop"
    assert links.ups == 2


def test_a_group_depending_on_two_senders_fails_if_either_connection_closes() -> None:
    links = Board().links
    links.up(0)
    links.up(2)
    first, second = _read(links, 0, 1), _read(links, 2, 1)
    outcome = _waiter(links, {first: 1, second: 1})
    links.durable(second)  # server 2 vouches for its frame...
    links.down(0)  # ...server 0 is gone before vouching for its own
    outcome["thread"].join(TIMEOUT)
    assert isinstance(outcome["result"], DependencyLost)
    # The replay keeps server 2's frame and drops server 0's.
    assert links.admit((second, 1), True, F2, 1) == "apply"
    assert links.admit((first, 1), True, F1, 1) == "drop"


def test_a_late_sender_has_its_frames_parked_in_order_until_its_notice() -> None:
    board = Board()
    links = board.links
    conn = _late(links, 1)
    # The replay: the late connection's tentative frame waits apart, and so does every frame
    # read after it, tentative or not, whether already in the engine's inbox or read now.
    assert links.admit((conn, 1), True, F1, 10) == "park"
    _read(links, 0, 1, tentative=False)
    assert links.admit((conn, 2), False, F2, 10) == "park"
    _read(links, 0, 1)
    assert links.hold(conn, F3, 10) is True
    assert board.released == [] and links.parked == 3
    links.durable(conn)
    assert board.released == [[F1, F2, F3]]
    # Handed back, each is applied. The sender stays late for a while: its next tentative
    # frame waits apart too, then, once that while is over, it is trusted again.
    assert links.admit((conn, 1), True, F1, 10) == "apply"
    _read(links, 0, 1)
    assert links.hold(conn, F4, 10) is False
    assert links.admit((conn, 4), True, F4, 10) == "park"
    links.durable(conn)
    board.now += LATE_FOR_S
    _read(links, 0, 1)
    assert links.admit((conn, 5), True, F5, 10) == "apply"


def test_a_frame_offered_again_by_a_replayed_group_is_parked_once() -> None:
    board = Board()
    links = board.links
    conn = _late(links, 2)
    assert links.admit((conn, 1), True, F1, 10) == "park"
    assert links.admit((conn, 2), True, F2, 10) == "park"
    assert links.admit((conn, 1), True, F1, 10) == "park"  # the group aborted and replayed
    links.durable(conn)
    assert board.released == [[F1, F2]] and links.parked == 2


def test_a_connection_closed_hands_its_parked_frames_back_to_be_dropped() -> None:
    board = Board()
    links = board.links
    conn = _late(links, 1)
    assert links.admit((conn, 1), True, F1, 10) == "park"
    links.down(0)
    assert board.released == [[F1]]
    assert links.admit((conn, 1), True, F1, 10) == "drop"


@pytest.mark.parametrize("caps", [{"max_parked_frames": 2}, {"max_parked_bytes": 25}])
def test_parking_past_the_cap_closes_the_connection(caps: dict[str, int]) -> None:
    board = Board(**caps)
    links = board.links
    conn = _late(links, 3)
    assert links.admit((conn, 1), True, F1, 10) == "park"
    assert links.hold(conn, F2, 10) is True
    assert links.admit((conn, 3), True, F3, 10) == "reset"
    assert conn.closed and conn.parked is None
    assert board.released == []  # dropped: the connection is closed, its sender resends


def test_the_spin_sees_a_notice_that_comes_while_it_polls() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 1)
    notice = threading.Timer(0.01, links.durable, (conn,))
    notice.start()
    try:
        links.wait({conn: 1}, TIMEOUT, spin_ns=2_000_000_000)  # polls up to 2 s
    finally:
        notice.join(TIMEOUT)
    assert links.sleeping == 0  # it never had to sleep


def test_a_group_set_aside_on_the_reading_thread_goes_on_once_its_notice_is_read() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 2)
    deadline = time.monotonic() + TIMEOUT
    assert not links.ready({conn: 2}, deadline, TIMEOUT)
    conn.received += 1  # another read, with no notice: still aside
    assert not links.ready({conn: 2}, deadline, TIMEOUT)
    links.durable(conn)
    assert links.ready({conn: 2}, deadline, TIMEOUT)
    assert links.sleeping == 0  # nobody ever slept on the condition


def test_a_group_set_aside_past_its_budget_makes_the_connection_late() -> None:
    board = Board()
    links = board.links
    links.up(0)
    conn = _read(links, 0, 1)
    with pytest.raises(DependencyLost, match="did not say within"):
        links.ready({conn: 1}, time.monotonic(), budget_s=0.01)
    # As after any wait past its budget: its next tentative frames wait apart.
    assert links.admit((conn, 2), True, F1, 10) == "park"


def test_a_group_set_aside_whose_connection_closed_is_replayed() -> None:
    links = Board().links
    links.up(0)
    conn = _read(links, 0, 1)
    links.down(0)
    with pytest.raises(DependencyLost, match="closed before"):
        links.ready({conn: 1}, time.monotonic() + TIMEOUT, TIMEOUT)


# -- a real server fed frames by hand -----------------------------------------------------------

#: Groups run on the engine thread, never inline on the I/O thread: one that waits for a notice
#: then sleeps in the notice board's wait (``links.sleeping``), where the test can see it.
ON_THE_ENGINE_THREAD = {"aaabus.engine.inline": "false"}


@pytest.fixture
def lone_server(make_config: Callable[..., Path], tmp_path: Path) -> Iterator[AgentServer]:
    """Server 1 of a 2-server bus, alone, on a log store; server 0 is played by the test."""
    config = load_config(make_config(servers=2, properties=ON_THE_ENGINE_THREAD))
    with InProcessBus(
        config, server_ids=[1], store_kind="log", storage_root=tmp_path / "stores"
    ) as bus:
        yield bus[1]


def _peer(server: AgentServer, me: int) -> FakePeer:
    """A session to ``server`` in D0 as server ``me`` (a lower id: ``server`` accepts it), on a
    real connection: what it sends reaches the channel by the network's own path."""
    address = ("127.0.0.1", server.config.servers[server.server_id].port_in("D0"))
    secret = load_secret(Path(server.config.path).parent / "bus.key")
    return FakePeer(address, secret, me, server.server_id)


def _frames_from_0(count: int, sender: int = 0, size: int = 2, to: int = 1) -> list[bytes]:
    """Data frames 1..count from ``sender`` (server 0) to server ``to``'s listener (``#s.s.1``),
    one event each, in a domain of ``size`` servers."""
    clock = DomainClock(size, sender)
    frames = []
    for seq in range(1, count + 1):
        stamp = clock.prepare_send(to)
        body = encode_note(Inc(100 * sender + seq))
        message = Message(AgentId(sender, sender, 16), AgentId.server_of(to), body)
        frames.append(encode_data(seq, "D0", stamp, message))
    return frames


def _received_from_0(server: AgentServer) -> int:
    def read() -> int:
        assert server.channel is not None
        return server.channel.clocks["D0"].received_from(0)

    return server.call(read, TIMEOUT)


def _links(server: AgentServer) -> EarlyLinks:
    assert server.channel is not None
    return server.channel.links


def _heard(server: AgentServer) -> list[Any]:
    heard: list[Any] = []
    server.add_listener(lambda _sender, note: heard.append(note))
    return heard


def test_a_peers_link_state_is_compared_before_the_acknowledgements_read_after_it(
    lone_server: AgentServer,
) -> None:
    """A link state says what the peer had delivered when it was taken; an acknowledgement it
    sends after it may cover more (it delivered more since). Acknowledgements are lazy work, which
    a group runs before its other inputs: compared after them, the state made this server name a
    peer that lost nothing ("server 0's store is older than server 1 remembers"), as it did
    under ``perf torture``."""
    server = lone_server
    for n in range(3):  # queued for server 0, which is not there yet
        server.send(AgentId.server_of(0), Inc(n), TIMEOUT)
    peer = _peer(server, 0)
    try:
        wait_until("server 0 is up", lambda: _links(server).ups == 1, TIMEOUT)
        server.call(lambda: None, TIMEOUT)  # after the resend its coming up ran
        # One write, so one read: the state taken when server 0 had delivered one of the
        # three, then its acknowledgement of all three.
        state, ack = encode_state("D0", 0, 0, 1), encode_ack("D0", 3)
        peer.send_raw(peer.cipher.wrap_frame(state) + peer.cipher.wrap_frame(ack))
        wait_until(
            "server 0 acknowledged all three",
            lambda: server.status(TIMEOUT)["queues"]["outgoing"].get("0") == 0,
            TIMEOUT,
        )
    finally:
        peer.close()
    assert server.status(TIMEOUT)["diverged"] == []


def test_a_peers_link_state_replayed_stays_before_the_acknowledgements_read_after_it(
    lone_server: AgentServer,
) -> None:
    """A group that applied a link state and a tentative frame waits for the frame's notice;
    meanwhile an acknowledgement read after the state covers more (the peer delivered more
    since). The connection closes without the notice: the group is replayed, and its inputs
    went back to the queue behind the lazy work read since, so the acknowledgement was applied
    first and the state compared after it named a peer that lost nothing ("server 0's store is
    older than server 1 remembers"), as it did in ``perf torture``'s in-process drain."""
    server = lone_server
    for n in range(3):  # queued for server 0, which is not there yet
        server.send(AgentId.server_of(0), Inc(n), TIMEOUT)
    links = _links(server)
    (frame,) = _frames_from_0(1)
    peer = _peer(server, 0)
    try:
        wait_until("server 0 is up", lambda: links.ups == 1, TIMEOUT)
        server.call(lambda: None, TIMEOUT)  # after the resend its coming up ran
        # The state taken when server 0 had delivered one of the three, with a frame sent
        # before its group was durable: server 1's group waits for the notice.
        state = encode_state("D0", 1, 0, 1)
        peer.send_raw(b"".join(peer.cipher.wrap_frame(p) for p in (TENTATIVE_FRAME, frame, state)))
        wait_until("links.sleeping == 1", lambda: links.sleeping == 1, TIMEOUT)
        # Then its acknowledgement of all three, read while the group waits.
        peer.send(encode_ack("D0", 3))
    finally:
        peer.close()  # server 0 crashes before its sync: no notice, the group is replayed
    wait_until("links.dropped == 1", lambda: links.dropped == 1, TIMEOUT)
    wait_until(
        "server 0 acknowledged all three",
        lambda: server.status(TIMEOUT)["queues"]["outgoing"].get("0") == 0,
        TIMEOUT,
    )
    assert server.status(TIMEOUT)["diverged"] == []
    assert _received_from_0(server) == 0


def test_a_tentative_frame_is_committed_only_after_its_notice(lone_server: AgentServer) -> None:
    server = lone_server
    channel = server.channel
    assert channel is not None
    heard = _heard(server)
    links = channel.links
    (frame,) = _frames_from_0(1)
    peer = _peer(server, 0)
    try:
        wait_until("server 0 is up", lambda: links.ups == 1, TIMEOUT)
        server.call(lambda: None, TIMEOUT)  # after the resend its coming up ran
        commits = server._require_engine().stats.commits
        peer.send(TENTATIVE_FRAME)
        peer.send(frame)
        # Its group applied it, reacted, and now waits at its vote for server 0's notice.
        wait_until("links.sleeping == 1", lambda: links.sleeping == 1, TIMEOUT)
        assert heard == [] and server._require_engine().stats.commits == commits
        peer.send(DURABLE_FRAME)
        wait_until("heard == [Inc(1)]", lambda: heard == [Inc(1)], TIMEOUT)
    finally:
        peer.close()
    assert _received_from_0(server) == 1
    assert links.dropped == 0


def test_a_frame_its_sender_never_made_durable_is_dropped_and_its_resend_delivered_once(
    lone_server: AgentServer,
) -> None:
    server = lone_server
    channel = server.channel
    assert channel is not None
    heard = _heard(server)
    links = channel.links
    first, second = _frames_from_0(2)
    crashing = _peer(server, 0)
    crashing.send(TENTATIVE_FRAME)
    crashing.send(first)
    wait_until("links.sleeping == 1", lambda: links.sleeping == 1, TIMEOUT)
    # Server 0 crashes before its sync: its connection closes without the notice.
    crashing.close()
    wait_until("links.dropped == 1", lambda: links.dropped == 1, TIMEOUT)
    assert heard == [] and _received_from_0(server) == 0
    # It comes back: the frame had been durable after all and is in its outgoing queue, so it
    # is sent again (plain: resends come from the store), then the next one.
    back = _peer(server, 0)
    try:
        for payload in (first, TENTATIVE_FRAME, second, DURABLE_FRAME):
            back.send(payload)
        wait_until("both notes", lambda: heard == [Inc(1), Inc(2)], TIMEOUT)
    finally:
        back.close()
    assert _received_from_0(server) == 2
    assert links.dropped == 1


def test_a_silent_sender_delays_only_its_own_frames(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    # Server 2 of three, alone; servers 0 and 1 are played by the test. Server 0 sends a frame
    # early and never its notice (its disk hangs): server 2 must go on serving server 1.
    properties = {"aaabus.link.notice_wait_ms": "20", **ON_THE_ENGINE_THREAD}
    config = load_config(make_config(servers=3, properties=properties))
    with InProcessBus(
        config, server_ids=[2], store_kind="log", storage_root=tmp_path / "stores"
    ) as bus:
        server = bus[2]
        channel = server.channel
        assert channel is not None
        heard = _heard(server)
        links = channel.links
        (from_0,) = _frames_from_0(1, size=3, to=2)
        first_1, second_1 = _frames_from_0(2, sender=1, size=3, to=2)
        silent, other = _peer(server, 0), _peer(server, 1)
        try:
            silent.send(TENTATIVE_FRAME)
            silent.send(from_0)
            wait_until("server 0's frame parked", lambda: links.parked == 1, TIMEOUT)
            other.send(first_1)
            wait_until("server 1's frame", lambda: heard == [Inc(101)], TIMEOUT)
            assert links.parked == 1  # server 0's frame still waits apart
            other.send(second_1)
            wait_until("server 1's next frame", lambda: len(heard) == 2, TIMEOUT)
            # Server 0's disk comes back: its notice releases the parked frame, delivered once.
            silent.send(DURABLE_FRAME)
            wait_until("server 0's frame", lambda: len(heard) == 3, TIMEOUT)
        finally:
            silent.close()
            other.close()
        assert heard[2] == Inc(1)
        assert links.dropped == 0


# -- two real servers ----------------------------------------------------------------------------


class Watch:
    """Wraps a server's network: records each batch's kind and its store's last vote."""

    def __init__(self, server: AgentServer) -> None:
        assert server.channel is not None and server.store is not None
        self.inner = server.channel.transport
        self.store = server.store
        self.batches: list[tuple[int, bytes, Any]] = []
        self.lock = threading.Lock()
        self.read_ns = 0  # (Transport's; only read by tracers, none here)
        server.channel.transport = self

    def send_many(self, peer: int, payloads: list[bytes]) -> None:
        with self.lock:
            self.batches.append((peer, payloads[0][:1], self.store.vote_marks()))
        assert self.inner is not None
        self.inner.send_many(peer, payloads)

    def reset(self, peer: int, reason: str) -> None:
        assert self.inner is not None
        self.inner.reset(peer, reason)


def _exchange(
    make_config: Callable[..., Path], tmp_path: Path, early: str
) -> list[tuple[int, bytes, Any]]:
    """Server 0 sends 20 notifications to server 1's listener; server 0's batches."""
    config = load_config(make_config(servers=2, properties={"aaabus.link.early": early}))
    with InProcessBus(config, store_kind="log", storage_root=tmp_path / early) as bus:
        heard = _heard(bus[1])
        wait_until(
            "link up", lambda: bus[0].network is not None and bus[0].network.is_up(1), TIMEOUT
        )
        watch = Watch(bus[0])
        for i in range(20):
            bus[0].send(AgentId.server_of(1), Inc(i))
        wait_until("len(heard) == 20", lambda: len(heard) == 20, TIMEOUT)
        assert heard == [Inc(i) for i in range(20)]
        with watch.lock:
            return list(watch.batches)


def test_frames_leave_before_their_groups_write_and_the_notice_after_it(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    batches = _exchange(make_config, tmp_path, "true")
    tentative = [i for i, (_peer, kind, _vote) in enumerate(batches) if kind == TENTATIVE_FRAME]
    assert tentative
    for i in tentative:
        # The next notice on that connection follows the group's vote: the last vote recorded
        # when the frames left was the previous group's.
        peer, _kind, vote_before = batches[i]
        notice = next(b for b in batches[i + 1 :] if b[0] == peer and b[1] == DURABLE_FRAME)
        assert notice[2] is not None and notice[2] != vote_before


def test_with_early_frames_off_nothing_is_tentative(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    batches = _exchange(make_config, tmp_path, "false")
    assert batches
    # Data, acknowledgements and the link state a connection opens with: no marker.
    assert {kind for _peer, kind, _vote in batches} <= {b"D", b"A", b"S"}


class Resumes:
    """Counts the groups an engine set aside and resumed (wraps :meth:`Engine.resume`)."""

    def __init__(self, server: AgentServer) -> None:
        engine = server._require_engine()
        self.count = 0
        inner = engine.resume

        def resume() -> object | None:
            self.count += 1
            return inner()

        engine.resume = resume  # type: ignore[method-assign]


def test_a_tentative_frame_is_applied_on_the_io_thread_whose_loop_resumes_it(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = load_config(make_config(servers=2))
    with InProcessBus(config, store_kind="log", storage_root=tmp_path / "stores") as bus:
        threads: list[str] = []
        bus[1].add_listener(lambda _sender, _note: threads.append(threading.current_thread().name))
        wait_until(
            "link up", lambda: bus[0].network is not None and bus[0].network.is_up(1), TIMEOUT
        )
        sender = Watch(bus[0])
        resumes = Resumes(bus[1])
        # One at a time: each group of server 1 applies one tentative frame, and runs on the
        # I/O thread that read it, which sets it aside until its loop has read the notice.
        # Until one did (the engine may be busy with something else when a frame comes; the
        # notice may come in the same read).
        stats = bus[1]._require_engine().stats
        for i in range(300):
            before, aborts = resumes.count, stats.aborts
            bus[0].send(AgentId.server_of(1), Inc(i))

            def heard(count: int = i + 1) -> bool:
                return len(threads) >= count

            wait_until(f"{i + 1} heard", heard, TIMEOUT)
            # This one's group ran on the I/O thread, was set aside for its notice, resumed
            # and committed at the first try.
            if threads[-1] == "net-1-io" and resumes.count > before and stats.aborts == aborts:
                break
        assert threads[-1] == "net-1-io", set(threads)
        assert resumes.count > before and stats.aborts == aborts
        assert any(kind == TENTATIVE_FRAME for _peer, kind, _vote in sender.batches)
        assert bus[1].channel is not None
        assert bus[1].channel.links.dropped == 0  # none was lost on the way


def test_a_group_that_aborts_after_its_frames_left_closes_their_connection(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = load_config(make_config(servers=2))
    with InProcessBus(config, store_kind="log", storage_root=tmp_path / "stores") as bus:
        heard = _heard(bus[1])
        wait_until(
            "link up", lambda: bus[0].network is not None and bus[0].network.is_up(1), TIMEOUT
        )
        receiver = bus[1].channel
        assert receiver is not None
        ups = receiver.links.ups
        failpoints = bus[0]._require_engine().failpoints
        # Server 0's next group fails after its frames left, before its store writes them.
        failpoints.arm("channel.sent_early", "raise")
        bus[0].send(AgentId.server_of(1), Inc(1))
        assert failpoints.fired("channel.sent_early") == 1
        # Server 1 saw the connection close (the tentative frame never vouched for is dropped
        # or never committed) and come back; the replayed group's frame arrives once.
        wait_until("a new connection", lambda: receiver.links.ups > ups, TIMEOUT)
        bus[0].send(AgentId.server_of(1), Inc(2))
        wait_until("both notes", lambda: len(heard) == 2, TIMEOUT)
        assert heard == [Inc(1), Inc(2)]


def test_polling_for_notices_is_on_only_when_each_server_of_the_host_has_a_core(
    make_config: Callable[..., Path],
) -> None:
    from aaabus.node.server import DEFAULT_NOTICE_SPIN_US, notice_spin_us

    two = load_config(make_config(servers=2, name="two.xml"))
    assert notice_spin_us(two, 0, cores=2) == DEFAULT_NOTICE_SPIN_US
    assert notice_spin_us(two, 0, cores=1) == 0
    ten = load_config(make_config(servers=10, name="ten.xml"))
    assert notice_spin_us(ten, 3, cores=2) == 0
    assert notice_spin_us(ten, 3, cores=16) == DEFAULT_NOTICE_SPIN_US
    chosen = load_config(
        make_config(servers=10, name="chosen.xml", properties={"aaabus.link.notice_spin_us": "50"})
    )
    assert notice_spin_us(chosen, 3, cores=2) == 50
