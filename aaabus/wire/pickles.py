"""What can be known of pickle bytes without unpickling them.

:func:`pickle_end` walks a pickle's opcodes, building nothing, and says where it ends. The walk
is linear in the bytes and cannot allocate more than it reads, so it is safe on garbage; it is
used to vet notification bodies before they are unpickled (:func:`aaabus.wire.message.vet_body`) and
to check the records of a store at boot (:mod:`aaabus.core.store`).

:func:`vet_pickles` goes further: it follows the unpickler's stack symbolically, still building
nothing, to refuse what the restricted loader (:mod:`aaabus.config.trust`) cannot see through
``find_class`` alone: a ``BUILD`` (or an append, a set item) whose target is a class named by the
pickle, which would change that class for the whole process; a call of anything but a global the
pickle named; and the opcodes the bus never writes (``INST``, ``OBJ``, extensions, out-of-band
buffers). Every global it meets is handed to a callback first, so that an untrusted one is
refused before anything of the pickle has run.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable

from aaabus.errors import MalformedPickle, UntrustedClass

__all__ = ["pickle_end", "vet_pickles"]

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
_CODE = {op.name: ord(op.code.encode("latin-1")) for op in pickletools.opcodes}


def _opcode_tables() -> tuple[list[int | None], list[int]]:
    """Per byte value: its argument layout (None: not an opcode), and how far a plain opcode
    moves (itself and a fixed-size argument; 0 for those that need a closer look)."""
    layouts: list[int | None] = [None] * 256
    steps = [0] * 256
    for op in pickletools.opcodes:
        code = _CODE[op.name]
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
_OP_PUT, _OP_LONG_BINPUT, _OP_STOP = _CODE["PUT"], _CODE["LONG_BINPUT"], _CODE["STOP"]


def _arg_end(data: bytes, i: int, layout: int) -> int:
    """Where the variable-length argument of the opcode at ``data[i]`` ends (past its newline
    for the line layouts); -1 when no newline follows or a length is negative."""
    if layout in (_LINE, _LINE_PAIR):
        end = data.find(b"\n", i + 1)
        if layout == _LINE_PAIR and end >= 0:
            end = data.find(b"\n", end + 1)
        return end + 1 if end >= 0 else -1
    width = _WIDTH[layout]
    length = int.from_bytes(data[i + 1 : i + 1 + width], "little", signed=layout == _LEN4S)
    return i + 1 + width + length if length >= 0 else -1


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
            if code == _OP_STOP:
                return i + 1
            if code == _OP_LONG_BINPUT:
                _check_memo_index(data, i, int.from_bytes(data[i + 1 : i + 5], "little"))
                i += 5
                continue
            end = _arg_end(data, i, layout)
            if end < 0:
                break
            if code == _OP_PUT:
                _check_memo_index(data, i, _line_index(data, i, end))
            elif layout == _LINE_PAIR and not _is_utf8(data[i + 1 : end]):
                raise MalformedPickle(f"the class named at byte {i} is not UTF-8 text")
            i = end
    except IndexError:  # a length byte past the end
        pass
    raise MalformedPickle(f"cut short (no STOP after byte {start})")


def _line_index(data: bytes, i: int, end: int) -> int:
    """The memo index written as decimal text on the line of the opcode at ``data[i]``; -1 if
    the line is not digits."""
    line = data[i + 1 : end - 1]
    return int(line) if line.isdigit() and len(line) < 20 else -1


def _check_memo_index(data: bytes, i: int, index: int) -> None:
    """A memo index at or beyond ``len(data)`` cannot come from a real pickler (it memoizes at
    most one object per opcode) and would make the unpickler size its memo to it."""
    if not 0 <= index < len(data):
        raise MalformedPickle(f"the memo index at byte {i} is too big")


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- the symbolic walk -----------------------------------------------------------------------
#
# The walk keeps the unpickler's two stacks as the C unpickler does (values, and the positions of
# the marks; a value below the latest mark cannot be popped: the "fence") and its memo, but each
# slot holds only what matters here: None (a value), a str (a global, "module.name"), or an int
# (the offset of a str literal: STACK_GLOBAL takes its module and name from two of them). A slot
# costs one reference, so the walk allocates in proportion to the opcodes it read.

_Slot = str | int | None

(
    _VALUE,  # pushes a value built from its argument alone
    _TEXT,  # pushes a str literal
    _NOTHING,  # PROTO, FRAME: no effect on the stacks
    _MARK,
    _POP,
    _POP_MARK,
    _DUP,
    _GET,
    _PUT,
    _MEMOIZE,
    _COLLECT,  # TUPLE, LIST, DICT, FROZENSET: the values above the mark into one
    _TUPLE_N,  # TUPLE1..3
    _INTO,  # APPEND, SETITEM: one or two values into the value below them
    _INTO_MARKED,  # APPENDS, SETITEMS, ADDITEMS: the values above the mark into the one below
    _BUILD,
    _CALL,  # REDUCE, NEWOBJ, NEWOBJ_EX
    _GLOBAL,
    _STACK_GLOBAL,
    _BINPERSID,
    _STOP,
    _REFUSED,
) = range(1, 22)

_ACTIONS = {
    _VALUE: "INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING "
    "BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 NONE NEWTRUE NEWFALSE UNICODE FLOAT BINFLOAT "
    "EMPTY_LIST EMPTY_TUPLE EMPTY_DICT EMPTY_SET PERSID",
    _TEXT: "SHORT_BINUNICODE BINUNICODE BINUNICODE8",
    _NOTHING: "PROTO FRAME",
    _MARK: "MARK",
    _POP: "POP",
    _POP_MARK: "POP_MARK",
    _DUP: "DUP",
    _GET: "GET BINGET LONG_BINGET",
    _PUT: "PUT BINPUT LONG_BINPUT",
    _MEMOIZE: "MEMOIZE",
    _COLLECT: "TUPLE LIST DICT FROZENSET",
    _TUPLE_N: "TUPLE1 TUPLE2 TUPLE3",
    _INTO: "APPEND SETITEM",
    _INTO_MARKED: "APPENDS SETITEMS ADDITEMS",
    _BUILD: "BUILD",
    _CALL: "REDUCE NEWOBJ NEWOBJ_EX",
    _GLOBAL: "GLOBAL",
    _STACK_GLOBAL: "STACK_GLOBAL",
    _BINPERSID: "BINPERSID",
    _STOP: "STOP",
    # Never written by ZODB nor by the pickler for the bus's data: INST and OBJ call a class
    # with arguments (the old protocols' spelling of REDUCE), extensions name globals through a
    # process-wide registry, and buffers come from outside the pickle.
    _REFUSED: "INST OBJ EXT1 EXT2 EXT4 NEXT_BUFFER READONLY_BUFFER",
}


def _walk_tables() -> tuple[list[int], list[int], list[int]]:
    """Per byte value: its walk action (0: not an opcode), how many values it takes from the
    stack besides a mark (TUPLE2: 2, APPEND: 1, REDUCE: 1, NEWOBJ_EX: 2), and how far it moves
    when its argument has a fixed size (0 otherwise)."""
    action = [0] * 256
    for act, names in _ACTIONS.items():
        for name in names.split():
            action[_CODE[name]] = act
    arity = [0] * 256
    for name, n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3), ("APPEND", 1), ("SETITEM", 2),
                    ("REDUCE", 1), ("NEWOBJ", 1), ("NEWOBJ_EX", 2)):  # fmt: skip
        arity[_CODE[name]] = n
    steps = [1 + layout if layout is not None and layout >= 0 else 0 for layout in _LAYOUT]
    return action, arity, steps


_ACTION, _ARITY, _WALK_STEP = _walk_tables()
#: Per byte value: the width of the unsigned length before its argument (strings, bytes), else 0.
_LENGTH_WIDTH = [1 if layout == _LEN1 else 4 if layout == _LEN4 else 8 if layout == _LEN8 else 0
                 for layout in _LAYOUT]  # fmt: skip
_NAME = {code: name for name, code in _CODE.items()}
_LONG_MEMO = (_CODE["LONG_BINGET"], _OP_LONG_BINPUT)


def vet_pickles(data: bytes, count: int, on_global: Callable[[str, str], object]) -> int:
    """Walk the ``count`` pickles at the start of ``data`` as one unpickler loading them in turn
    would (a fresh stack each, one memo for all: a ZODB record is two pickles written by one
    pickler, and its state may fetch what its class pickle memoized), building nothing; return
    the offset just past the last ``STOP``.

    ``on_global(module, name)`` is called for each global named, in order, and may raise to
    refuse it. Raises :class:`UntrustedClass` (naming the opcode, its byte and the global) for:
    a ``BUILD``, ``APPEND(S)``, ``SETITEM(S)`` or ``ADDITEMS`` whose target is a global; a
    ``REDUCE``, ``NEWOBJ`` or ``NEWOBJ_EX`` that calls anything but a global; a global used as a
    persistent id; ``INST``, ``OBJ``, ``EXT*`` and out-of-band buffers. Raises
    :class:`MalformedPickle` for bytes the unpickler would reject anyway (no opcode, cut short,
    a stack that does not add up, a memo entry never stored or too big to be real).

    Linear in the length walked; allocates a reference per opcode at most.
    """
    memo: dict[int, _Slot] = {}
    end = 0
    for _pickle in range(count):
        end = _walk(data, end, memo, on_global)
    return end


def _walk(
    data: bytes, start: int, memo: dict[int, _Slot], on_global: Callable[[str, str], object]
) -> int:
    """:func:`vet_pickles` for the one pickle at ``data[start]``; returns where it ends."""
    size = len(data)
    action_of, arity_of, step_of, width_of = _ACTION, _ARITY, _WALK_STEP, _LENGTH_WIDTH
    stack: list[_Slot] = []
    marks: list[int] = []
    fence = 0
    i = start
    try:
        while True:
            code = data[i]
            act = action_of[code]
            n = step_of[code]
            if n:
                end = i + n
            elif (width := width_of[code]) == 1:
                end = i + 2 + data[i + 1]
            elif width:
                end = i + 1 + width + int.from_bytes(data[i + 1 : i + 1 + width], "little")
            elif act:
                end = _arg_end(data, i, _LAYOUT[code])  # type: ignore[arg-type]
                if end < 0:
                    break
            else:
                raise MalformedPickle(f"byte {i} is not a pickle opcode")
            if end > size:
                break
            if act == _VALUE:
                stack.append(None)
            elif act == _PUT:
                if len(stack) <= fence:
                    raise _underflow(i, code)
                memo[data[i + 1] if n == 2 else _memo_index(data, i, code, end)] = stack[-1]
            elif act == _TEXT:
                stack.append(i)
            elif act == _GET:
                index = data[i + 1] if n == 2 else _memo_index(data, i, code, end)
                if index not in memo:
                    raise MalformedPickle(
                        f"{_NAME[code]} at byte {i} fetches memo {index}, never stored"
                    )
                stack.append(memo[index])
            elif act == _MEMOIZE:
                if len(stack) <= fence:
                    raise _underflow(i, code)
                memo[len(memo)] = stack[-1]
            elif act == _TUPLE_N:
                count = arity_of[code]
                if len(stack) - count < fence:
                    raise _underflow(i, code)
                stack[len(stack) - count :] = (None,)
            elif act == _CALL:
                count = arity_of[code]
                if len(stack) - count <= fence:
                    raise _underflow(i, code)
                callee = stack[-count - 1]
                if type(callee) is not str:
                    raise UntrustedClass(
                        f"refused to unpickle: {_NAME[code]} at byte {i} calls something the "
                        "pickle did not name as a global (only named classes may be called)"
                    )
                stack[len(stack) - count - 1 :] = (None,)
            elif act == _MARK:
                marks.append(len(stack))
                fence = len(stack)
            elif act == _INTO_MARKED:
                if not marks:
                    raise _underflow(i, code)
                mark = marks.pop()
                fence = marks[-1] if marks else 0
                if mark < len(stack):
                    if mark <= fence:
                        raise _underflow(i, code)
                    _refuse_global_target(stack[mark - 1], i, code)
                    del stack[mark:]
            elif act == _COLLECT:
                if not marks:
                    raise _underflow(i, code)
                mark = marks.pop()
                fence = marks[-1] if marks else 0
                del stack[mark:]
                stack.append(None)
            elif act in (_BUILD, _INTO):
                count = arity_of[code] or 1
                if len(stack) - count <= fence:
                    raise _underflow(i, code)
                _refuse_global_target(stack[-count - 1], i, code)
                del stack[len(stack) - count :]
            elif act == _GLOBAL:
                stack.append(_named_global(data, i, end, on_global))
            elif act == _STACK_GLOBAL:
                if len(stack) - 2 < fence:
                    raise _underflow(i, code)
                stack.append(_stacked_global(data, i, stack.pop(-2), stack.pop(), on_global))
            elif act == _NOTHING:
                pass
            elif act == _BINPERSID:
                if len(stack) <= fence:
                    raise _underflow(i, code)
                if type(stack[-1]) is str:
                    raise UntrustedClass(
                        f"refused to unpickle: BINPERSID at byte {i} takes the global "
                        f"{stack[-1]} as a persistent id"
                    )
                stack[-1] = None
            elif act == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                    fence = marks[-1] if marks else 0
                elif len(stack) <= fence:
                    raise _underflow(i, code)
                else:
                    stack.pop()
            elif act == _POP_MARK:
                if not marks:
                    raise _underflow(i, code)
                del stack[marks.pop() :]
                fence = marks[-1] if marks else 0
            elif act == _DUP:
                if len(stack) <= fence:
                    raise _underflow(i, code)
                stack.append(stack[-1])
            elif act == _STOP:
                if len(stack) <= fence:
                    raise _underflow(i, code)
                return end
            else:  # _REFUSED
                raise UntrustedClass(
                    f"refused to unpickle: opcode {_NAME[code]} at byte {i} (the bus never "
                    "writes it)"
                )
            i = end
    except IndexError:  # a length byte past the end
        pass
    raise MalformedPickle(f"cut short (no STOP after byte {start})")


def _underflow(i: int, code: int) -> MalformedPickle:
    return MalformedPickle(f"{_NAME[code]} at byte {i} takes more from the stack than it holds")


def _refuse_global_target(target: _Slot, i: int, code: int) -> None:
    """A BUILD or an append whose target is a class would change that class for the whole
    process (BUILD with a slot state sets its attributes): refused."""
    if type(target) is str:
        raise UntrustedClass(
            f"refused to unpickle: {_NAME[code]} at byte {i} would change the global {target} "
            "(a pickle may only fill in the objects it builds)"
        )


def _memo_index(data: bytes, i: int, code: int, end: int) -> int:
    """The index of the memo opcode at ``data[i]`` (a 4-byte or a text one: BINGET and BINPUT
    take theirs inline), checked as :func:`pickle_end` does."""
    index = (
        int.from_bytes(data[i + 1 : i + 5], "little")
        if code in _LONG_MEMO
        else _line_index(data, i, end)
    )
    _check_memo_index(data, i, index)
    return index


def _named_global(data: bytes, i: int, end: int, on_global: Callable[[str, str], object]) -> str:
    """The global of the GLOBAL opcode at ``data[i]`` ("module\\nname\\n"), vetted."""
    module, _, name = data[i + 1 : end - 1].partition(b"\n")
    try:
        return _vetted(module.decode("utf-8"), name.decode("utf-8"), on_global)
    except UnicodeDecodeError:
        raise MalformedPickle(f"the class named at byte {i} is not UTF-8 text") from None


def _stacked_global(
    data: bytes,
    i: int,
    module: _Slot,
    name: _Slot,
    on_global: Callable[[str, str], object],
) -> str:
    """The global of the STACK_GLOBAL at ``data[i]``, from the two str literals below it."""
    if type(module) is not int or type(name) is not int:
        raise MalformedPickle(f"STACK_GLOBAL at byte {i} does not name its global with two str")
    try:
        return _vetted(_text_at(data, module), _text_at(data, name), on_global)
    except UnicodeDecodeError:
        raise MalformedPickle(f"the global named at byte {i} is not UTF-8 text") from None


def _text_at(data: bytes, i: int) -> str:
    """The str literal pushed by the opcode at ``data[i]`` (SHORT_BINUNICODE, BINUNICODE or
    BINUNICODE8), decoded as the unpickler decodes it."""
    width = _WIDTH[_LAYOUT[data[i]]]  # type: ignore[index]
    length = int.from_bytes(data[i + 1 : i + 1 + width], "little")
    return data[i + 1 + width : i + 1 + width + length].decode("utf-8", "surrogatepass")


def _vetted(module: str, name: str, on_global: Callable[[str, str], object]) -> str:
    on_global(module, name)
    return f"{module}.{name}"
