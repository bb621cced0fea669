"""Notifications as data: the encoding of everything that crosses a socket.

A pickle is a program (it names callables and calls them), so no byte that arrives from a peer or
a tool is ever unpickled unless the operator asked for it (property ``aaabus.wire.pickle``). What
travels instead is MessagePack, through :mod:`msgspec`, in a form that cannot name a callable:

``body = [tag, {field: value, ...}]``
    ``tag`` is ``"module:QualName"`` of a dataclass subclass of
    :class:`~aaabus.model.notifications.Notification`. Decoding looks the tag up among the types
    *registered in this process* (every such class registers itself when its module is imported,
    :func:`aaabus.model.notifications.registered`), and builds only that class, each field
    checked against its annotation by msgspec (numbers, strings, bytes, containers, nested
    dataclasses, :class:`~aaabus.AgentId`, enums, dates...). Nothing is imported by name, except,
    on a server, a module its operator trusts (``may_import``), never a ``__main__``.

Fields whose annotation msgspec cannot decode exactly (``Any``, a field holding a notification
of any subclass, a union of dataclasses) are *dynamic*: their value is walked on the way out and
the few Python types that a plain MessagePack value would lose become extension values:

======  ==============================================================
code    value
======  ==============================================================
1       a notification (its own ``[tag, fields]`` body)
2       an :class:`~aaabus.AgentId`
3 / 4   a ``tuple`` / ``set`` (``frozenset`` is 5, ``bytearray`` 6)
7       an agent (``[tag, state]``; only in a deployment, see below)
8 / 9   a ``PersistentList`` / ``PersistentMapping`` (an agent's state)
10      a BTree, bucket or set of :mod:`BTrees` (``[class name, items]``)
======  ==============================================================

and on the way in they are checked against the annotation by :func:`conforms`. ``None``,
``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list`` and ``dict`` travel as themselves;
anything else under ``Any`` is refused at the send with a ``TypeError`` naming the field.

Agents deployed *by class* travel the same way (extension 7): the registered class's tag and the
agent's attribute dict, walked as a dynamic value. An agent whose class cannot be named (defined
in ``__main__`` or a function) can only travel *by value* (cloudpickle): that is code, loaded only
where the server's operator enabled it (docs/security.md).

Bodies that start with ``0x80`` are pickles (protocol 2 and up): written only when the bus opted
in to pickles on the wire and the value has no data form, read only by a codec built with
``pickles=True``. The two never collide: a data body is a MessagePack array of two (``0x92``).

Every refusal is a :class:`~aaabus.errors.BadBody` (a ``ValueError``) whose one line names the
type and the field. Decoding is linear in the input and allocates in proportion to it (msgspec
checks every length against the bytes left before allocating); nesting is bounded by Python's
recursion limit, and running into it is a refusal like any other.

Codecs are immutable once built (their caches hold idempotent entries, filled under the GIL):
one per server, shared by the engine, network and admin threads.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import types
import typing
from collections.abc import Callable
from typing import Any

import cloudpickle
import msgspec
from persistent.list import PersistentList
from persistent.mapping import PersistentMapping

from aaabus.errors import BadBody
from aaabus.model.agent import Agent, registered_agent
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification, registered
from aaabus.model.renames import current_tag

__all__ = ["Codec", "conforms", "encode_note", "is_pickle", "tag_of", "travels_by_name"]

_NOTE, _ID, _TUPLE, _SET, _FROZENSET, _BYTEARRAY, _AGENT, _PLIST, _PMAP, _BTREE = range(1, 11)
_PICKLE = 0x80  # the PROTO opcode every pickle of protocol >= 2 starts with
_SCALARS = frozenset([type(None), bool, int, float, str, bytes])

#: What msgspec raises for bytes that are not well-formed (bad UTF-8 is a ValueError of its own,
#: a number out of range an OverflowError, nesting past the recursion limit a RecursionError).
_MALFORMED = (msgspec.DecodeError, ValueError, OverflowError, RecursionError)

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])


def tag_of(cls: type) -> str:
    """The name a class travels under: ``module:QualName``."""
    return f"{cls.__module__}:{cls.__qualname__}"


class _Plan:
    """How one notification class is encoded and decoded (built on its first use)."""

    __slots__ = ("checked", "cls", "decoder", "dynamic", "hints", "out_fields", "tag")

    def __init__(self, cls: type, ext_hook: Callable[[int, memoryview], Any]) -> None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(
                f"notification {tag_of(cls)} is not a dataclass: decorate it with @dataclass "
                "(a notification travels as its fields, docs/tutorial.md)"
            )
        self.cls = cls
        self.tag = tag_of(cls)
        try:
            self.hints = typing.get_type_hints(cls)
        except Exception as exc:
            raise TypeError(
                f"notification {self.tag}: its annotations do not resolve ({exc})"
            ) from None
        fields = [f for f in dataclasses.fields(cls) if f.init]
        self.dynamic = frozenset(f.name for f in fields if _is_dynamic(self.hints[f.name]))
        # Per message, the fields walked on the way out (name, dynamic?) and the dynamic ones
        # checked on the way in (those under Any hold whatever decoded): worked out once here,
        # not per message (dataclasses.fields alone cost a microsecond).
        self.out_fields = tuple((f.name, f.name in self.dynamic) for f in fields)
        self.checked = tuple(
            (name, self.hints[name], checker(self.hints[name]))
            for name in sorted(self.dynamic)
            if self.hints[name] is not Any and self.hints[name] is not object
        )
        if not self.dynamic:
            # msgspec builds the dataclass itself, every field checked in C.
            self.decoder = msgspec.msgpack.Decoder(cls, ext_hook=ext_hook)
            return
        # A shadow struct: the same fields, the dynamic ones as Any (extension values decoded
        # by ext_hook), then conforms() against the real annotation.
        shadow: list[tuple[Any, ...]] = []
        for f in fields:
            wire_type = Any if f.name in self.dynamic else self.hints[f.name]
            if f.default is not dataclasses.MISSING:
                shadow.append((f.name, wire_type, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                shadow.append((f.name, wire_type, msgspec.field(default_factory=f.default_factory)))
            else:
                shadow.append((f.name, wire_type))
        ordered = [s for s in shadow if len(s) == 2] + [s for s in shadow if len(s) == 3]
        struct = msgspec.defstruct(f"_Wire_{cls.__name__}", ordered, kw_only=True)
        self.decoder = msgspec.msgpack.Decoder(struct, ext_hook=ext_hook)

    def fields_out(self, note: Any) -> Any:
        if not self.dynamic:
            return note
        out = {}
        for name, dynamic in self.out_fields:
            value = getattr(note, name)
            if dynamic:
                try:
                    value = _out(value)
                except TypeError as exc:
                    raise TypeError(f"notification {self.tag}, field {name!r}: {exc}") from None
            out[name] = value
        return out

    def build(self, decoded: Any) -> Any:
        if not self.dynamic:
            return decoded
        values = msgspec.structs.asdict(decoded)
        for name, hint, check in self.checked:
            if not check(values[name]):
                raise BadBody(
                    f"notification {self.tag} refused: field {name!r} holds a "
                    f"{type(values[name]).__name__}, not {_show(hint)}"
                )
        return self.cls(**values)


class Codec:
    """The data codec of one server (or tool).

    ``may_import(module)``: whether a module not imported yet may be imported to find a type
    named by a body (a server: the modules its operator trusts); by default nothing is imported.
    ``pickles``: the bus opted in to pickles on the wire (``aaabus.wire.pickle``): bodies with no
    data form are pickled, and pickled bodies are loaded -- which runs whatever code they name.
    """

    def __init__(
        self, *, may_import: Callable[[str], bool] | None = None, pickles: bool = False
    ) -> None:
        self.pickles = pickles
        self._may_import = may_import
        self._plans: dict[type, _Plan] = {}
        self._any = msgspec.msgpack.Decoder(ext_hook=self._ext)

    # -- notifications ----------------------------------------------------------------------------

    def encode(self, note: Notification) -> bytes:
        """The body of ``note``. Raises ``TypeError`` naming the class and field when it has
        no data form (not a dataclass, a value under ``Any`` of no data type) and the bus did
        not opt in to pickles."""
        cls = type(note)
        plan = self._plans.get(cls)
        try:
            if plan is None:
                plan = self._plan(cls)
            return _encoder.encode((plan.tag, plan.fields_out(note)))
        except (TypeError, OverflowError) as exc:
            if self.pickles:
                return cloudpickle.dumps(note, protocol=pickle.HIGHEST_PROTOCOL)
            if isinstance(exc, OverflowError):  # an int outside 64 bits
                raise TypeError(f"notification {tag_of(cls)}: {exc}") from None
            raise

    def decode(self, body: bytes | memoryview) -> Notification:
        """The notification in ``body``; raises :class:`BadBody` (one line naming the type and
        field) for anything else."""
        if body[:1] == b"\x80":
            return self._unpickle(body, Notification, "notification")
        try:
            tag, raw = _envelope.decode(body)
        except _MALFORMED as exc:
            raise BadBody(f"a notification body that does not decode: {_why(exc)}") from None
        plan = self._plan_for(tag)
        try:
            note = plan.build(plan.decoder.decode(raw))
        except BadBody:
            raise
        except msgspec.ValidationError as exc:
            raise BadBody(f"notification {tag} refused: {exc}") from None
        except _MALFORMED as exc:
            raise BadBody(f"notification {tag} does not decode: {_why(exc)}") from None
        except TypeError as exc:  # the class's own __init__/__post_init__
            raise BadBody(f"notification {tag} refused by its class: {exc}") from None
        return note

    # -- plain values (a publication's payload) ---------------------------------------------------

    def encode_value(self, value: Any) -> bytes:
        """``value`` as data (what ``Any`` carries, see the module docstring)."""
        try:
            return _encoder.encode(_out(value))
        except TypeError:
            if self.pickles:
                return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            raise

    def decode_value(self, data: bytes | memoryview) -> Any:
        if data[:1] == b"\x80":
            return self._unpickle(data, object, "value")
        try:
            return self._any.decode(data)
        except BadBody:
            raise
        except _MALFORMED as exc:
            raise BadBody(f"a value that does not decode: {_why(exc)}") from None

    # -- agents -----------------------------------------------------------------------------------

    def encode_agent(self, agent: Agent) -> bytes:
        """A deployment by class: the agent's class tag and its attributes, as data. Raises
        ``TypeError`` if the class has no name another process can import, or an attribute
        has no data form (say which; deploying by value is :func:`cloudpickle.dumps`)."""
        return _encoder.encode(_out(agent))

    def decode_agent(self, data: bytes | memoryview) -> Agent:
        """The agent of a deployment by class; raises :class:`BadBody` for anything else
        (a deployment by value is not data: see :func:`is_pickle`)."""
        agent = self.decode_value(data)
        if not isinstance(agent, Agent):
            raise BadBody(f"a deployment that is not an agent ({type(agent).__name__})")
        return agent

    # -- internals --------------------------------------------------------------------------------

    def _plan(self, cls: type) -> _Plan:
        if not (isinstance(cls, type) and issubclass(cls, Notification)):
            raise TypeError(f"{cls.__name__} is not an aaabus.Notification")
        plan = self._plans[cls] = _Plan(cls, self._ext)
        return plan

    def _plan_for(self, tag: str) -> _Plan:
        cls = self._registered(tag, registered, "notification")
        plan = self._plans.get(cls)
        if plan is None:
            try:
                plan = self._plan(cls)
            except TypeError as exc:
                raise BadBody(f"notification {tag} cannot be decoded here: {exc}") from None
        return plan

    def _registered(self, tag: str, lookup: Callable[[str], type | None], what: str) -> type:
        # A class that moved travels from a peer of an earlier version under its old tag.
        tag = current_tag(tag)
        cls = lookup(tag)
        if cls is None:
            module = tag.partition(":")[0]
            if (
                self._may_import is not None
                and _importable_name(module)
                and self._may_import(module)
            ):
                try:
                    __import__(module)
                except Exception as exc:
                    raise BadBody(
                        f"{what} type {tag}: its module does not import here "
                        f"({type(exc).__name__}: {exc})"
                    ) from None
                cls = lookup(tag)
            if cls is None:
                raise BadBody(
                    f"{what} type {tag!r} is not registered here: define it in a module the "
                    "servers import (and trust, property aaabus.trust)"
                )
        return cls

    def _ext(self, code: int, data: memoryview) -> Any:
        if code == _NOTE:
            return self.decode(data)
        if code == _ID:
            origin, server, stamp = _ids.decode(data)
            return AgentId(origin, server, stamp)
        if code == _AGENT:
            tag, state = _envelope.decode(data)
            cls = self._registered(tag, registered_agent, "agent")
            attributes = self._any.decode(state)
            if not isinstance(attributes, dict) or not all(isinstance(k, str) for k in attributes):
                raise BadBody(f"agent {tag}: its state is not a mapping of attribute names")
            agent: Any = cls.__new__(cls)  # type: ignore[call-overload]
            agent.__setstate__(attributes)
            return agent
        items = self._any.decode(data)
        if code == _BTREE:
            return _btree(items)
        if code == _PMAP:
            if not isinstance(items, dict):
                raise BadBody("a PersistentMapping that is not a mapping")
            return PersistentMapping(items)
        if not isinstance(items, list | bytes):
            raise BadBody(f"extension {code} that is not a sequence")
        maker = _MAKERS.get(code)
        if maker is None:
            raise BadBody(f"unknown extension type {code}")
        try:
            return maker(items)
        except TypeError as exc:  # an unhashable member of a set
            raise BadBody(f"extension {code} refused: {exc}") from None

    def _unpickle(self, data: bytes | memoryview, kind: type, what: str) -> Any:
        if not self.pickles:
            raise BadBody(
                f"a pickled {what} refused: this bus carries data only (pickles on the wire "
                "run code; property aaabus.wire.pickle, docs/security.md)"
            )
        obj = pickle.loads(data)
        if not isinstance(obj, kind):
            raise BadBody(f"a pickled {what} that is a {type(obj).__name__}")
        return obj


_ids = msgspec.msgpack.Decoder(tuple[int, int, int])
_MAKERS: dict[int, Callable[[Any], Any]] = {
    _TUPLE: tuple,
    _SET: set,
    _FROZENSET: frozenset,
    _BYTEARRAY: bytearray,
    _PLIST: PersistentList,
}


#: The BTrees classes an agent's state may hold, by name (``OOBTree``, ``LOBucket``, ``IOSet``...):
#: a fixed table, so that a body can name no other class through extension 10.
_BTREES: dict[str, type] = {
    f"{family}{kind}": getattr(importlib.import_module(f"BTrees.{family}BTree"), f"{family}{kind}")
    for family in ("OO", "IO", "OI", "II", "IF", "LO", "OL", "LL", "LF", "QQ", "OQ", "QO")
    for kind in ("BTree", "Bucket", "Set", "TreeSet")
}


def _btree(items: Any) -> Any:
    if not (isinstance(items, list) and len(items) == 2 and isinstance(items[1], list)):
        raise BadBody("a BTree that is not [class name, items]")
    cls = _BTREES.get(items[0]) if isinstance(items[0], str) else None
    if cls is None:
        raise BadBody(f"a BTree of unknown class {items[0]!r}")
    pairs = items[1]
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise BadBody(f"a {items[0]} whose items are not pairs")
    try:
        if hasattr(cls, "values"):
            return cls({k: v for k, v in pairs})
        return cls([k for k, _ in pairs])
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadBody(f"a {items[0]} refused: {exc}") from None


def is_pickle(data: bytes | memoryview) -> bool:
    """Whether ``data`` is a pickle rather than a data body (a deployment by value)."""
    return data[:1] == b"\x80"


def _ext(code: int, value: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, _encoder.encode(value))


def _out(value: Any) -> Any:
    """``value`` with every type MessagePack would lose turned into an extension value."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [_out(v) for v in value]
    if kind is dict:
        return {_out(k): _out(v) for k, v in value.items()}
    if kind is AgentId:
        return _ext(_ID, tuple(value))
    if kind is tuple:
        return _ext(_TUPLE, [_out(v) for v in value])
    if isinstance(value, Notification):
        return msgspec.msgpack.Ext(_NOTE, encode_note(value))
    if kind is set or kind is frozenset:
        return _ext(_SET if kind is set else _FROZENSET, [_out(v) for v in value])
    if kind is bytearray:
        return _ext(_BYTEARRAY, bytes(value))
    if isinstance(value, PersistentList):
        return _ext(_PLIST, [_out(v) for v in value])
    if isinstance(value, PersistentMapping):
        return _ext(_PMAP, {_out(k): _out(v) for k, v in value.items()})
    if isinstance(value, Agent):
        return msgspec.msgpack.Ext(_AGENT, _encode_agent_state(value))
    if _BTREES.get(kind.__name__) is kind:
        items = value.items() if hasattr(value, "values") else [(k, None) for k in value]
        return _ext(_BTREE, [kind.__name__, [[_out(k), _out(v)] for k, v in items]])
    raise TypeError(
        f"a {kind.__module__}.{kind.__qualname__} has no data form (plain data, AgentIds, "
        "notifications and persistent lists/mappings travel; annotate the field with its type "
        "for dataclasses, enums, dates...)"
    )


# One codec's plans serve every nested notification of _out (encoding needs no configuration
# but the pickle fallback, which applies to the outermost value only).
_DATA = Codec()


def encode_note(note: Notification) -> bytes:
    """The data body of ``note`` (no pickle fallback: ``TypeError`` if it has no data form)."""
    plan = _DATA._plans.get(type(note)) or _DATA._plan(type(note))
    return _encoder.encode((plan.tag, plan.fields_out(note)))


def travels_by_name(cls: type) -> bool:
    """Whether another process can find ``cls`` by its tag (else it can only travel by value):
    a class of a module that is not a ``__main__``, not defined in a function."""
    return _importable_name(cls.__module__) and "<locals>" not in cls.__qualname__


def _encode_agent_state(agent: Agent) -> bytes:
    cls = type(agent)
    tag = tag_of(cls)
    if not travels_by_name(cls):
        raise TypeError(
            f"agent class {tag} cannot be named by another process (defined in __main__ or in "
            "a function): move it to a module, or deploy it by value (docs/security.md)"
        )
    state = agent.__getstate__()
    if not isinstance(state, dict):
        raise TypeError(f"agent {tag} keeps attributes in __slots__, which do not travel")
    try:
        return _encoder.encode((tag, {k: _out(v) for k, v in state.items()}))
    except TypeError as exc:
        raise TypeError(f"agent {tag}: {exc}") from None


def _importable_name(module: str) -> bool:
    parts = module.split(".")
    return all(p.isidentifier() for p in parts) and "__main__" not in parts


def _is_dynamic(hint: Any) -> bool:
    """Whether msgspec cannot decode ``hint`` exactly by itself (see the module docstring)."""
    if hint is Any or hint is object:
        return True
    if isinstance(hint, type) and issubclass(
        hint, Notification | Agent | PersistentList | PersistentMapping
    ):
        return True
    args = typing.get_args(hint)
    if any(_is_dynamic(a) for a in args if a is not Ellipsis):
        return True
    try:
        msgspec.msgpack.Decoder(hint)
    except TypeError:
        return True
    return False


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (the annotations a dynamic field can have)."""
    return checker(hint)(value)


def checker(hint: Any) -> Callable[[Any], bool]:
    """The test :func:`conforms` applies for ``hint``, worked out once per hint: decoding checks
    every dynamic field of every message, and asking ``typing`` about the hint each time cost
    more than the check itself."""
    try:
        found = _CHECKERS.get(hint)
    except TypeError:  # an unhashable hint (a Literal of lists): not kept
        return _compile(hint)
    if found is None:
        found = _CHECKERS[hint] = _compile(hint)
    return found


_CHECKERS: dict[Any, Callable[[Any], bool]] = {}


def _compile(hint: Any) -> Callable[[Any], bool]:
    if hint is Any or hint is object:
        return _anything
    if hint is None or hint is type(None):
        return _is_none
    origin = typing.get_origin(hint)
    if origin is None:
        if hint is float:
            return _is_float
        if isinstance(hint, type):
            return lambda value: isinstance(value, hint)
        return _nothing
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        alternatives = tuple(checker(a) for a in args)
        return lambda value: any(check(value) for check in alternatives)
    if origin is typing.Literal:
        return lambda value: value in args
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        each = checker(args[0])
        if each is _anything:  # tuple[Any, ...]: no member to look at
            return lambda value: isinstance(value, tuple)
        return lambda value: isinstance(value, tuple) and all(each(v) for v in value)
    if origin is tuple:
        checks = tuple(checker(a) for a in args)
        return lambda value: (
            isinstance(value, tuple)
            and len(value) == len(checks)
            and all(check(v) for check, v in zip(checks, value, strict=True))
        )
    if origin in (list, set, frozenset) and args:
        each = checker(args[0])
        return lambda value: isinstance(value, origin) and all(each(v) for v in value)
    if origin is dict and args:
        keys, values = checker(args[0]), checker(args[1])
        return lambda value: (
            isinstance(value, dict) and all(keys(k) and values(v) for k, v in value.items())
        )
    return lambda value: isinstance(value, origin)


def _anything(value: Any) -> bool:
    return True


def _nothing(value: Any) -> bool:
    return False


def _is_none(value: Any) -> bool:
    return value is None


def _is_float(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _show(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _why(exc: BaseException) -> str:
    return str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
