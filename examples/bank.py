"""Bank transfers across two domains that survive killed servers.

    python -m examples.bank

Three server processes: bank North on server 0 (domain D0), bank South on server 2 (domain D1),
and server 1, the router between the two domains. North moves money to South in 2 000 transfers:
each reaction debits one account and sends the credit, in one transaction. Meanwhile the program
kills South's server (SIGKILL, as a crash) and then the router, and restarts them. (South
confirms every 50 credits and North waits when 100 are unconfirmed, so a crash on the way pauses
the transfers instead of the transfers racing past it.)

Nothing is lost and nothing is applied twice: a credit leaves North's store only once South's
server has stored it, a resent credit is recognised as a duplicate by the receiver's clock, and
causal order keeps the credits in the order they were sent. At the end the money adds up.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aaabus import Agent, AgentId, Notification
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from examples._bus import wait_for, write_bus

REPO = Path(__file__).resolve().parent.parent
TRANSFERS = 2000
OPENING = 10_000
#: Transfers North may have unconfirmed: while South's side is down, North soon waits.
WINDOW = 100


@dataclass
class Start(Notification):
    to: AgentId
    count: int


@dataclass
class Next(Notification):
    """North to itself: make the next transfer (one per reaction)."""


@dataclass
class Credit(Notification):
    number: int
    amount: int


@dataclass
class Receipt(Notification):
    """South to North: every credit up to ``number`` is in."""

    number: int


def _write(path: str, data: dict[str, int]) -> None:
    # Outside the store: rewritten if the reaction is replayed after a crash, which is harmless.
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Bank(Agent):
    def __init__(self, name: str, report: str) -> None:
        super().__init__(name)
        self.balance = OPENING
        self.report = report
        self.to: AgentId | None = None
        self.todo = 0
        self.sent = 0
        self.received = 0
        self.confirmed = 0
        self.waiting = False
        self.out_of_order = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Start):
            self.to, self.todo = note.to, note.count
            self.send_to(self.id, Next())
        elif isinstance(note, Next) and self.to is not None:
            amount = 1 + self.sent % 7
            self.balance -= amount  # the debit and the credit below commit together
            self.sent += 1
            self.send_to(self.to, Credit(self.sent, amount))
            if self.sent == self.todo:
                _write(self.report, {"balance": self.balance, "sent": self.sent})
            elif self.sent - self.confirmed < WINDOW:
                self.send_to(self.id, Next())
            else:
                self.waiting = True
        elif isinstance(note, Receipt):
            self.confirmed = note.number
            if self.waiting:
                self.waiting = False
                self.send_to(self.id, Next())
        elif isinstance(note, Credit):
            if note.number != self.received + 1:
                self.out_of_order += 1
            self.received += 1
            self.balance += note.amount
            if self.received % (WINDOW // 2) == 0:
                self.send_to(sender, Receipt(self.received))
            if self.received == TRANSFERS:
                _write(
                    self.report,
                    {"balance": self.balance, "received": self.received,
                     "out_of_order": self.out_of_order},
                )  # fmt: skip
        else:
            super().react(sender, note)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = write_bus(root, [[0, 1], [1, 2]])
        north_file, south_file = root / "north.json", root / "south.json"
        with Bus(config, [0, 1, 2], root, cwd=REPO) as bus:
            with Client(config, server=0) as client:
                north = client.deploy(Bank("North", str(north_file)), server=0)
                south = client.deploy(Bank("South", str(south_file)), server=2)
                print(f"North {north} and South {south} open with {OPENING} each")
                client.send(north, Start(south, TRANSFERS))
            print(f"North starts {TRANSFERS} transfers to South, through router s1")
            received = 0
            with Client(config, server=2) as south_server:

                def credits_at_least(n: int) -> int | None:
                    # Messages South's server has accepted from the router: counted by its
                    # clock, in its store, so the figure survives the kills.
                    count = south_server.status()["messages"]["received_remote"]
                    return count if count >= n else None

                for victim, after in ((2, 200), (1, 700), (2, 1200)):
                    received = wait_for(lambda n=after: credits_at_least(n), 60, "progress")
                    role = "South's server" if victim == 2 else "the router"
                    print(f"~{received} messages reached s2: SIGKILL {role} (s{victim})")
                    bus[victim].kill()
                    bus[victim].start().wait_ready(30)
                    print(f"s{victim} restarted from its store")
            north_end = wait_for(
                lambda: north_file.exists() and json.loads(north_file.read_text()),
                60,
                "North's report",
            )
            south_end = wait_for(
                lambda: south_file.exists() and json.loads(south_file.read_text()),
                60,
                "South's report",
            )
        print(f"North sent {north_end['sent']} transfers, balance {north_end['balance']}")
        print(
            f"South received {south_end['received']} credits "
            f"({south_end['out_of_order']} out of order), balance {south_end['balance']}"
        )
        total = north_end["balance"] + south_end["balance"]
        verdict = "conserved" if total == 2 * OPENING else "WRONG"
        print(f"total {total} (opened with {2 * OPENING}): {verdict}")
        ok = total == 2 * OPENING and south_end["received"] == TRANSFERS
        return 0 if ok and south_end["out_of_order"] == 0 else 1


if __name__ == "__main__":
    # Run the module the servers import (examples.bank), not a copy named __main__.
    from examples import bank

    sys.exit(bank.main())
