"""A process that commits in a loop on a LogStorage until it is killed (crash tests).

``python -m tests.support.logstore_child DIR SEGMENT_SIZE``: each transaction sets the counter
of two persistent objects to the same new value, puts that value on a queue and pops the oldest
(the queue keeps the last ``KEEP``), and every ``DROP_EVERY`` transactions replaces a BTree
(the old one becomes garbage for the GC). It prints each counter AFTER its commit returned,
so a printed counter is one the store promised to keep. Small segments keep the compactor busy
while the process is killed.
"""

from __future__ import annotations

import sys

import transaction
import ZODB
from BTrees.OOBTree import OOBTree
from persistent import Persistent

from aaabus.core.logstorage import LogStorage
from aaabus.core.store import PersistentQueue

KEEP = 5
DROP_EVERY = 7


class Counter(Persistent):
    def __init__(self) -> None:
        self.value = 0
        self.pad = b"p" * 200


def main(directory: str, segment_size: int) -> None:
    db = ZODB.DB(LogStorage(directory, segment_size=segment_size))
    tm = transaction.TransactionManager()
    root = db.open(transaction_manager=tm).root()
    if "a" not in root:
        root["a"], root["b"] = Counter(), Counter()
        root["queue"] = PersistentQueue()
        root["tree"] = OOBTree()
        tm.commit()
    a, b, queue = root["a"], root["b"], root["queue"]
    value = a.value
    print(f"ready {value}", flush=True)
    while True:
        value += 1
        a.value = value
        b.value = value
        queue.put(value)
        while len(queue) > KEEP:
            queue.pop()
        if value % DROP_EVERY == 0:
            tree = OOBTree()
            tree[value] = b"t" * 100
            root["tree"] = tree
        tm.commit()
        print(value, flush=True)


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: the objects' classes must pickle under the
    # importable name tests.support.logstore_child, which the checking process loads.
    from tests.support.logstore_child import main as module_main

    module_main(sys.argv[1], int(sys.argv[2]))
