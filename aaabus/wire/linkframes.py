"""The frames of a channel link, sans-IO: data frames, cumulative acknowledgements, the link
state a server announces when a connection comes up, and the one-byte markers of early frames
(:mod:`aaabus.core.early`).

No kind is pickled: a frame is checked and taken apart with fixed-size fields in time linear
in its length, whatever its bytes, and only the notification body inside a data frame is ever
unpickled (after :func:`aaabus.wire.message.vet_body`). Pure functions, any thread.
"""

from __future__ import annotations

import struct

from aaabus.model.ids import AgentId
from aaabus.wire.message import Message, vet_body

__all__ = [
    "ACK",
    "DATA",
    "DURABLE_FRAME",
    "STATE",
    "TENTATIVE_FRAME",
    "data_frame_size",
    "decode_ack",
    "decode_data",
    "decode_state",
    "encode_ack",
    "encode_data",
    "encode_state",
]

# First byte of every frame.
DATA = b"D"
ACK = b"A"
#: What the sender's store holds of one link, sent first on every new connection.
STATE = b"S"
#: "The data frames that follow on this connection are not durable yet" (aaabus.core.early).
TENTATIVE_FRAME = b"T"
#: "Every data frame sent before this one on this connection is durable".
DURABLE_FRAME = b"N"
# An acknowledgement: kind, upto; followed by the domain name, UTF-8.
_ACK = struct.Struct(">cQ")
# A link state: kind, sent, acknowledged, received; followed by the domain name, UTF-8.
_STATE = struct.Struct(">cQQQ")
# A data frame: kind, link sequence number, sender id, target id (from, server, stamp each),
# lengths of the domain name and of the stamp; followed by the domain name (UTF-8), the stamp
# and the notification body, which runs to the end of the frame.
_DATA = struct.Struct(">cQIIQIIQHI")
_new = tuple.__new__


def encode_ack(domain: str, upto: int) -> bytes:
    """ "Everything of this link in ``domain`` up to ``upto`` is stored here"."""
    return _ACK.pack(ACK, upto) + domain.encode()


def decode_ack(payload: bytes) -> tuple[str, int] | None:
    """``(domain, upto)`` of an acknowledgement frame; None when ``payload`` is not one.

    Lenient on the domain's bytes (replaced, not refused): an unknown domain matches no link,
    so a garbled acknowledgement is ignored rather than dropping the connection.
    """
    if payload[:1] != ACK or len(payload) <= _ACK.size:
        return None
    upto = _ACK.unpack_from(payload)[1]
    return payload[_ACK.size :].decode("utf-8", "replace"), upto


def encode_state(domain: str, sent: int, acked: int, received: int) -> bytes:
    """ "My store says: I stamped ``sent`` messages for you in ``domain``, you acknowledged
    ``acked`` of them, and I delivered ``received`` of yours" (see
    :meth:`aaabus.core.protocol.LinkProtocol.check_state`)."""
    return _STATE.pack(STATE, sent, acked, received) + domain.encode()


def decode_state(payload: bytes) -> tuple[str, int, int, int] | None:
    """``(domain, sent, acked, received)`` of a link state frame; None when it is not one."""
    if payload[:1] != STATE or len(payload) <= _STATE.size:
        return None
    _kind, sent, acked, received = _STATE.unpack_from(payload)
    return payload[_STATE.size :].decode("utf-8", "replace"), sent, acked, received


def encode_data(seq: int, domain: str, stamp: bytes, message: Message) -> bytes:
    """The data frame carrying ``message`` as number ``seq`` of its link in ``domain``."""
    name = domain.encode()
    sender, target = message.sender, message.target
    head = _DATA.pack(DATA, seq, *sender, *target, len(name), len(stamp))
    return b"".join((head, name, stamp, message.body))


def data_frame_size(domain: str, stamp_size: int, message: Message) -> int:
    """The length of the data frame :func:`encode_data` makes for a stamp of ``stamp_size``."""
    return data_frame_overhead(domain, stamp_size) + len(message.body)


def data_frame_overhead(domain: str, stamp_size: int) -> int:
    """What a data frame in ``domain`` with a stamp of ``stamp_size`` adds to its body."""
    return _DATA.size + len(domain.encode()) + stamp_size


def decode_data(payload: bytes) -> tuple[int, str, bytes, Message]:
    """Take a data frame apart: ``(seq, domain, stamp, message)``; ``ValueError`` if malformed.

    The body is vetted here, on the server that received it, so that whatever later unpickles
    it (this server's engine, or the next hop's) only ever sees bytes that passed the check.
    """
    if len(payload) < _DATA.size or payload[:1] != DATA:
        raise ValueError(f"not a data frame ({len(payload)} bytes, kind {payload[:1]!r})")
    _kind, seq, so, ss, st, to, ts, tt, name_len, stamp_len = _DATA.unpack_from(payload)
    start = _DATA.size
    body_at = start + name_len + stamp_len
    if body_at >= len(payload):
        raise ValueError(f"data frame of {len(payload)} bytes is shorter than its fields")
    domain = payload[start : start + name_len].decode("utf-8")  # UnicodeError is a ValueError
    body = payload[body_at:]
    vet_body(body)
    # tuple.__new__ is what the named tuples' own __new__ ends in: called directly, it saves
    # three Python calls per received message (the fields are already ints, in order).
    message = _new(Message, (_new(AgentId, (so, ss, st)), _new(AgentId, (to, ts, tt)), body))
    return seq, domain, payload[start + name_len : body_at], message
