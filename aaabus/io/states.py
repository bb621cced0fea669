"""Every state of a connection between two servers, and every transition, in one table.

A connection's life, whichever side opened it (each of the first two may go through TLS or not)::

    CONNECTING ──┬── SECURE ──► TLS ── GREET ──┬──► HANDSHAKE ── AUTHENTICATED ──► EPOCH
    ACCEPTED ────┴───────────── GREET ─────────┘
    EPOCH ── ADMITTED ──► UP

    UP ── RESET ──► CLOSING          every state but CLOSED ── CLOSE ──► CLOSED

:data:`TRANSITIONS` lists them all, as data (the way h11's ``_state.py`` lists HTTP's), and
:func:`transition` is the only way a connection changes state
(:meth:`aaabus.io.connection.Connection.move`): an event the table does not list for the current
state raises :class:`IllegalTransition`, a bug of the network's, never a peer's doing (what a
peer does wrong closes its connection, which is legal from every state but CLOSED). EPOCH is
an authenticated connection waiting for the peer's first session frame, which names the epoch
it speaks for (issue 42): the network admits it (UP) only if that epoch is not older than the
one it knows. Frames flow only UP; CLOSED is final (a redial is a new connection). CLOSING is a
link the layer above asked to close (:meth:`aaabus.io.network.Network.reset`, any thread): from
then on nothing more is sent on it or delivered from it, and the I/O thread closes it at the end
of its turn.

Sans-IO: no socket, no thread; the network's I/O thread applies the events (and, for the
transitions to and from UP, under the connection's lock: senders read the state without the I/O
thread).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from aaabus.errors import IllegalTransition

__all__ = ["TRANSITIONS", "ConnEvent", "ConnState", "IllegalTransition", "initial", "transition"]


class ConnState(enum.Enum):
    """Where a connection is in its life (see the module docstring)."""

    CONNECTING = "connecting"  # our non-blocking TCP connect is in progress (dialling side)
    ACCEPTED = "accepted"  # taken from a listening socket; nothing exchanged yet
    TLS = "tls"  # TLS handshake in progress
    HANDSHAKE = "handshake"  # aaabus handshake in progress
    EPOCH = "epoch"  # authenticated; waiting for the peer's EPOCH frame
    UP = "up"  # authenticated; frames flow
    CLOSING = "closing"  # reset by the layer above: nothing more goes either way
    CLOSED = "closed"

    @property
    def handshaking(self) -> bool:
        """Not yet authenticated: the handshake deadline applies."""
        return self in _HANDSHAKING

    @property
    def authenticated(self) -> bool:
        """The peer proved who it is (up, or closing since): losing it is a link going down."""
        return self is ConnState.UP or self is ConnState.CLOSING


class ConnEvent(enum.Enum):
    """What happens to a connection (see :data:`TRANSITIONS` for where each may happen)."""

    SECURE = "secure"  # TLS begins on the TCP connection (this side has a TLS context)
    GREET = "greet"  # the aaabus handshake begins: right after TCP, or once TLS is done
    AUTHENTICATED = "authenticated"  # the handshake proved the peer: its EPOCH comes next
    ADMITTED = "admitted"  # the peer's epoch is current: frames may flow
    RESET = "reset"  # the layer above asked for the link to be closed
    CLOSE = "close"  # closed: error, timeout, the peer hung up, eviction, replacement, stop


_S = ConnState
_E = ConnEvent

_HANDSHAKING = frozenset({_S.CONNECTING, _S.ACCEPTED, _S.TLS, _S.HANDSHAKE, _S.EPOCH})

#: Every legal transition: state -> event -> next state. Anything not listed is illegal.
TRANSITIONS: Mapping[ConnState, Mapping[ConnEvent, ConnState]] = MappingProxyType(
    {
        _S.CONNECTING: {_E.SECURE: _S.TLS, _E.GREET: _S.HANDSHAKE, _E.CLOSE: _S.CLOSED},
        _S.ACCEPTED: {_E.SECURE: _S.TLS, _E.GREET: _S.HANDSHAKE, _E.CLOSE: _S.CLOSED},
        _S.TLS: {_E.GREET: _S.HANDSHAKE, _E.CLOSE: _S.CLOSED},
        _S.HANDSHAKE: {_E.AUTHENTICATED: _S.EPOCH, _E.CLOSE: _S.CLOSED},
        _S.EPOCH: {_E.ADMITTED: _S.UP, _E.CLOSE: _S.CLOSED},
        _S.UP: {_E.RESET: _S.CLOSING, _E.CLOSE: _S.CLOSED},
        _S.CLOSING: {_E.CLOSE: _S.CLOSED},
        _S.CLOSED: {},
    }
)


def initial(*, outgoing: bool) -> ConnState:
    """The first state of a connection we dial (``outgoing``) or accept."""
    return ConnState.CONNECTING if outgoing else ConnState.ACCEPTED


def transition(state: ConnState, event: ConnEvent) -> ConnState:
    """The state after ``event``; raises :class:`IllegalTransition` if ``state`` refuses it."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        allowed = ", ".join(e.name for e in TRANSITIONS[state]) or "nothing"
        raise IllegalTransition(
            f"connection {state.name} cannot take event {event.name} (it allows: {allowed})",
            state,
            event,
        ) from None
