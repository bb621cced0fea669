"""One TCP connection between two servers, from connect or accept to close: what the network
knows of it, and the writes any thread may make on it.

A :class:`Connection` is a record the network's modules share (the loop registers it, the dialer
and the acceptor create it, the network runs its handshake and session); its state changes only
through :meth:`Connection.move`, by the table of :mod:`aaabus.io.states`.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from aaabus.io.states import ConnEvent, initial, transition
from aaabus.wire.frames import (
    HANDSHAKE_MAX_FRAME,
    AcceptorHandshake,
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
)

__all__ = ["Connection", "tune"]


class Connection:
    """One TCP connection, from connect/accept to close.

    ``lock`` guards the transitions to and from UP, the send side of ``cipher``, ``out`` and
    ``direct``: sending threads and the I/O thread both write through it. Everything else is
    the I/O thread's (a connection out in a TLS worker is the worker's until its step returns:
    see :mod:`aaabus.io.tlssteps`).
    """

    __slots__ = (
        "beat_mark",
        "cipher",
        "deadline",
        "decoder",
        "direct",
        "epoch",
        "handshake",
        "host",
        "label",
        "lock",
        "mask",
        "out",
        "outgoing",
        "peer",
        "sock",
        "state",
        "tls_want",
        "verified",
    )

    def __init__(
        self, sock: socket.socket, label: str, *, outgoing: bool, peer: int | None, host: str
    ) -> None:
        self.sock = sock
        self.label = label  # "host:port" of the remote end, for logs
        self.host = host
        self.outgoing = outgoing
        # Expected peer while dialling; the proven peer once up; None for an unproven acceptee.
        self.peer = peer
        self.state = initial(outgoing=outgoing)
        # Until the peer has authenticated, frames are held to the handshake's tiny limit.
        self.decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self.handshake: ConnectorHandshake | AcceptorHandshake | None = None
        self.cipher: SessionCipher | None = None
        self.lock = threading.Lock()
        self.out = bytearray()
        self.direct = False  # plain TCP and up: senders may write to the socket themselves
        self.mask = 0  # events currently registered with the selector (0: not registered)
        self.tls_want = selectors.EVENT_READ
        self.deadline = 0.0
        self.verified = False  # a session frame from the peer passed its MAC
        self.epoch = 0  # the epoch the peer spoke for in its EPOCH frame (0: not yet admitted)
        self.beat_mark = 0  # frames sent as of the last keepalive tick (aaabus.io.network)

    def move(self, event: ConnEvent) -> None:
        """Apply ``event`` (the lock held for a transition to or from UP); raises
        :class:`~aaabus.io.states.IllegalTransition` if the state refuses it."""
        self.state = transition(self.state, event)

    def write_locked(self, data: bytes) -> bool:
        """Write or queue ``data`` (lock held); True if the I/O thread must flush the rest.

        On plain TCP, once up, the sender writes to the non-blocking socket itself when nothing
        is queued before it: one system call, no thread hand-off.
        """
        out = self.out
        if out:
            # Something is already queued, so a flush is already requested or the socket is
            # registered for writing: just append, it leaves with the rest in one write.
            out += data
            return False
        if self.direct:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                # Let the I/O thread retry the write, hit the same error and close properly.
                sent = 0
            if sent == len(data):
                return False
            out += memoryview(data)[sent:]
        else:
            out += data
        return True


def tune(sock: socket.socket) -> None:
    """Low latency, and notice a silently dead peer within about half a minute."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
