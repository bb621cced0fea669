"""Store records the bus never wrote, planted byte by byte in a stopped server's store.

A ZODB record is two pickles: the class of the object, then its state. Each payload here is the
opcodes of one value (no PROTO, no STOP), and :func:`root_record` makes it the value of the key
``"planted"`` of a root PersistentMapping, as ZODB would lay out ``root["planted"] = value``
(protocol 3). :func:`plant_root` writes such a record as the root of a new store directory of
either durable kind, without ZODB reading anything.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import ZODB.FileStorage
import ZODB.utils
from ZODB.Connection import TransactionMetaData

from aaabus.core.logstorage import LogStorage
from aaabus.core.store import FILE_NAME, LOG_DIR

PROTO = b"\x80\x03"
ROOT_CLASS = PROTO + b"cpersistent.mapping\nPersistentMapping\n."


def ops(value: Any) -> bytes:
    """The opcodes that push ``value`` (plain data), as the pickler writes them."""
    return pickle.dumps(value, 3)[2:-1]


def glob(module: str, name: str) -> bytes:
    """GLOBAL ``module.name``."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def call(callee: bytes, *args: Any) -> bytes:
    """REDUCE: ``callee`` (opcodes) called with ``args`` (plain data)."""
    return callee + ops(args) + b"R"


def root_record(payload: bytes, class_pickle: bytes = ROOT_CLASS) -> bytes:
    """A root record whose mapping holds ``payload`` under "planted"."""
    state = PROTO + b"}" + ops("data") + b"}" + ops("planted") + payload + b"ss."
    return class_pickle + state


def plant_root(kind: str, storage: Path, record: bytes) -> None:
    """Write ``record`` as the root of a new ``kind`` store ("log" or "file") in ``storage``."""
    storage.mkdir(mode=0o700)
    store: Any = (
        LogStorage(storage / LOG_DIR)
        if kind == "log"
        else ZODB.FileStorage.FileStorage(str(storage / FILE_NAME))
    )
    try:
        txn = TransactionMetaData()
        store.tpc_begin(txn)
        store.store(ZODB.utils.z64, ZODB.utils.z64, record, "", txn)
        store.tpc_vote(txn)
        store.tpc_finish(txn)
    finally:
        store.close()


# -- the payloads of the attack review (issue 30) --------------------------------------------


def walk_to_function(marker: str | os.PathLike[str]) -> bytes:
    """Walks from a trusted class to FunctionType and CodeType
    (``PersistentMapping.__init__.__class__``, ``...__code__.__class__``), builds a function of
    its own and calls it: the function touches ``marker``."""
    source = f"def f():\n    __import__('pathlib').Path({os.fspath(marker)!r}).touch()\n"
    space: dict[str, Any] = {}
    exec(source, space)
    c = space["f"].__code__
    fields = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals,
              c.co_stacksize, c.co_flags, c.co_code, c.co_consts, c.co_names, c.co_varnames,
              c.co_filename, c.co_name, c.co_qualname, c.co_firstlineno, c.co_linetable,
              c.co_exceptiontable, c.co_freevars, c.co_cellvars)  # fmt: skip
    function_type = glob("persistent.mapping", "PersistentMapping.__init__.__class__")
    code_type = glob("persistent.mapping", "PersistentMapping.__init__.__code__.__class__")
    code = call(code_type, *fields)
    return function_type + code + b"}\x86R" + b")R"  # FunctionType(code, {})()


def walk_through_a_trusted_module(marker: str | os.PathLike[str]) -> bytes:
    """``subprocess.Popen(["touch", marker])``, reached through a trusted test module that
    imports subprocess (tests.support.tls)."""
    return call(glob("tests.support.tls", "subprocess.Popen"), ["touch", os.fspath(marker)])


#: Names a global of ``aaabus.__main__``: importing that module runs the command line.
MAIN_MODULE = glob("aaabus.__main__", "main")

#: BUILD on the class AgentId with the slot state {"parse": int}: ``setattr(AgentId, "parse",
#: int)``, for the whole process.
PARSE_BY_INT = glob("aaabus.model.ids", "AgentId") + b"N}" + ops("parse") + glob("builtins", "int")
PARSE_BY_INT += b"s\x86b"
#: The same with a value every server trusts (the class AgentId itself).
PARSE_BY_CLASS = PARSE_BY_INT.replace(glob("builtins", "int"), glob("aaabus.model.ids", "AgentId"))


def build_across_pickles() -> bytes:
    """A whole root record whose class pickle memoizes AgentId (then names the root's class, so
    that ZODB makes its ghost as usual) and whose state fetches AgentId from the memo (one
    unpickler loads both pickles) to BUILD it."""
    agent_id = glob("aaabus.model.ids", "AgentId")
    class_pickle = PROTO + agent_id + b"q\xc80" + ROOT_CLASS[len(PROTO) :]
    return root_record(b"h\xc8N}" + ops("parse") + b"h\xc8s\x86b", class_pickle)


_RANGE = glob("builtins", "range")

#: Allocation bombs: a few dozen bytes that ask for gigabytes when called by the plain types the
#: bus used to trust (2 GB, 1e9 ints).
BOMBS = {
    "bytearray(2e9)": call(glob("builtins", "bytearray"), 2_000_000_000),
    "bytes(2e9)": call(glob("builtins", "bytes"), 2_000_000_000),
    "list(range(1e9))": glob("builtins", "list") + call(_RANGE, 10**9) + b"\x85R",
    "deque(range(1e9))": glob("collections", "deque") + call(_RANGE, 10**9) + b"\x85R",
    "Counter(range(1e9))": glob("collections", "Counter") + call(_RANGE, 10**9) + b"\x85R",
    "set(1e9)": call(glob("builtins", "set"), 10**9),
    "Fraction(1e999999999)": call(glob("fractions", "Fraction"), "1e999999999"),
    "_codecs.encode(utf-7)": call(glob("_codecs", "encode"), "+" * 64, "utf-7"),
    "copyreg._reconstructor(bytearray)": call(
        glob("copyreg", "_reconstructor"), bytearray, bytearray, 2_000_000_000
    ),
}
