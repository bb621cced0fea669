"""What can be known of pickle bytes without unpickling them.

:func:`pickle_end` walks a pickle's opcodes, building nothing, and says where it ends. The walk
is linear in the bytes and cannot allocate more than it reads, so it is safe on garbage; it is
used to vet notification bodies before they are unpickled (:func:`aaabus.wire.message.vet_body`) and
to check the records of a store at boot (:mod:`aaabus.core.store`).
"""

from __future__ import annotations

import pickletools

from aaabus.errors import MalformedPickle

# How each opcode's argument is laid out, from the standard library's own description of the
# pickle format: a fixed size (>= 0) or one of these codes (pickletools' own, plus a pair of
# lines for GLOBAL and INST).
_LINE, _LEN1, _LEN4S, _LEN4, _LEN8 = (
    pickletools.UP_TO_NEWLINE,
    pickletools.TAKEN_FROM_ARGUMENT1,
    pickletools.TAKEN_FROM_ARGUMENT4,
    pickletools.TAKEN_FROM_ARGUMENT4U,
    pickletools.TAKEN_FROM_ARGUMENT8U,
)
_LINE_PAIR = -100
_WIDTH = {_LEN1: 1, _LEN4S: 4, _LEN4: 4, _LEN8: 8}


def _opcode_tables() -> tuple[list[int | None], list[int]]:
    """Per byte value: its argument layout (None: not an opcode), and how far a plain opcode
    moves (itself and a fixed-size argument; 0 for those that need a closer look)."""
    layouts: list[int | None] = [None] * 256
    steps = [0] * 256
    for op in pickletools.opcodes:
        code = ord(op.code.encode("latin-1"))
        if op.arg is None:
            layout = 0
        elif op.arg.name == "stringnl_noescape_pair":  # "module\nname\n"
            layout = _LINE_PAIR
        else:
            layout = op.arg.n
        layouts[code] = layout
        if layout >= 0 and op.name not in ("STOP", "LONG_BINPUT"):
            steps[code] = 1 + layout
    return layouts, steps


_LAYOUT, _STEP = _opcode_tables()
#: Opcodes whose argument is one length byte and that many bytes (short strings and bytes, the
#: most common of the variable-length ones): tested right after the fixed-size ones.
_SHORT = [layout == _LEN1 for layout in _LAYOUT]
_PUT, _LONG_BINPUT, _STOP = (ord(c) for c in ("p", "r", "."))


def pickle_end(data: bytes, start: int = 0) -> int:
    """The offset just past the ``STOP`` of the pickle that begins at ``data[start]``.

    Raises :class:`MalformedPickle` for a byte that is no opcode, a pickle cut short, or a memo
    index that could not come from a real pickler (one at or beyond ``len(data)``: a pickle
    memoizes at most one object per opcode). What passes may still fail to unpickle (a class
    that does not exist, a stack that does not add up), but unpickling it costs time and memory
    in proportion to its size.
    """
    size = len(data)
    step = _STEP
    short = _SHORT
    i = start
    try:
        while i < size:
            code = data[i]
            n = step[code]
            if n:
                i += n
                continue
            if short[code]:
                i += 2 + data[i + 1]
                continue
            layout = _LAYOUT[code]
            if layout is None:
                raise MalformedPickle(f"byte {i} is not a pickle opcode")
            if code == _STOP:
                return i + 1
            if code == _LONG_BINPUT:
                if int.from_bytes(data[i + 1 : i + 5], "little") >= size:
                    raise MalformedPickle(f"the memo index at byte {i} is too big")
                i += 5
            elif layout in (_LINE, _LINE_PAIR):
                end = data.find(b"\n", i + 1)
                if layout == _LINE_PAIR and end >= 0:
                    end = data.find(b"\n", end + 1)
                if end < 0:
                    break
                line = data[i + 1 : end]
                if code == _PUT and not (line.isdigit() and int(line) < size):
                    raise MalformedPickle(f"the memo index at byte {i} is too big")
                if layout == _LINE_PAIR and not _is_utf8(line):
                    raise MalformedPickle(f"the class named at byte {i} is not UTF-8 text")
                i = end + 1
            else:
                width = _WIDTH[layout]
                length = int.from_bytes(
                    data[i + 1 : i + 1 + width], "little", signed=layout == _LEN4S
                )
                if length < 0:
                    break
                i += 1 + width + length
    except IndexError:  # a length byte past the end
        pass
    raise MalformedPickle(f"cut short (no STOP after byte {start})")


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
