"""The order in which a group's data managers take part in its two-phase commit, in one place.

``transaction`` runs each phase (``tpc_begin``, ``commit``, ``tpc_vote``, ``tpc_finish``) over
the joined data managers sorted by their ``sortKey()`` strings. A group joins at most four, and
their order is what makes the commit mean anything:

1. ``early`` (:class:`aaabus.core.early.EarlyVote`): its vote marks the end of ZODB's
   preparation, before the store writes anything: the group's frames leave then, tentative;
2. ``store``: the ZODB connection, whose key is its storage's name (``Connection.sortKey``), and
   whose vote writes the records (on the log store, and syncs them);
3. ``journal`` (:class:`aaabus.core.journal.Journal`): the channel's queues and clocks as side
   records of the log store, voted once the connection has prepared the block they join;
4. ``effects`` (:class:`aaabus.core.effects.TransactionEffects`): last to vote, once nobody is
   left to veto, so that what waits for durability may run as soon as the store says so.

Each manager takes its key from :func:`sort_key` by its name here; the store's is any
storage name, and the keys of the others are built to sort before (a leading ``\\x00``, …) or
after (a leading ``\\U0010ffff``, …) every such name, which never starts with those characters.
"""

from __future__ import annotations

#: The data managers of a group, in the order of every phase of its commit (see above).
COMMIT_ORDER = ("early", "store", "journal", "effects")

_STORE = COMMIT_ORDER.index("store")


def sort_key(manager: str) -> str:
    """The ``sortKey()`` of the data manager named ``manager`` in :data:`COMMIT_ORDER` (not the
    store's: a ZODB connection's key is its storage's name). ``ValueError`` for another name."""
    rank = COMMIT_ORDER.index(manager)
    if rank == _STORE:
        raise ValueError("the store's key is its storage's name, set by ZODB")
    lead = chr(rank) if rank < _STORE else chr(0x10FFFF - (len(COMMIT_ORDER) - 1 - rank))
    return f"{lead} aaabus.core.{manager}"
