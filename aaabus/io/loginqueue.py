"""Logins waiting for a password check, bounded and served fairly across remote addresses.

Checking a password costs tens of milliseconds of a worker thread (scrypt, on purpose), and a
CONNECT that asks for it costs its sender a hundred bytes: unbounded, a few thousand CONNECTs
with a wrong password queue minutes of work, which the devices with the right one wait behind.
:class:`LoginQueue` bounds the logins waiting, in all and per address, and hands them to the
workers **round-robin over the addresses** that have one waiting: a legitimate device waits
behind at most one login of each other address, however many one address sent. What is over a
bound is refused at once (the caller answers "server busy": the device retries later), never
queued. A login whose connection closed is withdrawn (:meth:`LoginQueue.remove`) before it
costs anything. Only as many logins are handed out as there are workers, so none waits where it
could not be withdrawn (an executor's queue).

Threads: no lock; its owner calls it from one thread (the MQTT listener's event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["LoginQueue"]

K = TypeVar("K")
V = TypeVar("V")


class LoginQueue(Generic[K, V]):
    """Jobs ``V`` under keys ``K`` (one per connection): at most ``total`` waiting, at most
    ``per_address`` of one address, at most ``workers`` handed out at once."""

    def __init__(self, total: int, per_address: int, workers: int) -> None:
        self.total = total
        self.per_address = per_address
        self.workers = workers
        #: Logins handed out whose :meth:`release` has not come yet.
        self.running = 0
        # Address -> its waiting jobs by key, oldest first; addresses in their turn's order.
        self._by_address: OrderedDict[str, OrderedDict[K, V]] = OrderedDict()
        self._address_of: dict[K, str] = {}

    def __len__(self) -> int:
        """Logins waiting (not those handed out)."""
        return len(self._address_of)

    def add(self, address: str, key: K, job: V) -> bool:
        """Queue ``job`` of ``address``; False (nothing queued) when a bound is reached."""
        mine = self._by_address.get(address)
        if len(self._address_of) >= self.total or (
            mine is not None and len(mine) >= self.per_address
        ):
            return False
        if mine is None:
            mine = self._by_address[address] = OrderedDict()  # last in the turn
        mine[key] = job
        self._address_of[key] = address
        return True

    def remove(self, key: K) -> None:
        """Withdraw ``key``'s job if it still waits (its connection closed)."""
        address = self._address_of.pop(key, None)
        if address is None:
            return
        mine = self._by_address[address]
        del mine[key]
        if not mine:
            del self._by_address[address]

    def take(self) -> V | None:
        """The next job to run if a worker is free (it then counts as running until
        :meth:`release`): the oldest of the address whose turn it is, which then goes last."""
        if self.running >= self.workers or not self._by_address:
            return None
        address, mine = next(iter(self._by_address.items()))
        key, job = mine.popitem(last=False)
        del self._address_of[key]
        if mine:
            self._by_address.move_to_end(address)
        else:
            del self._by_address[address]
        self.running += 1
        return job

    def release(self) -> None:
        """A job handed out by :meth:`take` is finished: its worker is free."""
        self.running -= 1
