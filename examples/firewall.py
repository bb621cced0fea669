"""Firewall logs: many servers report to one central server (the report's application).

    python -m examples.firewall

Five server processes in a star: the central server 0 is a router joining two domains,
``D0 = {0, 1, 2}`` and ``D1 = {0, 3, 4}``; a firewall agent on each of servers 1-4 sends its log
lines to a Monitor agent on server 0. The monitor counts lines per firewall and raises an alert
when one source address is refused by three firewalls or more (a scan). Each domain's matrix
clock is 3x3 instead of the 5x5 of one flat domain: with many firewalls that difference is the
point of domains.

The program deploys the agents from outside the bus with :class:`aaabus.tools.client.Client`, waits
for the monitor's report (a file it writes) and shows ``aaabus status`` figures.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aaabus import Agent, AgentId, Notification, PersistentMapping
from aaabus.config.reader import load_config
from aaabus.config.secret import load_secret
from aaabus.tools.buswide import bus_status
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from examples._bus import wait_for, write_bus

REPO = Path(__file__).resolve().parent.parent
FIREWALLS = (1, 2, 3, 4)
LINES_PER_FIREWALL = 50


@dataclass
class Replay(Notification):
    """Asks a firewall to send its log to the monitor."""


@dataclass
class LogLine(Notification):
    firewall: int
    source: str
    port: int
    allowed: bool


class Firewall(Agent):
    def __init__(self, monitor: AgentId, seed: int) -> None:
        super().__init__(f"firewall-{seed}")
        self.monitor = monitor
        self.seed = seed

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Replay):
            rng = random.Random(self.seed)
            for i in range(LINES_PER_FIREWALL):
                # 10.0.0.66 probes every firewall once: the scan the monitor must catch.
                source = (
                    "10.0.0.66" if i == 7 else f"192.168.{rng.randrange(256)}.{rng.randrange(256)}"
                )
                allowed = source != "10.0.0.66" and rng.random() < 0.8
                line = LogLine(self.id.server, source, rng.choice((22, 80, 443)), allowed)
                self.send_to(self.monitor, line)
        else:
            super().react(sender, note)


class Monitor(Agent):
    def __init__(self, expect: int, report: str) -> None:
        super().__init__("monitor")
        self.expect = expect
        self.report = report
        self.lines = PersistentMapping()  # firewall -> lines; a plain dict would not be saved
        self.refusals = PersistentMapping()  # source -> firewalls that refused it
        self.alerts = PersistentMapping()

    def react(self, sender: AgentId, note: Notification) -> None:
        if not isinstance(note, LogLine):
            super().react(sender, note)
            return
        self.lines[note.firewall] = self.lines.get(note.firewall, 0) + 1
        if not note.allowed:
            seen = self.refusals.get(note.source, frozenset()) | {note.firewall}
            self.refusals[note.source] = seen
            if len(seen) >= 3:
                self.alerts[note.source] = sorted(seen)
        if sum(self.lines.values()) == self.expect:
            # A side effect outside the store, written again if this reaction were replayed
            # after a crash: harmless, because it is the same file.
            tmp = Path(self.report + ".tmp")
            tmp.write_text(
                json.dumps({"lines": dict(self.lines), "alerts": dict(self.alerts)}, indent=1)
            )
            os.replace(tmp, self.report)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_path = write_bus(root, [[0, 1, 2], [0, 3, 4]])
        report = root / "report.json"
        with Bus(config_path, [0, *FIREWALLS], root, cwd=REPO) as bus:
            print("5 servers up: s0 is the central router of domains D0={0,1,2} and D1={0,3,4}")
            with Client(config_path, server=0) as client:
                expect = LINES_PER_FIREWALL * len(FIREWALLS)
                monitor = client.deploy(Monitor(expect, str(report)), server=0)
                print(f"monitor {monitor} on server 0")
                for sid in FIREWALLS:
                    firewall = client.deploy(Firewall(monitor, sid), server=sid)
                    # Sent after the deploy by the same client: arrives after the creation.
                    client.send(firewall, Replay())
                    print(f"firewall {firewall} on server {sid}: replaying its log")
            result = wait_for(
                lambda: report.exists() and json.loads(report.read_text()),
                60,
                "the monitor's report",
            )
            for sid, count in sorted(result["lines"].items()):
                print(f"monitor got {count} lines from firewall s{sid}")
            for source, firewalls in result["alerts"].items():
                print(f"ALERT: {source} refused by firewalls {firewalls}: a scan")
            config = load_config(config_path)
            statuses = bus_status(config, sorted(bus.servers), load_secret(root / "bus.key"))
            for st in statuses:
                role = "router" if st["router"] else "firewall"
                print(
                    f"status s{st['id']} ({role}): delivered {st['messages']['delivered']}, "
                    f"sent {st['messages']['sent']}, outgoing queues {st['queues']['outgoing']}"
                )
            ok = sum(result["lines"].values()) == expect and "10.0.0.66" in result["alerts"]
        print("all servers stopped")
    return 0 if ok else 1


if __name__ == "__main__":
    # Run the module the servers import (examples.firewall), not a copy named __main__, so that
    # the agents and notifications are the same classes on both sides.
    from examples import firewall

    sys.exit(firewall.main())
