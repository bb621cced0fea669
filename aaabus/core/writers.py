"""ZODB connections whose commit writers are freed as soon as their commit has used them.

ZODB serialises a commit's objects with one ``ObjectWriter`` per registered object, and each is
a reference cycle: its pickler keeps ``persistent_id``, a bound method of the writer. Python
frees it only in a cycle collection, and until then it keeps its pickle buffer and, through the
pickler's memo, the state of the last object it pickled (a mailbox bucket: the messages it
held). A server's collector runs a young collection only every ``aaabus.gc.thresholds``' first
figure of net allocations (50,000), and a dead writer counts about eleven of them for several KB
held: the receiving server of an MQTT soak, which commits a mailbox bucket per delivered batch,
held about 5,500 dead writers, 33 MB of its 100 MB (issue 43). :class:`FreeingConnection` breaks
each writer's cycle when ``_store_objects`` returns (ZODB does not use the writer after that), so
reference counting frees it there, whatever the collector's thresholds.
"""

from __future__ import annotations

from typing import Any

import ZODB
from ZODB.Connection import Connection


class FreeingConnection(Connection):
    """A ZODB connection that frees each commit writer when its objects are stored (engine
    thread: wherever the commit runs). Exceptions are ZODB's, the writer freed all the same."""

    def _store_objects(self, writer: Any, transaction: Any) -> None:
        try:
            super()._store_objects(writer, transaction)
        finally:
            # The pickler holds the writer's bound persistent_id: without the pickler, nothing
            # refers to the writer but the caller's expression, and it goes with it.
            writer._p = None


class FreeingDB(ZODB.DB):
    """:class:`ZODB.DB` whose connections are :class:`FreeingConnection`."""

    klass = FreeingConnection
