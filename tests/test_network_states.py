"""The connection state table (aaabus.io.states), walked as data: every state reachable, every
event a state does not list refused, and the properties the network relies on."""

from __future__ import annotations

import re
import socket
from collections import deque
from pathlib import Path

import pytest

from aaabus.errors import InternalError
from aaabus.io.connection import Connection
from aaabus.io.states import (
    TRANSITIONS,
    ConnEvent,
    ConnState,
    IllegalTransition,
    initial,
    transition,
)

INITIAL = (initial(outgoing=True), initial(outgoing=False))
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def reachable(starts: tuple[ConnState, ...], without: ConnEvent | None = None) -> set[ConnState]:
    """The states reachable from ``starts``, optionally never taking the event ``without``."""
    seen = set(starts)
    todo = deque(starts)
    while todo:
        for event, after in TRANSITIONS[todo.popleft()].items():
            if event is not without and after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def test_the_table_lists_every_state() -> None:
    assert set(TRANSITIONS) == set(ConnState)
    assert INITIAL == (ConnState.CONNECTING, ConnState.ACCEPTED)


def test_every_state_is_reachable_from_a_new_connection() -> None:
    assert reachable(INITIAL) == set(ConnState)


@pytest.mark.parametrize("state", list(ConnState))
@pytest.mark.parametrize("event", list(ConnEvent))
def test_every_event_is_taken_as_listed_or_refused(state: ConnState, event: ConnEvent) -> None:
    listed = TRANSITIONS[state].get(event)
    if listed is not None:
        assert transition(state, event) is listed
        return
    with pytest.raises(IllegalTransition) as info:
        transition(state, event)
    assert (info.value.state, info.value.event) == (state, event)
    assert isinstance(info.value, InternalError)  # a bug of ours, never shown to a user as such
    assert f"{state.name} cannot take event {event.name}" in str(info.value)


def test_closed_is_final_and_every_other_state_can_close() -> None:
    assert TRANSITIONS[ConnState.CLOSED] == {}
    for state in ConnState:
        if state is not ConnState.CLOSED:
            assert transition(state, ConnEvent.CLOSE) is ConnState.CLOSED


def test_frames_flow_only_after_the_aaabus_handshake_and_the_epoch() -> None:
    # TLS is optional, the aaabus handshake and the peer's EPOCH frame are not: no way to UP
    # skips HANDSHAKE or EPOCH.
    assert ConnState.UP not in reachable(INITIAL, without=ConnEvent.AUTHENTICATED)
    assert ConnState.UP not in reachable(INITIAL, without=ConnEvent.ADMITTED)
    into_up = [
        (state, event)
        for state, events in TRANSITIONS.items()
        for event, after in events.items()
        if after is ConnState.UP
    ]
    assert into_up == [(ConnState.EPOCH, ConnEvent.ADMITTED)]
    # Only a link that is up can be reset, and a reset one can only close.
    resettable = [state for state, events in TRANSITIONS.items() if ConnEvent.RESET in events]
    assert resettable == [ConnState.UP]
    assert TRANSITIONS[ConnState.CLOSING] == {ConnEvent.CLOSE: ConnState.CLOSED}


def test_the_handshake_deadline_applies_exactly_before_up() -> None:
    before_up = reachable(INITIAL) - reachable((ConnState.UP,)) - {ConnState.CLOSED}
    assert {s for s in ConnState if s.handshaking} == before_up
    assert {s for s in ConnState if s.authenticated} == {ConnState.UP, ConnState.CLOSING}


def test_a_connection_moves_by_the_table_and_keeps_its_state_when_refused() -> None:
    left, right = socket.socketpair()
    try:
        conn = Connection(left, "here", outgoing=False, peer=None, host="here")
        assert conn.state is ConnState.ACCEPTED
        conn.move(ConnEvent.GREET)
        with pytest.raises(IllegalTransition):
            conn.move(ConnEvent.RESET)  # a handshake cannot be reset: only a link that is up
        assert conn.state is ConnState.HANDSHAKE
        steps = (ConnEvent.AUTHENTICATED, ConnEvent.ADMITTED, ConnEvent.RESET, ConnEvent.CLOSE)
        for event in steps:
            conn.move(event)
        assert conn.state is ConnState.CLOSED
    finally:
        left.close()
        right.close()


def test_the_architecture_shows_the_table_as_it_is() -> None:
    """docs/architecture.md ("The network") copies the table: one row per state, its events."""
    shown: dict[ConnState, dict[ConnEvent, ConnState]] = {}
    for name, moves in re.findall(
        r"^\| `([A-Z]+)` \|[^|]*\| ([^|]*) \|$", ARCHITECTURE.read_text(), re.M
    ):
        pairs = re.findall(r"`([A-Z]+)` → `([A-Z]+)`", moves)
        shown[ConnState[name]] = {ConnEvent[event]: ConnState[after] for event, after in pairs}
    assert shown == TRANSITIONS
