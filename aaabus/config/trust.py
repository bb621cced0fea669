"""Which classes a pickle may construct on this server: least privilege for unpickling.

A pickle is a program: each global it names (``GLOBAL``/``STACK_GLOBAL``) is looked up with
``find_class`` and may then be *called* with arguments of the pickle's choosing (``REDUCE``,
``NEWOBJ``), and ``BUILD`` sets attributes on whatever it is given. What remains of pickle in the
bus is its store (ZODB records are pickles by nature) and agents by value. :class:`TrustPolicy`
decides what a record may *name* (``find_class``); :mod:`aaabus.core.records` walks each record
with it before any of it is unpickled, to refuse also what the record would *do* with those
names. A refusal is :class:`UntrustedClass`, one line naming the global or opcode at fault.

What a pickle may name
    * exact classes: ``module.Name`` where ``Name`` is in the module's own namespace and is a
      class whose ``__module__`` and ``__qualname__`` are exactly those (no attribute walk: a
      dotted name, a nested class, a re-export from another module, a function are refused),
      or whose *home* (:func:`home_of`) is that module;
    * the standard library's plain data the bus's records and agents hold (:data:`PLAIN`): a
      class whose construction can only cost what its arguments hold (``datetime``,
      ``Decimal``, ``UUID``...), else a wrapper that checks its arguments first (``bytearray``,
      ``set``, ``deque``...: materialised values of the pickle only, never a size or an
      iterator), so that a few bytes cannot ask for gigabytes;
    * the persistence classes a store is made of (``persistent``, ``BTrees``: their
      ``Persistent`` subclasses);
    * the bus's own classes that carry data: in ``aaabus.*``, classes deriving from
      :class:`~aaabus.model.notifications.Notification`, :class:`persistent.Persistent` (agents and
      store records), ``tuple`` (ids, messages) or :class:`enum.Enum`, and nothing else;
    * the classes named by property ``aaabus.trust``: comma-separated entries, each a module
      prefix (``myapp`` trusts ``myapp`` and ``myapp.*``) or a qualified class name
      (``myapp.notes.Ping``). Without the property, the modules of the boot services (of any
      server of the config) are trusted.

What a pickle may make the server import
    Importing a module runs it (``aaabus.__main__`` is the command line). A module already
    imported is looked up as it is; one that is not is imported only if it is trusted (an entry
    of ``aaabus.trust``, ``persistent``, ``BTrees``) or one of aaabus's packages of stored
    classes (:data:`_OWN_IMPORTABLE`); a ``__main__`` module never.

What a pickle may do with them
    Not this module's call (it sees one name at a time): :mod:`aaabus.core.records` walks a
    record first (:func:`aaabus.wire.pickles.vet_pickles`): no ``BUILD`` (nor append, nor set
    item) on a class, no call of anything but a named class, no ``INST``/``OBJ``.

A class's home
    Where a class is defined (``__module__``) is not always where its package publishes it, and
    it moves between Python versions: ``pathlib.Path`` is defined in ``pathlib`` up to 3.12 and
    in ``pathlib._local`` from 3.13, which is what a 3.13 pickle names. A class's home
    (:func:`home_of`) is its public module: ``__module__`` less the private submodules at its
    end whose package holds the very same class under the same name (``pathlib`` for
    ``pathlib.Path`` on every version), else ``__module__`` itself. A record may name a class by
    either, so a store written on 3.12 (``pathlib.Path``) opens on 3.13 (the way back cannot
    work: 3.12 has no ``pathlib._local``); a re-export by any other module is refused, a refusal
    names the home, and a qualified ``aaabus.trust`` entry names the home
    (``pathlib.PurePosixPath`` trusts what a 3.12 and a 3.13 pickle name alike). The codec's tags
    (:func:`aaabus.wire.codec.tag_of`) keep ``__module__``: they name the bus's and the
    application's classes, registered under the same tag by the very code that encodes them.

By value
    Agents whose class cannot be imported by name travel *by value* (cloudpickle): the pickle
    carries the class's code. Loading one runs code chosen by the sender, which no allow-list can
    vet, so property ``aaabus.trust.by_value=true`` switches the checks off altogether for this
    server (off by default).

Threads: a policy is immutable after construction apart from its lookup cache (a dict filled
under the GIL with idempotent entries), so the engine, admin and store threads share one.
"""

from __future__ import annotations

import array
import collections
import datetime
import decimal
import enum
import importlib
import io
import pickle
import sys
import types
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from persistent import Persistent

from aaabus.errors import UntrustedClass
from aaabus.model.renames import current_path

if TYPE_CHECKING:
    from aaabus.config.reader import BusConfig

__all__ = ["PLAIN", "TrustPolicy", "UntrustedClass", "home_of", "policy_for"]


# -- the standard library's plain data -------------------------------------------------------
#
# What ZODB (protocol 3) writes for these: REDUCE(bytearray, (bytes,)), REDUCE(set, (list,)),
# REDUCE(deque, (list | (), maxlen)) then APPENDS, REDUCE(Counter, (dict,)),
# REDUCE(OrderedDict, ()) then SETITEMS, REDUCE(_array_reconstructor, (array, typecode,
# machine format, bytes)). Each wrapper accepts exactly those arguments: values the pickle holds
# (bytes, a list, a tuple, a dict: built by its own opcodes), never an int taken as a size nor a
# lazy iterable, so that what it allocates is what the pickle already holds.

_SEQUENCE = (list, tuple)
#: What the pickler names for an array at protocol 3 and above (not in the module's stubs).
_ARRAY_RECONSTRUCTOR = array._array_reconstructor  # type: ignore[attr-defined]


def _held(value: Any, types: tuple[type, ...], call: str) -> Any:
    """``value`` if it is exactly one of ``types``; raises UntrustedClass otherwise, naming the
    ``call`` (a format: ``{}`` is where the value's type goes)."""
    if type(value) not in types:
        raise UntrustedClass(
            f"refused to unpickle {call.format(type(value).__name__)}: it takes only "
            f"{' or '.join(t.__name__ for t in types)} the pickle holds"
        )
    return value


def _bytearray(data: bytes = b"") -> bytearray:
    return bytearray(_held(data, (bytes,), "builtins.bytearray({})"))


def _set(items: list[Any] | tuple[Any, ...] = ()) -> set[Any]:
    return set(_held(items, _SEQUENCE, "builtins.set({})"))


def _frozenset(items: list[Any] | tuple[Any, ...] = ()) -> frozenset[Any]:
    return frozenset(_held(items, _SEQUENCE, "builtins.frozenset({})"))


def _deque(
    items: list[Any] | tuple[Any, ...] = (), maxlen: int | None = None
) -> collections.deque[Any]:
    _held(maxlen, (int, type(None)), "collections.deque(maxlen={})")
    return collections.deque(_held(items, _SEQUENCE, "collections.deque({})"), maxlen)


def _counter(counts: dict[Any, int]) -> collections.Counter[Any]:
    return collections.Counter(_held(counts, (dict,), "collections.Counter({})"))


def _ordered_dict() -> collections.OrderedDict[Any, Any]:
    return collections.OrderedDict()  # its items follow as SETITEMS


def _array_reconstructor(
    arraytype: type, typecode: str, mformat_code: int, items: bytes
) -> array.array[Any]:
    if arraytype is not array.array:
        raise UntrustedClass(
            "refused to unpickle array._array_reconstructor for "
            f"{getattr(arraytype, '__qualname__', type(arraytype).__name__)}: array.array only"
        )
    _held(typecode, (str,), "array._array_reconstructor(typecode={})")
    _held(mformat_code, (int,), "array._array_reconstructor(mformat_code={})")
    _held(items, (bytes,), "array._array_reconstructor(items={})")
    return _ARRAY_RECONSTRUCTOR(array.array, typecode, mformat_code, items)


#: Module -> name -> what a pickle naming it gets: the class itself where building it costs no
#: more than its arguments (fixed-size values, a string parsed once), else a wrapper above.
#: Nothing else of the standard library: ``range``, ``bytes(n)``, ``list``, ``Fraction``, the
#: ``copyreg``/``_codecs`` helpers of protocols 0-2 are not written by ZODB for the bus's records
#: and are refused (a pickle spells lists, dicts, tuples and bytes with its own opcodes).
PLAIN: dict[str, dict[str, Any]] = {
    "builtins": {
        "bytearray": _bytearray,
        "complex": complex,
        "frozenset": _frozenset,
        "set": _set,
    },
    "collections": {"Counter": _counter, "OrderedDict": _ordered_dict, "deque": _deque},
    "datetime": {
        cls.__name__: cls
        for cls in (
            datetime.date,
            datetime.datetime,
            datetime.time,
            datetime.timedelta,
            datetime.timezone,
        )
    },
    "decimal": {"Decimal": decimal.Decimal},
    "uuid": {"UUID": uuid.UUID, "SafeUUID": uuid.SafeUUID},
    "array": {"array": array.array, "_array_reconstructor": _array_reconstructor},
}

#: Packages whose classes make up a ZODB store.
_PERSISTENCE = ("persistent", "BTrees")

#: aaabus's packages that define the classes it stores (agents, queues, clocks, topics, MQTT
#: sessions, the agents of its test workloads): a record may make the server import them.
#: Importing one only defines classes; the rest of aaabus (the command line, the tools) is never
#: imported because a pickle names it.
_OWN_IMPORTABLE = (
    "aaabus.model",
    "aaabus.core",
    "aaabus.wire",
    "aaabus.topics",
    "aaabus.mqtt.sessions",
    "aaabus.mqtt.roaming",
    "aaabus.testing",
)

#: ``__new__`` methods of builtins that copy their argument (or take an int as a size): NEWOBJ
#: calls a class's ``__new__`` with the pickle's arguments, so a class that inherits one of these
#: would copy whatever the pickle hands it, as often as it is asked.
_COPYING_NEW = (tuple.__new__, frozenset.__new__, bytes.__new__, str.__new__)

_FIX = "add its module to property aaabus.trust if the application means it (docs/config.md)"


def _in(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def home_of(cls: type) -> str:
    """The public module of ``cls`` (module docstring, "A class's home"): its ``__module__``
    less the private submodules at its end (``_local``, not ``__main__``) whose package, already
    imported, holds ``cls`` itself under its ``__qualname__``. Imports nothing."""
    module = cls.__module__
    while True:
        package, _, last = module.rpartition(".")
        if not package or not last.startswith("_") or last.startswith("__"):
            return module
        loaded = sys.modules.get(package)
        if (
            not isinstance(loaded, types.ModuleType)
            or vars(loaded).get(cls.__qualname__) is not cls
        ):
            return module
        module = package


def _is_main(module: str) -> bool:
    """``__main__`` or ``pkg.__main__``: a program, which importing runs."""
    return module == "__main__" or module.endswith(".__main__")


class TrustPolicy:
    """The allow-list of one server (see the module docstring).

    ``trusted``: entries of ``aaabus.trust`` (module prefixes or ``module.Class`` names);
    ``by_value``: load anything, cloudpickled code included.
    """

    def __init__(self, trusted: Iterable[str] = (), *, by_value: bool = False) -> None:
        self.trusted = tuple(t for t in trusted if t)
        self.by_value = by_value
        self._cache: dict[tuple[str, str], Any] = {}
        # The unpickler of this policy: a class whose find_class *is* this policy's, so that a
        # load runs no Python __init__ and each global costs one Python call, not two. A fresh
        # instance per load (never a shared one: no state, memo included, outlives its pickle).
        self._unpickler: type[pickle.Unpickler] = type(
            "_PolicyUnpickler", (pickle.Unpickler,), {"find_class": staticmethod(self.find_class)}
        )

    def find_class(self, module: str, name: str) -> Any:
        """What a pickle naming ``module.name`` gets if trusted; raises :class:`UntrustedClass`
        otherwise."""
        key = (module, name)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._resolve(module, name)
        return found

    def _resolve(self, module: str, name: str) -> Any:
        # A class that moved is resolved where it is now, by the same rules (a record or a frame
        # of an earlier version names it by its old path: aaabus.model.renames).
        module, name = current_path(module, name)
        if self.by_value:
            return _lookup(module, name)
        what = f"{module}.{name}"
        if "." in name:
            raise UntrustedClass(
                f"refused to unpickle {what}: a dotted name (only classes defined at the top "
                "level of their module are loaded; nested classes are not supported)"
            )
        if _is_main(module):
            raise UntrustedClass(
                f"refused to unpickle {what}: a __main__ module is a program and is never "
                "imported by name; define the class in a module the servers import"
            )
        plain = PLAIN.get(module)
        if plain is not None:
            if name in plain:
                return plain[name]
        elif _in(module, _PERSISTENCE):
            cls = self._class(module, name)
            if issubclass(cls, Persistent):
                return cls
        elif _in(module, ("aaabus",)):
            cls = self._class(module, name)
            if _own_data_class(cls):
                return cls
        elif _in(module, self.trusted) or what in self.trusted or self._trusted_home(module, name):
            return self._class(module, name)
        raise UntrustedClass(f"refused to unpickle {what}: not trusted here; {_FIX}")

    def _class(self, module: str, name: str) -> type:
        """The class ``module.name`` exactly as named, importing ``module`` only if allowed."""
        what = f"{module}.{name}"
        loaded = sys.modules.get(module)
        if loaded is None:
            if not self._importable(module):
                raise UntrustedClass(
                    f"refused to unpickle {what}: module {module} is not loaded here, and a "
                    f"pickle may import only trusted modules; {_FIX}"
                )
            loaded = _import(module, what)
        found = vars(loaded).get(name) if isinstance(loaded, types.ModuleType) else None
        if not isinstance(found, type):
            kind = "no such name" if found is None else f"a {type(found).__name__}, not a class"
            raise UntrustedClass(f"refused to unpickle {what}: {kind} (only classes are loaded)")
        if found.__qualname__ != name or module not in (found.__module__, home_of(found)):
            raise UntrustedClass(
                f"refused to unpickle {what}: it is {home_of(found)}.{found.__qualname__} "
                "(a class is loaded under its own name only)"
            )
        if found.__new__ in _COPYING_NEW:
            raise UntrustedClass(
                f"refused to unpickle {what}: it is built by {found.__new__.__qualname__}, "
                "which copies its argument (give the class a __new__ of its own, as "
                "NamedTuple does)"
            )
        return found

    def _trusted_home(self, module: str, name: str) -> bool:
        """Whether ``module.name``, a class already imported, has its home named by a qualified
        ``aaabus.trust`` entry: the entry holds whichever module a version defines it in."""
        loaded = sys.modules.get(module)
        found = vars(loaded).get(name) if isinstance(loaded, types.ModuleType) else None
        return isinstance(found, type) and f"{home_of(found)}.{name}" in self.trusted

    def _importable(self, module: str) -> bool:
        return _in(module, (*_PERSISTENCE, *_OWN_IMPORTABLE, *self.trusted)) or any(
            t.startswith(module + ".") for t in self.trusted
        )

    def loads(self, data: bytes) -> Any:
        """Unpickle ``data``, constructing only what :meth:`find_class` allows.

        Raises :class:`UntrustedClass` (naming the global) before anything is built from it,
        or what :mod:`pickle` raises for bytes that are not a valid pickle. Names only: what the
        pickle does with them is not vetted here (a store's records are, by
        :mod:`aaabus.core.records`); under ``by_value`` nothing is checked.
        """
        if self.by_value:
            return pickle.loads(data)
        return self._unpickler(io.BytesIO(data)).load()

    def check_record(self, data: bytes) -> None:
        """Load a ZODB record (class pickle, then state pickle) as a check, its references to
        other records unfollowed: what only a load can refuse (the wrappers of :data:`PLAIN`
        refuse their arguments when called). For a record already vetted
        (:func:`aaabus.core.records.vet_record`). Nothing to check under ``by_value``."""
        if self.by_value:
            return
        # One unpickler for both pickles, as ZODB's reader: the state may fetch what the class
        # pickle memoized (the class of a persistent reference, typically).
        unpickler = self._unpickler(io.BytesIO(data))
        unpickler.persistent_load = _unfollowed  # type: ignore[method-assign]
        unpickler.load()
        unpickler.load()

    def may_import(self, module: str) -> bool:
        """Whether a body naming a type of ``module`` (not imported yet) may make this server
        import it: the same rule as for a store's records -- aaabus's packages of data classes
        or a module its operator trusts (``aaabus.trust``), never a ``__main__``."""
        parts = module.split(".")
        return "__main__" not in parts and (
            _in(module, (*_OWN_IMPORTABLE, *self.trusted))
            or any(t.startswith(module + ".") for t in self.trusted)
        )

    def zodb_class_factory(self, _connection: Any, module: str, name: str) -> Any:
        """``class_factory`` for :class:`ZODB.DB`: a store's records obey the same list."""
        return self.find_class(module, name)


def _unfollowed(_reference: Any) -> None:
    return None


def _import(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise UntrustedClass(
            f"cannot unpickle {what}: module not importable ({type(exc).__name__}: {exc})"
        ) from None


def _lookup(module: str, name: str) -> Any:
    """By value only (where a pickle is code anyway): ``module.name`` as pickle resolves it."""
    obj: Any = _import(module, f"{module}.{name}")
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UntrustedClass(f"cannot unpickle {module}.{name}: no such name")
    return obj


def _own_data_class(obj: type) -> bool:
    # Imported here: notifications imports nothing of this module, but keep the import graph
    # shallow for the wire-level modules that use a policy.
    from aaabus.model.notifications import Notification

    return issubclass(obj, (Notification, Persistent, tuple, enum.Enum))


def policy_for(config: BusConfig, server_id: int | None) -> TrustPolicy:
    """The policy of ``server_id`` from properties ``aaabus.trust`` and ``aaabus.trust.by_value``
    (both checked when the config was read, see :mod:`aaabus.config.settings`)."""
    entries: tuple[str, ...] | None = config.setting(server_id, "aaabus.trust")
    if entries is None:
        # The application's own code: the modules its boot services come from, on any server
        # (a service on server 0 deploys agents and sends notifications of its module to all).
        entries = tuple(
            sorted(
                {s.cls.partition(":")[0] for srv in config.servers.values() for s in srv.services}
            )
        )
    by_value: bool = config.setting(server_id, "aaabus.trust.by_value")
    return TrustPolicy(entries, by_value=by_value)
