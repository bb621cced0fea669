"""The unit that queues hold and the network carries."""

from __future__ import annotations

from typing import NamedTuple

from aaabus.errors import BadBody, MalformedPickle
from aaabus.model.ids import AgentId
from aaabus.wire.pickles import pickle_end


class Message(NamedTuple):
    """One notification on its way from ``sender`` to ``target``.

    ``body`` is the encoded notification (:mod:`aaabus.wire.codec`): encoding at send time gives
    value semantics (the sender may keep mutating its object) and lets local and remote messages
    be handled alike.
    """

    sender: AgentId
    target: AgentId
    body: bytes


def vet_body(body: bytes) -> None:
    """Refuse, in time linear in its size, a pickled body whose loading could take the server
    down; a data body passes (decoding it is linear and bounded, see :mod:`aaabus.wire.codec`).

    A pickle crosses the wire only on a bus that opted in (``aaabus.wire.pickle``), and one
    trap of CPython's C unpickler remains even there: a memo store (``PUT``/``LONG_BINPUT``) at
    index *i* grows the memo table to 2*i* slots, so twelve bytes can ask for gigabytes. The
    check (:func:`aaabus.wire.pickles.pickle_end`) walks the opcodes without building anything
    and refuses unknown opcodes, a missing ``STOP`` and memo indexes beyond the body's length.

    Raises :class:`BadBody` (a ``ValueError``) saying what is wrong and where.
    """
    if body[:1] != b"\x80":
        return
    try:
        pickle_end(body)
    except MalformedPickle as exc:
        raise BadBody(f"the notification body is not a well-formed pickle: {exc}") from None
