"""Finding unreachable objects while commits go on (runs on the compactor's thread, or in the
thread that calls ``pack``).

Marking reads the current record of every object reachable from the root (oid 0) and follows
the references ZODB's ``referencesf`` finds in it. Commits are not stopped: while a pass marks,
``Log.apply_commit`` adds every oid it commits to ``Log.marking``, and those objects are marked
again from their new records (a reference can only appear in a record that was committed, so
nothing reachable escapes: the "incremental update" rule of concurrent collectors). The last
round of that runs under the index lock, with the sweep, so no commit slips in between.

Cost of one pass: one ``pread`` and one ``referencesf`` (an unpickling that builds no object)
per live object, a few microseconds each, with pauses; memory: a set of the live oids. What
holds up commits: the copy of the oid list at the start (one C-level copy, about 35 ns per
object, GIL held), each single-record read (index lock), and the last round under the index
lock: the objects committed during the round before it and whatever they newly reference,
plus the sweep over the garbage found.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ZODB.utils import oid_repr

from aaabus.core.logstorage.format import Z64, is_side
from aaabus.core.logstorage.log import Log
from aaabus.errors import PassStopped, UnreadableRecord

References = Callable[[bytes], list[bytes]]

#: Marking rounds outside the lock before the last one, which runs under it.
_ROUNDS = 4
#: Records traced between two pauses of the marking thread, and the pause: the committing
#: thread gets the GIL back at once when it returns from its fdatasync (CPython hands the GIL
#: over only every 5 ms to a thread that asks for it while another computes).
BREATHE_EVERY = 32
BREATHE_SECONDS = 0.0005


def breathe(count: int) -> None:
    if count % BREATHE_EVERY == 0:
        time.sleep(BREATHE_SECONDS)


def _trace(
    log: Log,
    stack: list[bytes],
    marked: set[bytes],
    refs: References,
    stopping: Callable[[], bool] | None,
) -> None:
    """Mark what ``stack`` leads to. With ``stopping`` (outside the lock), pause now and then
    and give up (PassStopped) when it says so; without it (under the lock), run through."""
    done = 0
    while stack:
        oid = stack.pop()
        found = log.read_current(oid)
        if found is None:
            continue  # a dangling reference, or collected: nothing to follow
        try:
            targets = refs(found[0])
        except Exception as exc:
            raise UnreadableRecord(
                f"object {oid_repr(oid)} cannot be read for references ({type(exc).__name__})"
            ) from None
        for target in targets:
            if target not in marked:
                marked.add(target)
                stack.append(target)
        done += 1
        if stopping is not None and done % BREATHE_EVERY == 0:
            if stopping():
                raise PassStopped
            time.sleep(BREATHE_SECONDS)


def collect(
    log: Log, refs: References, grace: set[bytes] | None, stopping: Callable[[], bool]
) -> tuple[int, set[bytes]]:
    """Drop unreachable objects while commits go on; return (how many were dropped, the
    unreachable ones spared). With ``grace`` (the set a previous pass spared), only objects
    found unreachable by both passes are dropped, the others are spared for the next pass;
    without it, every unreachable object is dropped. No root: nothing is done. Objects created
    during the pass are never dropped. The final decision and the drop share one critical
    section: no commit can link an object between the two. ``stopping`` is asked now and then:
    when it says so, PassStopped, and nothing is dropped."""
    with log.lock:
        if Z64 not in log.index:
            return 0, set()
        before = list(log.index)
        log.marking = set()
    try:
        marked = {Z64}
        stack = [Z64]
        _trace(log, stack, marked, refs, stopping)
        for _ in range(_ROUNDS):
            with log.lock:
                dirty, log.marking = log.marking, set()
            if not dirty:
                break
            marked.update(dirty)
            stack.extend(dirty)
            _trace(log, stack, marked, refs, stopping)
        # What the last round can still mark is a subset of what is unmarked now: the sweep
        # under the lock then costs the garbage's size, not the store's.
        unmarked: list[bytes] = []
        for start in range(0, len(before), 4096):
            unmarked.extend(
                oid
                for oid in before[start : start + 4096]
                if oid not in marked and not is_side(oid)
            )
            time.sleep(BREATHE_SECONDS)
        with log.lock:
            dirty = log.marking
            marked.update(dirty)
            stack.extend(dirty)
            _trace(log, stack, marked, refs, None)
            garbage = {oid for oid in unmarked if oid not in marked and oid in log.index}
            doomed = garbage if grace is None else garbage & grace
            return log.delete(doomed), garbage - doomed
    finally:
        with log.lock:
            log.marking = None
