"""Bounds on unauthenticated connections (aaabus.io.gate.PendingTable), alone and as the network
applies them to the addresses of its configured peers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from aaabus.io.gate import PendingTable
from aaabus.io.network import Network
from tests.support.harness import free_ports
from tests.test_network import LOCAL, SECRET, addr, read_frame


def test_the_oldest_of_an_address_at_its_cap_goes_first_then_the_oldest_overall() -> None:
    table: PendingTable[str] = PendingTable(capacity=4, per_address=2, room={"big": 3})
    assert table.add("a1", "a") == [] and table.add("a2", "a") == []
    assert table.add("a3", "a") == ["a1"]  # a is at its cap of 2
    assert [table.add(f"b{i}", "big") for i in range(3)] == [[], [], ["a2"]]  # full: oldest
    assert table.add("b3", "big") == ["b0"]  # big's own room is 3
    assert len(table) == 4 and "a3" in table and "b0" not in table


@pytest.fixture
def intruders() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    try:
        yield opened
    finally:
        for sock in opened:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) != b""
    except TimeoutError:
        return True
    except ConnectionResetError:
        return False


@pytest.mark.parametrize(("peers_here", "evicted"), [(1, 6), (40, 0)])
def test_a_host_of_many_peers_gets_room_for_their_handshakes(
    peers_here: int, evicted: int, intruders: list[socket.socket]
) -> None:
    # 70 connections wait in their handshake from 127.0.0.1; the flat cap is 64 per address,
    # raised to two per peer configured at that address (a bus of many servers on one host).
    closed_ports = free_ports(peers_here)  # nobody listens there: the dials simply fail
    peers = {i: (LOCAL, port) for i, port in enumerate(closed_ports, start=1)}
    # The peers have lower ids: they dial us, so 127.0.0.1 counts as their address.
    net = Network(
        my_id=1000,
        listen=[(LOCAL, 0)],
        peers=peers,
        secret=SECRET,
        on_frames=lambda peer, payloads: None,
        on_up=lambda peer: None,
        handshake_timeout=30.0,
    )
    net.start()
    try:
        for _ in range(70):
            sock = socket.create_connection(addr(net), timeout=5.0)
            intruders.append(sock)
            read_frame(sock)  # the challenge: the server has taken the connection in
        still = [_still_open(sock) for sock in intruders]
        assert still.count(False) == evicted
        assert all(still[evicted:])  # the oldest went first
    finally:
        net.stop()
