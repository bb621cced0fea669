"""Links that carry their server's epoch, keepalives, and peers with several addresses (issue
42): Network instances on real sockets of 127.0.0.1, each with a real epoch file.

A link is up only once the peer's EPOCH frame is read and is not older than the epoch the book
knows: an older one is refused in one line naming both epochs and nothing of it is delivered, a
newer one is remembered on disk and replaces the older link; any other first frame closes the
connection. Keepalives keep an idle link heard without reaching ``on_frames``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aaabus.node.epochs import EpochBook
from aaabus.wire.frames import encode_epoch
from tests.test_network import (  # the fixtures of the network's tests, and their helpers
    LOCAL,
    WAIT,
    Factory,
    LogWatcher,
    addr,
    authenticate,
    exchange,
    log_watcher,
    make_net,
    raw_socket,
    wait_closed,
)

__all__ = ["log_watcher", "make_net", "raw_socket"]


def refused_lines(watcher: LogWatcher, text: str) -> list[str]:
    with watcher.cond:
        return [m for level, m in watcher.messages if level == logging.WARNING and text in m]


def test_a_link_is_up_with_the_peers_epoch_in_the_book(make_net: Factory, tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, epochs=book)
    net1, rec1 = make_net(1, {2: addr(net2)}, epoch=(3, 1))
    rec2.wait_up(1)
    rec1.wait_up(2)
    assert EpochBook(tmp_path).known(1) == (3, 1)  # on disk before the link was up
    exchange(net1, rec1, 1, net2, rec2, 2)


def test_an_older_epoch_is_refused_in_one_line_and_delivers_nothing(
    make_net: Factory, tmp_path: Path, log_watcher: LogWatcher
) -> None:
    book = EpochBook(tmp_path)
    book.raise_to(1, 3, 1)  # a vote gave epoch 3 of server 1 to its member 1
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, epochs=book)
    net1, _ = make_net(1, {2: addr(net2)}, epoch=(2, 0))  # the old primary, awake again
    line = "server 1 speaks for its epoch 2 (member 0), which epoch 3 (member 1) took over"
    log_watcher.wait(lambda _: len(refused_lines(log_watcher, line)) >= 2, "two refusals")
    # Each refusal is one line, at the acceptor (the refusing server); the dialler warns once.
    refusals = refused_lines(log_watcher, line)
    assert all(m.startswith("s2: refused connection from") for m in refusals), refusals
    assert len([m for m in refused_lines(log_watcher, "s1: dialling server 2") if line in m]) <= 1
    net1.send(2, b"from the old primary")
    assert not rec2.ups and not rec2.frames
    assert book.known(1) == (3, 1)
    # Server 1 saw server 2's epoch, which is fine, and then its link closed: a link that was
    # never heard beyond the EPOCHs earns no fast redial, so a refused old primary does not
    # flood its peers (the backoff doubles from 20 ms: at most 6 attempts in 0.6 s, where
    # redialling at the first delay every time would make about 20).
    before = len(refused_lines(log_watcher, line))
    threading.Event().wait(0.6)  # an observation over a fixed span, not a wait for an event
    assert len(refused_lines(log_watcher, line)) - before <= 6


def test_a_newer_epoch_replaces_the_older_link_and_fences_it_out(
    make_net: Factory, tmp_path: Path, log_watcher: LogWatcher
) -> None:
    book = EpochBook(tmp_path)
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, epochs=book)
    make_net(1, {2: addr(net2)})  # epoch 1, member 0
    rec2.wait_up(1)
    new, rec_new = make_net(1, {2: addr(net2)}, epoch=(2, 1))
    rec_new.wait_up(2)
    rec2.wait_up(1, count=2)
    rec2.wait(lambda: rec2.downs.get(1, 0) >= 1, "the old link down")
    assert book.known(1) == (2, 1) and EpochBook(tmp_path).known(1) == (2, 1)
    log_watcher.wait(
        lambda ms: any("server 1 now speaks for epoch 2 (member 1)" in m for _, m in ms),
        "the replacement said why",
    )
    # The old one redials, and is refused from now on; the new link goes on.
    line = "server 1 speaks for its epoch 1 (member 0), which epoch 2 (member 1) took over"
    log_watcher.wait(lambda _: bool(refused_lines(log_watcher, line)), "the old one refused")
    exchange(new, rec_new, 1, net2, rec2, 2)
    assert rec2.ups[1] == 2


def test_fence_closes_a_link_whose_epoch_a_vote_gave_away(
    make_net: Factory, tmp_path: Path, log_watcher: LogWatcher
) -> None:
    book = EpochBook(tmp_path)
    net2, rec2 = make_net(2, {1: (LOCAL, 0)}, epochs=book)
    net1, rec1 = make_net(1, {2: addr(net2)})
    rec2.wait_up(1)
    rec1.wait_up(2)  # both sides, or net1's frame may go before net1 has net2 up (dropped)
    net2.fence(1, 1)  # not older: kept
    exchange(net1, rec1, 1, net2, rec2, 2)
    assert book.grant(1, 2, 1, float("inf"), 1.0).granted
    net2.fence(1, 2)
    rec2.wait(lambda: rec2.downs.get(1, 0) == 1, "the fenced link down")
    line = "server 1 speaks for its epoch 1 (member 0), which epoch 2 (member 1) took over"
    log_watcher.wait(lambda _: bool(refused_lines(log_watcher, line)), "its redial refused")
    assert not net2.is_up(1) and rec2.ups[1] == 1


def test_a_first_frame_that_is_not_epoch_is_a_violation(
    make_net: Factory, raw_socket: Callable[[tuple[str, int]], socket.socket], tmp_path: Path
) -> None:
    net2, rec2 = make_net(2, {0: (LOCAL, 0)}, epochs=EpochBook(tmp_path), max_frame=1 << 20)
    for first in (b"D" + bytes(60), b"", b"E" * 12, bytes(1 << 20)):
        sock = raw_socket(addr(net2))
        cipher = authenticate(sock, 0, 2, epoch=None)
        started = time.monotonic()
        sock.sendall(cipher.wrap_frame(first) + cipher.wrap_frame(encode_epoch(1, 0)))
        wait_closed(sock)
        assert time.monotonic() - started < WAIT
    assert not rec2.ups and not rec2.frames


def test_keepalives_keep_an_idle_link_heard_and_reach_no_callback(make_net: Factory) -> None:
    net2, rec2 = make_net(2, {1: (LOCAL, 0)})
    net1, rec1 = make_net(1, {2: addr(net2)}, heartbeat_s=0.02)
    rec2.wait_up(1)
    rec1.wait_up(2)
    assert net2.silent_for(3) == float("inf")  # never heard
    # Server 1 sends keepalives, server 2 none: 2 keeps hearing 1, 1 stops hearing 2.
    deadline = time.monotonic() + WAIT
    while net1.silent_for(2) <= 0.3:  # nothing notifies silence: looked at until the deadline
        assert time.monotonic() < deadline, "server 2 never silent for 0.3 s"
        threading.Event().wait(0.01)
    watched_until = time.monotonic() + 0.3
    longest = 0.0
    while time.monotonic() < watched_until:  # an observation over a fixed span, not a wait
        longest = max(longest, net2.silent_for(1))
        threading.Event().wait(0.005)
    assert longest < 0.2, longest
    assert not rec1.frames and not rec2.frames  # keepalives never reach on_frames
    exchange(net1, rec1, 1, net2, rec2, 2)


def test_a_peer_is_dialled_at_each_of_its_addresses_in_turn(make_net: Factory) -> None:
    with socket.socket() as closed:  # a member that is not primary: nothing listens there
        closed.bind((LOCAL, 0))
        nobody = closed.getsockname()
    net2, rec2 = make_net(2, {1: (LOCAL, 0)})
    net1, rec1 = make_net(1, {2: [nobody, addr(net2)]})
    # Each side is up once it has read the other's EPOCH: wait for both, or net2's frame may
    # be sent before net2 has net1 up (and dropped, as the network drops frames to a peer down).
    rec1.wait_up(2)
    rec2.wait_up(1)
    exchange(net1, rec1, 1, net2, rec2, 2)
    net3, _ = make_net(3, {1: (LOCAL, 0)})
    _, rec1b = make_net(1, {3: [addr(net3), nobody]})
    rec1b.wait_up(3)
