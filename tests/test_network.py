"""Network instances on real sockets of 127.0.0.1, and intruders speaking to them.

Ports are chosen by the OS (listen on port 0, then read ``Network.addresses``); every wait is on
a condition with a deadline; every Network and socket a test opens is closed by a fixture.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from aaabus.config.secret import link_key
from aaabus.errors import FrameTooLarge, NetworkError
from aaabus.io import connection
from aaabus.io.network import Network
from aaabus.io.states import ConnEvent, ConnState, transition
from aaabus.wire.frames import (
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
    encode_epoch,
    encode_frame,
)
from tests.support.tls import make_certificate

SECRET = b"s" * 32
WRONG_SECRET = b"w" * 32
LOCAL = "127.0.0.1"
WAIT = 10.0  # generous deadline for anything that should take milliseconds
LOGGER = "aaabus.network"


class Recorder:
    """The callbacks of one Network, recording what they see, with waits on a condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.frames: dict[int, list[bytes]] = {}
        self.ups: dict[int, int] = {}
        self.downs: dict[int, int] = {}
        self.echo: Network | None = None

    def on_frames(self, peer: int, payloads: list[bytes]) -> None:
        with self.cond:
            self.frames.setdefault(peer, []).extend(payloads)
            self.cond.notify_all()
        for payload in payloads:
            if self.echo is not None and payload.startswith(b"ping"):
                self.echo.send(peer, b"pong" + payload[4:])

    def on_up(self, peer: int) -> None:
        with self.cond:
            self.ups[peer] = self.ups.get(peer, 0) + 1
            self.cond.notify_all()

    def on_down(self, peer: int) -> None:
        with self.cond:
            self.downs[peer] = self.downs.get(peer, 0) + 1
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, WAIT):
                raise AssertionError(f"timed out waiting for {what}")

    def wait_up(self, peer: int, count: int = 1) -> None:
        self.wait(lambda: self.ups.get(peer, 0) >= count, f"on_up({peer}) #{count}")

    def wait_frames(self, peer: int, count: int) -> list[bytes]:
        self.wait(lambda: len(self.frames.get(peer, [])) >= count, f"{count} frames from {peer}")
        with self.cond:
            return list(self.frames[peer])


Factory = Callable[..., tuple[Network, Recorder]]


@pytest.fixture
def make_net() -> Iterator[Factory]:
    """Build and start Networks; all of them are stopped at the end of the test."""
    started: list[Network] = []

    def make(
        my_id: int,
        peers: dict[int, tuple[str, int]],
        port: int = 0,
        secret: bytes = SECRET,
        recorder: Recorder | None = None,
        **kwargs: object,
    ) -> tuple[Network, Recorder]:
        rec = recorder if recorder is not None else Recorder()
        net = Network(
            my_id=my_id,
            listen=[(LOCAL, port)],
            peers=peers,
            secret=secret,
            on_frames=rec.on_frames,
            on_up=rec.on_up,
            on_down=rec.on_down,
            name=f"s{my_id}",
            **kwargs,  # type: ignore[arg-type]
        )
        started.append(net)
        net.start()
        return net, rec

    try:
        yield make
    finally:
        for net in started:
            net.stop()


@pytest.fixture
def raw_socket() -> Iterator[Callable[[tuple[str, int]], socket.socket]]:
    """Plain client sockets (intruders), closed at the end of the test."""
    opened: list[socket.socket] = []

    def connect(address: tuple[str, int]) -> socket.socket:
        sock = socket.create_connection(address, timeout=WAIT)
        opened.append(sock)
        return sock

    try:
        yield connect
    finally:
        for sock in opened:
            sock.close()


def addr(net: Network) -> tuple[str, int]:
    return net.addresses[0]


def pair(make_net: Factory, **kwargs: object) -> tuple[Network, Recorder, Network, Recorder]:
    """Server 2 listening, server 1 dialling it; both up."""
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, **kwargs)
    net1, rec1 = make_net(1, {2: addr(net2)}, **kwargs)
    rec1.wait_up(2)
    rec2.wait_up(1)
    return net1, rec1, net2, rec2


def exchange(
    a: Network, rec_a: Recorder, a_id: int, b: Network, rec_b: Recorder, b_id: int
) -> None:
    """One more frame each way, proving the link still works."""
    before_a = len(rec_a.frames.get(b_id, []))
    before_b = len(rec_b.frames.get(a_id, []))
    a.send(b_id, b"still there?")
    b.send(a_id, b"yes")
    assert rec_b.wait_frames(a_id, before_b + 1)[-1] == b"still there?"
    assert rec_a.wait_frames(b_id, before_a + 1)[-1] == b"yes"


def read_frame(sock: socket.socket) -> bytes:
    decoder = FrameDecoder(1 << 16)
    while True:
        data = sock.recv(4096)
        assert data, "connection closed before a whole frame arrived"
        frames = decoder.feed(data)
        if frames:
            return frames[0]


def authenticate(
    sock: socket.socket, my_id: int, peer: int, epoch: tuple[int, int] | None = (1, 0)
) -> SessionCipher:
    """Run the connector's handshake on ``sock`` and send its EPOCH (unless ``epoch`` is
    None): the session's cipher."""
    hs = ConnectorHandshake(link_key(SECRET, my_id, peer), my_id, peer)
    sock.sendall(hs.receive(read_frame(sock)))
    hs.receive(read_frame(sock))
    assert hs.done
    cipher = hs.cipher()
    if epoch is not None:
        sock.sendall(cipher.wrap_frame(encode_epoch(*epoch)))
    return cipher


def wait_closed(sock: socket.socket) -> None:
    """Read until the server closes the connection (EOF or reset), within the socket timeout."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def refusals(caplog: pytest.LogCaptureFixture, server: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage().startswith(f"{server}: refused")
    ]


# ------------------------------------------------------------------------------ exchange


def test_two_servers_exchange_in_order(make_net: Factory) -> None:
    net1, rec1, net2, rec2 = pair(make_net)
    assert net1.is_up(2) and net2.is_up(1)
    count = 500
    for i in range(count):
        net1.send(2, b"a%d" % i)
        net2.send(1, b"b%d" % i)
    net1.send_many(2, [b"many%d" % i for i in range(100)])
    assert rec2.wait_frames(1, count + 100) == [b"a%d" % i for i in range(count)] + [
        b"many%d" % i for i in range(100)
    ]
    assert rec1.wait_frames(2, count) == [b"b%d" % i for i in range(count)]


def test_large_frames_and_callbacks_that_send(make_net: Factory) -> None:
    net1, rec1, net2, rec2 = pair(make_net)
    rec2.echo = net2  # answers each ping from its I/O thread
    big = bytes(range(256)) * 16384  # 4 MiB: many partial writes and reads
    net1.send_many(2, [b"ping" + big, b"ping-small", b"ping" + big[:1000]])
    pongs = rec1.wait_frames(2, 3)
    assert pongs == [b"pong" + big, b"pong-small", b"pong" + big[:1000]]


def test_three_servers_all_pairs(make_net: Factory) -> None:
    net3, rec3 = make_net(3, {1: (LOCAL, 0), 2: (LOCAL, 0)})
    net2, rec2 = make_net(2, {1: (LOCAL, 0), 3: addr(net3)})
    net1, rec1 = make_net(1, {2: addr(net2), 3: addr(net3)})
    nets = {1: (net1, rec1), 2: (net2, rec2), 3: (net3, rec3)}
    for me, (_, rec) in nets.items():
        for other in nets:
            if other != me:
                rec.wait_up(other)
    for me, (net, _) in nets.items():
        for other in nets:
            if other != me:
                for i in range(50):
                    net.send(other, b"%d->%d #%d" % (me, other, i))
    for me, (_, rec) in nets.items():
        for other in nets:
            if other != me:
                expected = [b"%d->%d #%d" % (other, me, i) for i in range(50)]
                assert rec.wait_frames(other, 50) == expected


class Aside:
    """What :class:`Waiting`'s ``on_frames`` sets aside (a :class:`Wait`): done once a
    ``notice`` frame came from its peer, the peer went down, or its deadline passed."""

    def __init__(self, rec: Waiting, peer: int, deadline: float) -> None:
        self.rec = rec
        self.peer = peer
        self.deadline = deadline
        self.spin_until_ns = time.perf_counter_ns() + 100_000
        self.resumes = 0
        self.ended = ""

    def resume(self) -> Aside | None:
        rec = self.rec
        with rec.cond:
            self.resumes += 1
            if b"notice" in rec.frames.get(self.peer, []):
                self.ended = "notice"
            elif rec.downs.get(self.peer):
                self.ended = "down"
            elif time.monotonic() >= self.deadline:
                self.ended = "deadline"
            else:
                return self
            rec.aside = None
            rec.cond.notify_all()
            return None

    def cancel(self, reason: str) -> None:
        with self.rec.cond:
            self.ended = f"cancelled: {reason}"
            self.rec.cond.notify_all()


class Waiting(Recorder):
    """A Recorder whose ``on_frames``, given a ``wait`` frame, sets work aside until its peer
    sends a ``notice`` frame (as a group waiting for its durability notice is set aside),
    recording the frames read meanwhile."""

    def __init__(self, budget: float = WAIT) -> None:
        super().__init__()
        self.budget = budget
        self.aside: Aside | None = None
        self.last: Aside | None = None
        self.during: list[tuple[int, bytes]] = []

    def on_frames(self, peer: int, payloads: list[bytes]) -> Aside | None:  # type: ignore[override]
        with self.cond:
            if self.aside is not None:
                self.during.extend((peer, payload) for payload in payloads)
        super().on_frames(peer, payloads)
        if b"wait" not in payloads:
            return None
        with self.cond:
            self.aside = self.last = Aside(self, peer, time.monotonic() + self.budget)
            self.cond.notify_all()
            return self.aside


def set_aside(
    make_net: Factory, budget: float = WAIT
) -> tuple[Network, Waiting, Network, Recorder, Network, Recorder]:
    """Server 1 dialling 2 and 3, its on_frames a :class:`Waiting` with work set aside for 2."""
    net2, rec2 = make_net(2, {1: (LOCAL, 0)})
    net3, rec3 = make_net(3, {1: (LOCAL, 0)})
    waiting = Waiting(budget)
    net1, _ = make_net(1, {2: addr(net2), 3: addr(net3)}, recorder=waiting)
    for peer in (2, 3):
        waiting.wait_up(peer)
    rec2.wait_up(1)
    rec3.wait_up(1)
    net2.send(1, b"wait")
    waiting.wait(lambda: waiting.aside is not None, "the work set aside")
    return net1, waiting, net2, rec2, net3, rec3


def test_the_loop_serves_every_connection_and_resumes_what_waits_once_it_read_it(
    make_net: Factory,
) -> None:
    net1, waiting, net2, rec2, net3, rec3 = set_aside(make_net)
    net3.send(1, b"from 3")
    waiting.wait(lambda: (3, b"from 3") in waiting.during, "server 3's frame, while it waits")
    net1.send(3, b"sent meanwhile")  # another thread's send still goes out
    assert rec3.wait_frames(1, 1) == [b"sent meanwhile"]
    net2.send(1, b"still not")
    waiting.wait(lambda: (2, b"still not") in waiting.during, "a read that is not the notice")
    assert waiting.aside is not None  # resumed, and set aside again
    net2.send(1, b"notice")
    waiting.wait(lambda: waiting.aside is None, "the end of the wait")
    assert waiting.last is not None and waiting.last.ended == "notice"
    assert waiting.last.resumes >= 3  # after server 3's read, after each of server 2's
    net3.send(1, b"after")
    assert waiting.wait_frames(3, 2) == [b"from 3", b"after"]
    assert (3, b"after") not in waiting.during
    exchange(net1, waiting, 1, net2, rec2, 2)


def test_what_waits_is_resumed_at_its_deadline_when_its_peer_goes_down_and_cancelled_at_stop(
    make_net: Factory,
) -> None:
    net1, waiting, net2, _, net3, _ = set_aside(make_net, budget=0.2)
    waiting.wait(lambda: waiting.aside is None, "the deadline")
    assert waiting.last is not None and waiting.last.ended == "deadline"
    waiting.budget = WAIT
    ends = ((net2, net2.stop, "down"), (net3, net1.stop, "cancelled: the network stopped"))
    for sender, then, expected in ends:
        sender.send(1, b"wait")
        waiting.wait(lambda: waiting.aside is not None, "more work set aside")
        then()
        waiting.wait(lambda: waiting.last is not None and waiting.last.ended != "", "its end")
        assert waiting.last is not None and waiting.last.ended == expected
        waiting.aside = None


def test_a_reset_link_closes_through_closing_and_comes_back(
    make_net: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: set[tuple[ConnState, ConnEvent]] = set()

    def recording(state: ConnState, event: ConnEvent) -> ConnState:
        taken.add((state, event))
        return transition(state, event)

    monkeypatch.setattr(connection, "transition", recording)
    net1, rec1, net2, rec2 = pair(make_net)
    net1.reset(2, "the layer above gave up on it")
    net1.send(2, b"after the reset")  # dropped: the link is closing or down
    rec1.wait(lambda: rec1.downs.get(2, 0) == 1, "on_down(2)")
    rec1.wait_up(2, count=2)  # dialled again, as after any loss
    rec2.wait_up(1, count=2)
    exchange(net1, rec1, 1, net2, rec2, 2)
    assert b"after the reset" not in rec2.frames.get(1, [])
    # Both sides went through the table, the reset side through CLOSING.
    assert {
        (ConnState.CONNECTING, ConnEvent.GREET),
        (ConnState.ACCEPTED, ConnEvent.GREET),
        (ConnState.HANDSHAKE, ConnEvent.AUTHENTICATED),
        (ConnState.UP, ConnEvent.RESET),
        (ConnState.CLOSING, ConnEvent.CLOSE),
        (ConnState.UP, ConnEvent.CLOSE),
    } <= taken


def test_send_when_down_is_dropped_and_oversize_refused(make_net: Factory) -> None:
    net1, _ = make_net(1, {2: (LOCAL, 1)}, max_frame=1000)  # nobody listens on port 1
    assert not net1.is_up(2)
    net1.send(2, b"dropped")  # neither raises nor blocks
    net1.send_many(2, [b"dropped too"])
    with pytest.raises(ValueError, match="not a peer"):
        net1.send(7, b"x")
    _, _, net2, _ = pair(make_net, max_frame=1000)
    with pytest.raises(FrameTooLarge, match="exceeds max_frame=1000"):
        net2.send(1, b"x" * 1001)


# ------------------------------------------------------------------------------ restarts


def test_restarted_acceptor_is_redialled(make_net: Factory) -> None:
    net2, _ = make_net(2, {1: (LOCAL, 0)})
    address = addr(net2)
    net1, rec1 = make_net(1, {2: address})
    rec1.wait_up(2)
    net2.stop()
    rec1.wait(lambda: rec1.downs.get(2, 0) == 1, "on_down(2)")
    assert not net1.is_up(2)
    net2b, rec2b = make_net(2, {1: (LOCAL, 0)}, port=address[1])  # same port, new instance
    rec1.wait_up(2, count=2)
    rec2b.wait_up(1)
    exchange(net1, rec1, 1, net2b, rec2b, 2)


def test_restarted_dialler_replaces_its_old_connection(make_net: Factory) -> None:
    net1, _, net2, rec2 = pair(make_net)
    # A second instance of server 1 connects while the first is still up (as after a crash that
    # left a half-open link): the new connection wins.
    net1b, rec1b = make_net(1, {2: addr(net2)})
    rec1b.wait_up(2)
    rec2.wait_up(1, count=2)
    assert rec2.downs.get(1, 0) >= 1  # the old link was announced down before the new one up
    exchange(net1b, rec1b, 1, net2, rec2, 2)
    net1.stop()
    exchange(net1b, rec1b, 1, net2, rec2, 2)


# ------------------------------------------------------------------------------ intruders


def test_intruders_are_refused_and_logged(
    make_net: Factory,
    raw_socket: Callable[[tuple[str, int]], socket.socket],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    # Server 0 is an allowed peer of server 2 that never shows up: intruders claim to be it.
    net2, rec2 = make_net(2, {0: (LOCAL, 0), 1: (LOCAL, 0)}, max_frame=1 << 16)
    net1, rec1 = make_net(1, {2: addr(net2)}, max_frame=1 << 16)
    rec1.wait_up(2)
    rec2.wait_up(1)
    target = addr(net2)

    def intrude(act: Callable[[socket.socket], None], reason: str) -> None:
        before = len(refusals(caplog, "s2"))
        sock = raw_socket(target)
        act(sock)
        wait_closed(sock)
        new = refusals(caplog, "s2")[before:]
        assert len(new) == 1 and reason in new[0], new
        assert f"from {LOCAL}:{sock.getsockname()[1]}" in new[0]
        exchange(net1, rec1, 1, net2, rec2, 2)  # the real link never noticed

    def garbage(sock: socket.socket) -> None:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")

    def wrong_secret(sock: socket.socket) -> None:
        sock.sendall(
            ConnectorHandshake(link_key(WRONG_SECRET, 0, 2), 0, 2).receive(read_frame(sock))
        )

    recorded: list[bytes] = []

    def record(sock: socket.socket) -> None:
        # A complete, valid answer to this connection's challenge, captured but not sent.
        recorded.append(ConnectorHandshake(link_key(SECRET, 0, 2), 0, 2).receive(read_frame(sock)))
        sock.shutdown(socket.SHUT_WR)

    def replay(sock: socket.socket) -> None:
        read_frame(sock)  # a fresh challenge
        sock.sendall(recorded[0])

    def unknown_id(sock: socket.socket) -> None:
        sock.sendall(ConnectorHandshake(link_key(SECRET, 9, 2), 9, 2).receive(read_frame(sock)))

    def higher_id(sock: socket.socket) -> None:  # 3 > 2: server 2 would dial it, not accept it
        sock.sendall(ConnectorHandshake(link_key(SECRET, 3, 2), 3, 2).receive(read_frame(sock)))

    def oversized(sock: socket.socket) -> None:
        sock.sendall(b"\x7f\xff\xff\xff")  # a 2 GiB length prefix, and no body

    def oversized_after_auth(sock: socket.socket) -> None:
        authenticate(sock, 0, 2)
        rec2.wait_up(0)
        sock.sendall(encode_frame(b"\x00" * ((1 << 16) + 25)))

    intrude(garbage, "exceeds the limit")
    intrude(wrong_secret, "bad MAC")
    intrude(record, "closed during the handshake")
    intrude(replay, "bad MAC: wrong bus key or replayed handshake")
    intrude(unknown_id, "unknown server id 9")
    intrude(higher_id, "unknown server id 3")
    intrude(oversized, "exceeds the limit")
    # An authenticated peer that then breaks the rules is cut off too (and logged as such).
    sock = raw_socket(target)
    oversized_after_auth(sock)
    wait_closed(sock)
    assert any(
        "server 0 at" in r.getMessage() and "exceeds the limit" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )
    exchange(net1, rec1, 1, net2, rec2, 2)


def test_tampered_session_frame_cuts_the_link(
    make_net: Factory,
    raw_socket: Callable[[tuple[str, int]], socket.socket],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    net2, rec2 = make_net(2, {0: (LOCAL, 0)})
    sock = raw_socket(addr(net2))
    cipher = authenticate(sock, 0, 2)
    rec2.wait_up(0)
    good = cipher.wrap_frame(b"first")
    bad = bytearray(cipher.wrap_frame(b"second"))
    bad[-1] ^= 1
    sock.sendall(good + bytes(bad) + cipher.wrap_frame(b"third"))
    wait_closed(sock)
    rec2.wait(lambda: rec2.downs.get(0, 0) == 1, "on_down(0)")
    assert rec2.frames[0] == [b"first"]  # nothing after the forgery was delivered
    assert any("bad MAC" in r.getMessage() for r in caplog.records)


def test_silent_client_times_out(
    make_net: Factory,
    raw_socket: Callable[[tuple[str, int]], socket.socket],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    net2, _ = make_net(2, {1: (LOCAL, 0)}, handshake_timeout=0.2)
    sock = raw_socket(addr(net2))
    started = time.monotonic()
    read_frame(sock)  # the challenge, then nothing from us
    wait_closed(sock)
    assert time.monotonic() - started < WAIT
    assert any("handshake timed out after 0.2 s" in m for m in refusals(caplog, "s2"))


class LogWatcher(logging.Handler):
    """Collects the network's log messages and lets a test wait for one (caplog cannot wait)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.cond = threading.Condition()
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.messages.append((record.levelno, record.getMessage()))
            self.cond.notify_all()

    def wait(self, predicate: Callable[[list[tuple[int, str]]], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: predicate(self.messages), WAIT):
                raise AssertionError(f"timed out waiting for log: {what}")


@pytest.fixture
def log_watcher() -> Iterator[LogWatcher]:
    logger = logging.getLogger(LOGGER)
    watcher = LogWatcher()
    old_level = logger.level
    logger.addHandler(watcher)
    logger.setLevel(logging.DEBUG)
    try:
        yield watcher
    finally:
        logger.removeHandler(watcher)
        logger.setLevel(old_level)


def test_servers_with_different_keys_never_connect(
    make_net: Factory, log_watcher: LogWatcher
) -> None:
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, secret=WRONG_SECRET)
    net1, rec1 = make_net(1, {2: addr(net2)})

    def refused_twice(messages: list[tuple[int, str]]) -> bool:
        return sum(m.startswith("s2: refused") and "bad MAC" in m for _, m in messages) >= 2

    log_watcher.wait(refused_twice, "server 2 refusing server 1 twice")
    assert not net1.is_up(2) and not rec1.ups and not rec2.ups
    # The dialler keeps retrying (with backoff) but warns only once about the same failure.
    dial_warnings = [
        m for level, m in log_watcher.messages if level == logging.WARNING and m.startswith("s1:")
    ]
    assert len(dial_warnings) == 1, dial_warnings
    assert "dialling server 2" in dial_warnings[0]


# ------------------------------------------------------------------------------ start-up errors


def test_port_in_use_is_one_line(make_net: Factory) -> None:
    with socket.socket() as taken:
        taken.bind((LOCAL, 0))
        taken.listen()
        port = taken.getsockname()[1]
        net = Network(
            my_id=3,
            listen=[(LOCAL, 0), (LOCAL, port)],
            peers={},
            secret=SECRET,
            on_frames=lambda p, b: None,
            on_up=lambda p: None,
            name="D1",
        )
        with pytest.raises(NetworkError) as info:
            net.start()
    message = str(info.value)
    assert message.startswith(f"port {port} on {LOCAL} is in use (server 3, network D1): ")
    assert "\n" not in message
    assert net.addresses == []  # the first, successfully bound port was released
    net.stop()


# ------------------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ...]:
    cert, key = make_certificate(tmp_path_factory.mktemp("tls"))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert)  # verifies the certificate and 127.0.0.1 as its name
    return server, client


def test_tls_exchange(make_net: Factory, tls_contexts: tuple[ssl.SSLContext, ...]) -> None:
    server, client = tls_contexts
    net1, rec1, net2, rec2 = pair(make_net, ssl_server=server, ssl_client=client)
    rec2.echo = net2
    big = b"y" * (1 << 20)
    for i in range(200):
        net1.send(2, b"ping%d" % i)
    net1.send(2, b"ping" + big)
    pongs = rec1.wait_frames(2, 201)
    assert pongs == [b"pong%d" % i for i in range(200)] + [b"pong" + big]
    exchange(net1, rec1, 1, net2, rec2, 2)
