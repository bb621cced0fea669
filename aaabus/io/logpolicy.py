"""How loudly the network reports a closed connection, and in which words (network thread).

The rule: a link that was up and went down is worth an INFO line (a WARNING if the peer broke
the protocol); someone failing to get in is always a WARNING naming who and why; a peer that is
simply not there yet is DEBUG; our own dial failing its handshake is a WARNING the first time
and DEBUG while the same error repeats, so a peer down for an hour does not fill the log.
The network writes the refusals of incoming connections through a
:class:`~aaabus.io.gate.RefusalLog` (same words, rate-limited), so a flood cannot fill it either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aaabus.io.states import ConnState

__all__ = ["close_level", "close_message"]


def close_level(
    state: ConnState, *, outgoing: bool, violation: bool, first_time: Callable[[], bool]
) -> int:
    """The log level of closing a connection in ``state`` after an error.

    ``violation``: the peer broke the protocol (bad frame, bad MAC). ``first_time``: asked only
    for a failed handshake of our own dial, whether its error differs from the previous one.
    """
    if state.authenticated:  # up, or closing at the layer above's request
        return logging.WARNING if violation else logging.INFO
    if not outgoing:
        return logging.WARNING
    if state is ConnState.CONNECTING:
        return logging.DEBUG
    return logging.WARNING if first_time() else logging.DEBUG


def close_message(*, was_up: bool, peer: int | None, label: str) -> str:
    """What the log line of closing a link that was up, or one of our own dials, says happened
    (the reason follows it). Refusals of incoming connections are the gate's to word."""
    if was_up:
        return f"server {peer} at {label} is down"
    return f"dialling server {peer} at {label} failed"
