"""The unit that queues hold and the network carries."""

from __future__ import annotations

import pickle
from typing import NamedTuple

import cloudpickle

from aaabus.errors import BadBody, MalformedPickle
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.wire.pickles import pickle_end


class Message(NamedTuple):
    """One notification on its way from ``sender`` to ``target``.

    ``body`` is the pickled notification: pickling at send time gives value semantics (the sender
    may keep mutating its object) and lets local and remote messages be handled alike.
    """

    sender: AgentId
    target: AgentId
    body: bytes


def encode_note(note: Notification) -> bytes:
    """Pickle a notification; classes that no one could import by name travel by value.

    The plain pickler is tried first because it is several times faster; cloudpickle takes over
    for classes defined in ``__main__``, in a notebook or inside a function.
    """
    if type(note).__module__ != "__main__":
        try:
            return pickle.dumps(note, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):
            pass
    return cloudpickle.dumps(note, protocol=pickle.HIGHEST_PROTOCOL)


def vet_body(body: bytes) -> None:
    """Refuse, in time linear in its size, a body whose unpickling could take the server down.

    Unpickling is linear in the input except for one trap of CPython's C unpickler: a memo
    store (``PUT``/``LONG_BINPUT``) at index *i* grows the memo table to 2*i* slots and clears
    them one by one, so twelve bytes can ask for gigabytes and minutes of CPU. The check
    (:func:`aaabus.wire.pickles.pickle_end`) walks the opcodes without building anything and refuses
    unknown opcodes, a missing ``STOP`` and memo indexes beyond the body's length (a well-formed
    pickle stores at most one memo entry per opcode). It costs a few microseconds for a typical
    notification, paid once per message received from another server or a client.

    Raises :class:`BadBody` (a ``ValueError``) saying what is wrong and where.
    """
    try:
        pickle_end(body)
    except MalformedPickle as exc:
        raise BadBody(f"the notification body is not a well-formed pickle: {exc}") from None
