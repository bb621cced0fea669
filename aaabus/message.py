"""The unit that queues hold and the network carries."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import cloudpickle

from aaabus.ids import AgentId
from aaabus.notifications import Notification


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


def decode_note(body: bytes) -> Any:
    """Unpickle a notification body: only ever bytes from this server or an authenticated peer."""
    return pickle.loads(body)
