"""The states of one network connection, from connect/accept to close (network thread only).

A dialled connection goes CONNECTING → (TLS →) HANDSHAKE → UP → CLOSED; an accepted one starts
at TLS or HANDSHAKE. Frames flow only when UP; CLOSED is final (a redial is a new connection).
"""

from __future__ import annotations

import enum

__all__ = ["ConnState"]


class ConnState(enum.Enum):
    CONNECTING = "connecting"  # non-blocking TCP connect in progress (dialling side only)
    TLS = "tls"  # TLS handshake in progress
    HANDSHAKE = "handshake"  # aaabus handshake in progress
    UP = "up"  # authenticated; frames flow
    CLOSED = "closed"

    @property
    def handshaking(self) -> bool:
        """Not yet authenticated (a deadline applies)."""
        return self in (ConnState.CONNECTING, ConnState.TLS, ConnState.HANDSHAKE)
