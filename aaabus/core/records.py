"""How a server's ZODB reads its records: each one is vetted whole before any of it is unpickled.

A record is two pickles (class, then state), and ZODB unpickles them with the server's
:class:`~aaabus.config.trust.TrustPolicy` as ``class_factory``. That hook sees the globals one at
a time, as the unpickler meets them, and nothing of what the pickle does with them: a ``BUILD``
on a class is out of its reach. So :class:`VettedDB` gives ZODB connections whose reader first
vets the record's bytes (:func:`vet_record`: every global resolved by the policy, every opcode
walked by :func:`~aaabus.wire.pickles.vet_pickles`, nothing built); only then does ZODB
unpickle it.

The reader is where every record load meets bytes (a ghost's class, a state, an old revision),
whichever storage is underneath. A refusal leaves the connection as a refused load always has
(the object stays a ghost) and is :class:`UntrustedClass` naming the record's oid, raised from
``Connection.get`` or the object's activation.

Cost: one walk per load, linear in the record: about twice what unpickling the record costs
(9 us for a small agent, 120 us for a queue bucket of 30 messages). Loads are rare once a server
runs: its agents and queues stay in the connection's cache, and commits write records without
reading them.
"""

from __future__ import annotations

import logging
from typing import Any

import ZODB
from ZODB.Connection import Connection
from ZODB.POSException import StateLoadError
from ZODB.serialize import ObjectReader
from ZODB.utils import oid_repr

from aaabus.config.trust import TrustPolicy
from aaabus.core.writers import FreeingConnection
from aaabus.errors import MalformedPickle, UntrustedClass
from aaabus.wire.pickles import vet_pickles

__all__ = ["VettedDB", "check_record", "vet_record"]


def vet_record(trust: TrustPolicy, data: bytes, *, state: bool = True) -> None:
    """Vet a record without unpickling any of it: every global it names is resolved by
    ``trust``, and the walk refuses what ``find_class`` cannot see. ``state=False``: the class
    pickle alone, all that ZODB unpickles to make a ghost. Raises :class:`UntrustedClass` or
    :class:`MalformedPickle`. Nothing to vet under ``by_value``."""
    if trust.by_value:
        return
    end = vet_pickles(data, 2 if state else 1, trust.find_class)
    if state and end != len(data):
        raise MalformedPickle("a record is two pickles, and this one has bytes after them")


def check_record(trust: TrustPolicy, data: bytes) -> None:
    """Vet a record, then load it as a check, its references unfollowed (a store's root at
    boot): what only a load refuses is then one line naming the record too."""
    vet_record(trust, data)
    trust.check_record(data)


class _VettingReader(ObjectReader):
    """ZODB's reader, vetting a record before it unpickles the part it needs."""

    def __init__(self, conn: Connection, cache: Any, factory: Any, trust: TrustPolicy) -> None:
        super().__init__(conn, cache, factory)
        self._trust = trust

    def getGhost(self, pickle: bytes) -> Any:
        vet_record(self._trust, pickle, state=False)
        return super().getGhost(pickle)

    def getState(self, pickle: bytes) -> Any:
        vet_record(self._trust, pickle)
        try:
            return super().getState(pickle)
        except StateLoadError as exc:
            # ZODB wraps whatever unpickling raised; a refusal (a wrapper of the trust policy
            # refusing its arguments) is reported as itself.
            if isinstance(exc.__cause__, UntrustedClass):
                raise exc.__cause__ from None
            raise


class _VettingConnection(FreeingConnection):
    """A connection whose reader vets records, and whose refusals name the record."""

    def __init__(self, db: VettedDB, *args: Any, **kwargs: Any) -> None:
        super().__init__(db, *args, **kwargs)
        self._reader = _VettingReader(self, self._cache, db.classFactory, db.trust)

    # Refusals (and records that are no pickles) leave as one line naming the record. A plain
    # try rather than a context manager: `get` runs for every root lookup, and a generator-based
    # manager cost several µs of it.

    def get(self, oid: bytes) -> Any:
        try:
            return super().get(oid)
        except (UntrustedClass, MalformedPickle) as exc:
            raise type(exc)(f"record {oid_repr(oid)}: {exc}") from None

    def setstate(self, obj: Any) -> None:
        try:
            super().setstate(obj)
        except (UntrustedClass, MalformedPickle) as exc:
            raise type(exc)(f"record {oid_repr(obj._p_oid)}: {exc}") from None


class _QuietRefusals(logging.Filter):
    """ZODB logs a traceback for any state it fails to load; a refusal is no crash, and its
    one line goes up to whoever asked for the object (the boot, or the reaction that failed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, UntrustedClass | MalformedPickle)


class VettedDB(ZODB.DB):
    """A :class:`ZODB.DB` whose every record load goes through ``trust`` (module docstring)."""

    klass = _VettingConnection

    def __init__(self, storage: Any, trust: TrustPolicy, **kwargs: Any) -> None:
        self.trust = trust  # read by the connections, the first of which __init__ opens
        super().__init__(storage, class_factory=trust.zodb_class_factory, **kwargs)


_ZODB_CONNECTION_LOG = logging.getLogger("ZODB.Connection")
if not any(isinstance(f, _QuietRefusals) for f in _ZODB_CONNECTION_LOG.filters):
    _ZODB_CONNECTION_LOG.addFilter(_QuietRefusals())
