"""The unit that queues hold and the network carries."""

from __future__ import annotations

import pickle
import pickletools
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
    """Unpickle a notification body: only ever bytes from this server or an authenticated peer.

    Bodies that came over the wire have been through :func:`vet_body` first.
    """
    return pickle.loads(body)


class BadBody(ValueError):
    """A notification body that is not a pickle this server is willing to load."""


# How each opcode's argument is laid out, from the standard library's own description of the
# pickle format. _STEP[code] is how far a plain opcode moves (itself and a fixed-size argument);
# 0 marks what needs a closer look: STOP, LONG_BINPUT, length-prefixed and line arguments, and
# bytes that are no opcode at all (_LAYOUT None).
_LINE, _LINE_PAIR, _LEN1, _LEN4S, _LEN4, _LEN8 = -1, -6, -2, -3, -4, -5


def _opcode_tables() -> tuple[list[int | None], list[int]]:
    layouts: list[int | None] = [None] * 256
    steps = [0] * 256
    for op in pickletools.opcodes:
        code = ord(op.code.encode("latin-1"))
        if op.arg is None:
            layout = 0
        elif op.arg.name == "stringnl_noescape_pair":  # GLOBAL and INST: "module\nname\n"
            layout = _LINE_PAIR
        else:
            layout = op.arg.n  # a fixed size, or one of the negative codes above
        layouts[code] = layout
        if layout >= 0 and op.name not in ("STOP", "LONG_BINPUT"):
            steps[code] = 1 + layout
    return layouts, steps


_LAYOUT, _STEP = _opcode_tables()
_PUT, _LONG_BINPUT, _STOP = (ord(c) for c in ("p", "r", "."))
_WIDTH = {_LEN1: 1, _LEN4S: 4, _LEN4: 4, _LEN8: 8}


def vet_body(body: bytes) -> None:
    """Refuse, in time linear in its size, a body whose unpickling could take the server down.

    Unpickling is linear in the input except for one trap of CPython's C unpickler: a memo
    store (``PUT``/``LONG_BINPUT``) at index *i* grows the memo table to 2*i* slots and clears
    them one by one, so twelve bytes can ask for gigabytes and minutes of CPU. A well-formed
    pickle stores at most one memo entry per opcode, so every index must be below the body's
    length; this walks the opcodes (without building anything) and checks exactly that, plus
    that the body is made of known opcodes and ends with ``STOP``. It costs a few microseconds
    for a typical notification, paid once per message received from another server.

    Raises :class:`BadBody` (a ``ValueError``) saying what is wrong and where.
    """
    size = len(body)
    step = _STEP
    i = 0
    try:
        while i < size:
            code = body[i]
            if step[code]:
                i += step[code]
                continue
            layout = _LAYOUT[code]
            if layout is None:
                raise BadBody(f"byte {i} of the notification body is not a pickle opcode")
            if code == _STOP:
                return
            if code == _LONG_BINPUT:
                if int.from_bytes(body[i + 1 : i + 5], "little") >= size:
                    raise BadBody(f"memo index at byte {i} of the notification body is too big")
                i += 5
            elif layout == _LEN1:
                i += 2 + body[i + 1]
            elif layout in (_LINE, _LINE_PAIR):
                end = body.find(b"\n", i + 1)
                if layout == _LINE_PAIR and end >= 0:
                    end = body.find(b"\n", end + 1)
                if end < 0:
                    break
                line = body[i + 1 : end]
                if code == _PUT and not (line.isdigit() and int(line) < size):
                    raise BadBody(f"memo index at byte {i} of the notification body is too big")
                i = end + 1
            else:
                width = _WIDTH[layout]
                length = int.from_bytes(
                    body[i + 1 : i + 1 + width], "little", signed=layout == _LEN4S
                )
                if length < 0:
                    break
                i += 1 + width + length
    except IndexError:  # a length byte past the end
        pass
    raise BadBody("the notification body is cut short (no pickle STOP opcode)")
