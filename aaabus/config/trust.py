"""Which classes a pickle may construct on this server: least privilege for unpickling.

A pickle is a program: each global it names (``GLOBAL``/``STACK_GLOBAL``) is looked up with
``find_class`` and may then be *called* with arguments of the pickle's choosing (``REDUCE``,
``NEWOBJ``, ``BUILD``). Whoever can hand a server a pickle therefore runs whatever callable it can
name, ``os.system`` included. :class:`TrustPolicy` closes that door: every global a pickle names
is checked against an allow-list *before* anything is built, and a refused name ends the load with
:class:`UntrustedClass`, one line naming it.

What is trusted
    * plain data types of the standard library (:data:`PLAIN`): containers, numbers, dates,
      ``Decimal``, ``UUID``, and the three ``copyreg`` helpers the pickler emits for ordinary
      objects (they only call ``cls.__new__`` of a class that is itself checked);
    * the persistence classes a store is made of (``persistent``, ``BTrees``);
    * the bus's own classes that carry data: in ``aaabus.*``, classes deriving from
      :class:`~aaabus.model.notifications.Notification`, :class:`persistent.Persistent` (agents and
      store records), ``tuple`` (ids, messages) or :class:`enum.Enum`, and nothing else (a
      ``Network`` or an ``AgentServer`` opens sockets when constructed);
    * the classes named by property ``aaabus.trust``: comma-separated entries, each a module
      prefix (``myapp`` trusts ``myapp`` and ``myapp.*``) or a qualified class name
      (``myapp.notes.Ping``). Only *classes* are resolved this way, never functions.

    Without the property, the modules of the boot services (of any server of the config) are
    trusted: the application a config starts is trusted by the servers it starts on.

By value
    Agents and notifications whose class cannot be imported by name travel *by value*
    (cloudpickle): the pickle carries the class's code. Loading one runs code chosen by the
    sender, which no allow-list can vet, so property ``aaabus.trust.by_value=true`` switches the
    checks off altogether for this server (off by default).

Threads: a policy is immutable after construction apart from its lookup cache (a dict filled
under the GIL with idempotent entries), so the engine, admin and store threads share one.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from persistent import Persistent

from aaabus.errors import UntrustedClass

if TYPE_CHECKING:
    from aaabus.config.reader import BusConfig

__all__ = ["PLAIN", "TrustPolicy", "UntrustedClass", "policy_for"]

#: Module -> names of the standard library's plain data types (and copyreg helpers).
PLAIN: dict[str, frozenset[str]] = {
    "builtins": frozenset(
        [
            "bool",
            "bytearray",
            "bytes",
            "complex",
            "dict",
            "float",
            "frozenset",
            "int",
            "list",
            "range",
            "set",
            "slice",
            "str",
            "tuple",
        ]
    ),
    "collections": frozenset(["Counter", "OrderedDict", "defaultdict", "deque"]),
    "datetime": frozenset(["date", "datetime", "time", "timedelta", "timezone"]),
    "array": frozenset(["array", "_array_reconstructor"]),  # the clocks' pages
    "decimal": frozenset(["Decimal"]),
    "fractions": frozenset(["Fraction"]),
    "uuid": frozenset(["UUID", "SafeUUID"]),
    "copyreg": frozenset(["_reconstructor", "__newobj__", "__newobj_ex__"]),
    # Protocol-2 pickles spell bytes as _codecs.encode(text, "latin1"): a pure function.
    "_codecs": frozenset(["encode"]),
}

#: Packages whose classes make up a ZODB store.
_PERSISTENCE = ("persistent", "BTrees")

_FIX = "add its module to property aaabus.trust if the application means it (docs/config.md)"


def _in(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


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
        # instance per load (never a shared one: no state, memo included, outlives its pickle);
        # this halves the cost of loading a small notification (perf stream, ~5 -> ~2.5 us).
        self._unpickler: type[pickle.Unpickler] = type(
            "_PolicyUnpickler", (pickle.Unpickler,), {"find_class": staticmethod(self.find_class)}
        )

    def find_class(self, module: str, name: str) -> Any:
        """The class ``module.name`` if trusted; raises :class:`UntrustedClass` otherwise."""
        key = (module, name)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._resolve(module, name)
        return found

    def _resolve(self, module: str, name: str) -> Any:
        if self.by_value:
            return _lookup(module, name)
        what = f"{module}.{name}"
        if name in PLAIN.get(module, ()):
            return _lookup(module, name)
        if _in(module, _PERSISTENCE):
            obj = _lookup(module, name)
            if isinstance(obj, type):
                return obj
        elif _in(module, ("aaabus",)):
            obj = _lookup(module, name)
            if _own_data_class(obj):
                return obj
        elif _in(module, self.trusted) or what in self.trusted:
            obj = _lookup(module, name)
            if isinstance(obj, type):
                return obj
            raise UntrustedClass(
                f"refused to unpickle {what}: not a class (only classes of "
                "trusted modules may be constructed)"
            )
        raise UntrustedClass(f"refused to unpickle {what}: not trusted here; {_FIX}")

    def loads(self, data: bytes) -> Any:
        """Unpickle ``data``, constructing only trusted classes.

        Raises :class:`UntrustedClass` (naming the global) before anything is built from it,
        or what :mod:`pickle` raises for bytes that are not a valid pickle.
        """
        if self.by_value:
            return pickle.loads(data)
        return self._unpickler(io.BytesIO(data)).load()

    def check_record(self, data: bytes) -> None:
        """Load a ZODB record (class pickle, then state pickle) as a check, references unfollowed.

        Raises :class:`UntrustedClass` for a global this policy refuses; used on a store's root
        at boot, so that a planted root is one clear line rather than ZODB's load traceback.
        """
        if self.by_value:
            return
        stream = io.BytesIO(data)
        while stream.tell() < len(data):
            unpickler = self._unpickler(stream)
            unpickler.persistent_load = _unfollowed  # type: ignore[method-assign]
            unpickler.load()

    def zodb_class_factory(self, _connection: Any, module: str, name: str) -> Any:
        """``class_factory`` for :class:`ZODB.DB`: a store's records obey the same list."""
        return self.find_class(module, name)


def _unfollowed(_reference: Any) -> None:
    return None


def _lookup(module: str, name: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise UntrustedClass(
            f"cannot unpickle {module}.{name}: module not importable ({type(exc).__name__}: {exc})"
        ) from None
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UntrustedClass(f"cannot unpickle {module}.{name}: no such name")
    return obj


def _own_data_class(obj: Any) -> bool:
    # Imported here: notifications imports nothing of this module, but keep the import graph
    # shallow for the wire-level modules that use a policy.
    from aaabus.model.notifications import Notification

    return isinstance(obj, type) and issubclass(obj, (Notification, Persistent, tuple, enum.Enum))


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
