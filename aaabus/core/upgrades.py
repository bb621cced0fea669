"""Store upgrades: the one place where a store written by an earlier version is brought to this
version's layout.

A store records its **schema version** in its root (key :data:`SCHEMA_KEY`; a store without it
is version 0, the layout of every version before this module). At each boot,
:func:`upgrade` runs, in order, every step whose number is above the store's version: each step
changes what it must and records its number in the same transaction, so a step is run once, and
a crash in its middle leaves the store at the version before (the step runs again at the next
boot, from the start). A new store is made at :data:`SCHEMA_VERSION` and runs no step.

A store whose version is above :data:`SCHEMA_VERSION` was written by a newer aaabus: it is
refused in one line before anything is written to it (this code does not know what the newer
one changed, and must not store objects that version would misread).

Steps are functions of the open :class:`~aaabus.core.store.Store`, run on the boot's thread
before the engine starts; a step that raises :class:`~aaabus.errors.StoreError` refuses the
store (the open transaction is aborted, nothing of the step is stored) and the server does not
start. Whatever a later version changes in what it stores (an attribute added to a stored
class, a class moved, a queue's layout) is a new step appended here, never a class default or
a branch in the code that reads it.

This module is below the layers whose records it upgrades (topics, MQTT): it names their
classes by dotted path and their root keys as strings, and touches only their stored
attributes, so that it imports none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import ZODB.POSException
import ZODB.utils
from ZODB.serialize import referencesf

from aaabus.core.journal import Journal
from aaabus.errors import StoreError
from aaabus.model import renames
from aaabus.wire.frames import BODY_VERSION as WIRE_VERSION
from aaabus.wire.linkframes import encode_data

log = logging.getLogger("aaabus.store")

#: The root key under which a store records the last step it ran.
SCHEMA_KEY = "schema_version"


class Store(Protocol):
    """What the steps use of :class:`aaabus.core.store.Store` (named here rather than imported:
    the store runs the upgrades)."""

    description: str
    conn: Any  # its ZODB connection
    tm: Any  # the transaction manager of that connection
    record: Any  # the ServerRecord
    agents: Any
    queues: Any
    journal: Journal | None


class Step(NamedTuple):
    """One upgrade: the version it brings a store to, what it does (logged), and how."""

    version: int
    what: str
    run: Callable[[Store], None]


def schema_of(store: Store) -> int:
    """The schema version recorded in ``store`` (0: written before versions were recorded)."""
    version: int = store.conn.root().get(SCHEMA_KEY, 0)
    return version


def refuse_newer(store: Store) -> None:
    """Raise a one-line StoreError if ``store`` was written by a newer aaabus."""
    found = schema_of(store)
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"{store.description} has store schema {found}, newer than the {SCHEMA_VERSION} "
            "this aaabus reads (an upgrade cannot be undone in place): run the aaabus version "
            "that wrote it, or restore a backup made before that upgrade"
        )


def upgrade(store: Store) -> list[int]:
    """Run every step above ``store``'s schema version, each in its own transaction that also
    records its number; return the numbers run. A StoreError of a step aborts its transaction
    and propagates (the caller closes the store)."""
    refuse_newer(store)
    ran = []
    for step in STEPS:
        if step.version <= schema_of(store):
            continue
        try:
            step.run(store)
            store.conn.root()[SCHEMA_KEY] = step.version
            store.tm.commit()
        except BaseException:
            store.tm.abort()
            raise
        log.info("%s: upgraded to store schema %d (%s)", store.description, step.version, step.what)
        ran.append(step.version)
    return ran


def mark_new(store: Store) -> None:
    """Record in a store being created that it has this version's layout (no step to run)."""
    store.conn.root()[SCHEMA_KEY] = SCHEMA_VERSION


# -- the steps ---------------------------------------------------------------------------------


def _wire_version(store: Store) -> None:
    """Record this version's wire in a store written before it was recorded or by an older one,
    if that is safe.

    Queued bodies are in the writer's wire format, which another version may not read (a
    version-2 body is a pickle, which a version-3 server refuses as a dead letter): such a
    store must have been drained. Agents and their state carry over. Stores of other wire
    versions predate the journal: their queues are ZODB objects, counted here.
    """
    record = store.record
    record._p_activate()  # a ghost's __dict__ is empty until it is loaded
    old = record.__dict__.get("wire_version")
    if old == WIRE_VERSION:
        return
    root = store.conn.root()
    queued = [root["qin"]] + [
        store.queues[key] for key in store.queues if key[0] in ("wait", "out")
    ]
    pending = sum(len(queue) for queue in queued)
    if pending:
        written = f"wire version {old}" if old is not None else "wire version 2 or earlier"
        raise StoreError(
            f"{store.description} was written by {written} and still holds {pending} queued "
            f"messages that wire version {WIRE_VERSION} cannot read: run it under its own "
            "version until the bus is drained, then upgrade (docs/operations.md, Upgrading "
            "a running bus)"
        )
    record.wire_version = WIRE_VERSION


def _queues_hold_frames(store: Store) -> None:
    """Outgoing queues hold each message's frame; stores older kept ``(stamp, message)``, and
    log stores before the journal kept their queues and clocks as ZODB objects: encode the
    former, and move the latter into the journal (the two sides of the move in one
    transaction, so a crash leaves them where they were)."""
    queues = store.queues
    for key in [key for key in queues if key[0] == "out"]:
        out = queues[key]
        for seq, entry in list(out.items()):
            if not isinstance(entry, bytes):
                stamp, message = entry
                out[seq] = encode_data(seq, key[2], stamp, message)
    journal = store.journal
    if journal is None:
        return
    qin = store.conn.root()["qin"]
    old = [key for key in queues if key[0] in ("clock", "wait", "out")]
    while qin:
        journal.qin.put(qin.pop())
    for key in old:
        if key[0] == "clock":
            journal.adopt_clock(key[1], queues[key])
    for key in old:
        if key[0] == "wait":
            wait = journal.waiting(key[1])
            for entry, value in queues[key].items():
                wait[entry] = value
        elif key[0] == "out":
            _kind, peer, domain = key
            out = journal.outgoing(peer, domain)
            for seq, frame in queues[key].items():
                out[seq] = frame
    for key in old:
        del queues[key]


#: Attributes that records stored before they existed lack, with the value they meant then:
#: (where the records are, class dotted path or None for every record there) -> attributes.
_MAILBOX = "aaabus.topics.mailbox.Mailbox"
_SESSION_DEFAULTS = {"user": None, "clean": False}
_MAILBOX_DEFAULTS = {"watched": True}
_SERVER_DEFAULTS = {"bus_identity": None, "wire_version": None}


def _set_missing(obj: Any, defaults: dict[str, Any]) -> None:
    obj._p_activate()  # a ghost's __dict__ is empty until it is loaded
    for name, value in defaults.items():
        if name not in obj.__dict__:
            setattr(obj, name, value)


def _stored_defaults(store: Store) -> None:
    """Give every record the attributes added to its class since it was stored, with the value
    its class default gave them: the server's record, MQTT sessions, mailboxes; and the topic
    representative its tries (built from its tables)."""
    _set_missing(store.record, _SERVER_DEFAULTS)
    sessions = store.conn.root().get("mqtt_sessions")
    for record in sessions.values() if sessions is not None else ():
        _set_missing(record, _SESSION_DEFAULTS)
    for agent in store.agents.values():
        path = f"{type(agent).__module__}.{type(agent).__qualname__}"
        if path == _MAILBOX:
            _set_missing(agent, _MAILBOX_DEFAULTS)
        elif path == "aaabus.topics.representative.TopicRepresentative":
            agent._p_activate()
            if "local_trie" not in agent.__dict__:
                agent.index_tables()


def _classes_where_they_are(store: Store) -> None:
    """Rewrite every record that names a class by a path it moved from
    (:mod:`aaabus.model.renames`): loaded through the table, each such object is marked
    changed, and its commit pickles it, and its references, under the current paths. A release
    that moves classes appends this step again, so that the stores of the release before are
    rewritten too.

    The walk follows the references of each record from the root (every live object); a record
    is picked by the bytes of an old module path in it, a test that may pick more than needed
    (a record is then rewritten unchanged) but never fewer.
    """
    needles = [module.encode() for module in renames.old_modules()]
    if not needles:
        return
    storage = store.conn.db().storage
    seen: set[bytes] = set()
    todo = [ZODB.utils.z64]
    while todo:
        oid = todo.pop()
        if oid in seen:
            continue
        seen.add(oid)
        try:
            data, _tid = storage.load(oid)
        except ZODB.POSException.POSKeyError:
            continue  # a dangling reference: nothing to rewrite
        if any(needle in data for needle in needles):
            obj = store.conn.get(oid)
            obj._p_activate()
            obj._p_changed = True
        todo.extend(referencesf(data))


#: Every step, in order; the last one's number is this version's schema.
STEPS: tuple[Step, ...] = (
    Step(1, "wire version 3 recorded", _wire_version),
    Step(
        2, "outgoing queues hold frames, log stores keep them in the journal", _queues_hold_frames
    ),
    Step(3, "attributes added since a record was stored given their values", _stored_defaults),
    Step(4, "records name moved classes by their current paths", _classes_where_they_are),
)

SCHEMA_VERSION = STEPS[-1].version
