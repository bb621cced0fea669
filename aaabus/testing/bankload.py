"""The bank workload: accounts that pay each other along causal chains, run by the crash schedules.

:mod:`aaabus.testing.torture` runs these agents in real server processes, which load them by
name from the config (``<service class="aaabus.testing.bankload:bank_setup" .../>``).

:class:`Account` agents on every server hold a balance. A transfer debits the payer and sends a
:class:`Credit` to the payee in the same reaction (one atomic transaction); the payee adds the
amount and, while the credit's ``ttl`` lasts, pays someone else in turn. So every credit is also
a link of a causal chain, and every account keeps the vector-clock history the independent
checker (:mod:`aaabus.testing.checker`) judges: each send with its clock, each delivery in order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from aaabus import Agent, AgentId, BootContext, Notification, PersistentList
from aaabus.testing.workload import merge_and_tick


@dataclass
class Credit(Notification):
    """``amount`` paid to the receiver; ``vc`` is the payer's vector clock at the send."""

    mid: str
    vc: dict[str, int]
    ttl: int
    amount: int


@dataclass
class Roster(Notification):
    """Every account of the bus, by label: whom an account may pay."""

    accounts: list[tuple[str, AgentId]]


@dataclass
class Start(Notification):
    """Start ``chains`` chains of transfers of ``ttl + 1`` credits each."""

    chains: int
    ttl: int


class Account(Agent):
    """A bank account that is also a causal-history recorder (see the module docstring).

    The payee and the amount of the ``n``-th payment come from ``Random(f"{seed}:{label}:{n}")``,
    so they are fixed by the seed whatever the timing. The histories are persistent lists, appended
    in the reaction's transaction: they are exactly what the bus committed.
    """

    def __init__(self, label: str, seed: int, balance: int) -> None:
        super().__init__(label)
        self.label = label
        self.seed = seed
        self.opening = balance
        self.balance = balance
        self.vc: dict[str, int] = {}
        self.peers: list[tuple[str, AgentId]] = []
        self.sent: PersistentList = PersistentList()  # (mid, payee label, vc, amount)
        self.received: PersistentList = PersistentList()  # (mid, amount), in delivery order
        self.n = 0

    def _pay(self, ttl: int) -> None:
        rng = random.Random(f"{self.seed}:{self.label}:{self.n}")
        name, dest = self.peers[rng.randrange(len(self.peers))]
        amount = rng.randint(1, 50)
        vc = self.vc  # ticked once by the reaction: all its sends are one event
        mid = f"{self.label}#{self.n}"
        self.n += 1
        self.balance -= amount
        self.sent.append((mid, name, dict(vc), amount))
        self.send_to(dest, Credit(mid, dict(vc), ttl, amount))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Roster):
            self.peers = [p for p in note.accounts if p[0] != self.label]
        elif isinstance(note, Start):
            vc = dict(self.vc)
            vc[self.label] = vc.get(self.label, 0) + 1
            self.vc = vc  # reassigned: a plain dict attribute is only saved when assigned
            for _ in range(note.chains):
                self._pay(note.ttl)
        elif isinstance(note, Credit):
            self.received.append((note.mid, note.amount))
            self.balance += note.amount
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            if note.ttl > 0:
                self._pay(note.ttl - 1)
        else:
            super().react(sender, note)


def bank_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service of one server: on its first boot, open every account of the bus and start the
    traffic. The roster and the start orders are sent after the creation requests, so causal
    order delivers them after the accounts exist, wherever they are."""
    if not first_time:
        return
    spec = json.loads(args)
    accounts: list[tuple[str, AgentId]] = []
    for sid in spec["servers"]:
        for k in range(spec["per_server"]):
            label = f"a{sid}.{k}"
            accounts.append((label, Account(label, spec["seed"], spec["balance"]).deploy(sid)))
    for _label, aid in accounts:
        ctx.send(aid, Roster(accounts))
    for _label, aid in accounts:
        ctx.send(aid, Start(spec["chains"], spec["ttl"]))
