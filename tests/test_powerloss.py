"""Power cuts: what a server acknowledged survives the loss of every write it did not sync
(issue 48.1).

A SIGKILL leaves the operating system's page cache intact, so the kill tests elsewhere would pass
with a store that never syncs. Here one server of a three-server bus keeps its store on
:mod:`tests.support.powerfs`, a FUSE file system that holds every write in memory until the
file is synced; the power cut kills that server and then the file system, and what was never
synced is gone. The server restarts on what reached the disk. Meanwhile the bus is under load
that makes the server acknowledge to everyone who can ask for an acknowledgement:

* peers: bank accounts on all three servers pay each other along causal chains that cross the
  server (it is the router between the two domains), so its links acknowledge frames that the
  other servers then forget;
* devices: a 3.1.1 device publishes at QoS 1 and a 5.0 device at QoS 2 (PUBACK, PUBREC);
* a tool: ``Client.publish`` returns once the server committed the publication.

After the restart every publication a device or the tool saw acknowledged is in the bus's
history exactly once and in its publisher's order (a durable subscription, read up to a marker
published after the restart), and the bank's two judges, the money and the independent checker
(:mod:`aaabus.testing.checker`), find every credit delivered exactly once in causal order.

Mutant: with the log store's ``fdatasync`` calls removed, this test fails (docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import Client
from aaabus.errors import AaabusError
from aaabus.mqtt import codes as mq
from aaabus.testing.crash import stop_all
from aaabus.testing.torture import Outcome, Schedule, finish_in_process, judge, write_config
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.powerfs import Mount
from tests.support.rawmqtt import RawClient
from tests.support.topics import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.powerloss,
    pytest.mark.skipif(
        not os.path.exists("/dev/fuse") or os.geteuid() != 0,
        reason="needs /dev/fuse and root to mount tests/support/powerfs.py",
    ),
]

LOSSY = 1  # the server whose store loses its unsynced writes: the router of the layout
#: Acknowledgements each producer must have seen before the cut.
BEFORE_CUT = 40


@dataclasses.dataclass(frozen=True)
class PowerSchedule(Schedule):
    """The bank of aaabus.testing.torture on two domains joined by server 1: D0 [s0 s1],
    D1 [s1 s2]. No scheduled faults: the test cuts the power itself."""

    @property
    def domains(self) -> list[list[int]]:
        return [[0, 1], [1, 2]]


class Producer:
    """A thread that publishes numbered payloads until the connection fails, putting each one
    it saw acknowledged in :attr:`acked` (read by the test's thread). ``publish(n) -> payload``
    returns once the publication ``n`` was acknowledged; an OSError, EOFError or AaabusError
    from it is the power cut and ends the thread, anything else is kept in :attr:`failure`."""

    def __init__(self, name: str, publish: Callable[[int], bytes]) -> None:
        self.name = name
        self.acked: queue.Queue[bytes] = queue.Queue()
        self.failure: BaseException | None = None
        self._publish = publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.is_set():
                n += 1
                self.acked.put(self._publish(n))
        except (OSError, EOFError, AaabusError):
            return  # the power cut
        except BaseException as exc:  # the test reports it
            self.failure = exc

    def stop(self) -> list[bytes]:
        """End the thread (the cut has made its connection fail) and return what it saw
        acknowledged, in order."""
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), f"producer {self.name} did not end"
        assert self.failure is None, f"producer {self.name}: {self.failure!r}"
        return list(self.acked.queue)


def device(port: int, version: int, qos: int, name: str) -> Callable[[int], bytes]:
    """The publish step of a device with a persistent session: PUBLISH ``name n`` on
    ``power/<name>`` and wait for its PUBACK (QoS 1) or PUBREC (QoS 2; then PUBREL, PUBCOMP)."""
    raw = RawClient(port, version)
    raw.connect(name, clean=False, expiry=3600 if version == mq.V5 else None)

    def publish(n: int) -> bytes:
        payload, pid = f"{name} {n}".encode(), n % 0xFFFF + 1
        raw.publish(f"power/{name}", payload, qos, pid, dup=False)
        if qos == 1:
            raw.expect_ack(mq.PUBACK, pid)
            return payload
        raw.expect_ack(mq.PUBREC, pid)  # from here the publication is the server's
        raw.ack(mq.PUBREL, pid)
        raw.expect_ack(mq.PUBCOMP, pid)
        return payload

    return publish


def tool(config: Path) -> Callable[[int], bytes]:
    """The publish step of ``Client.publish`` through the lossy server: it returns once the
    server committed the publication."""
    client = Client(config, LOSSY, timeout=3.0)

    def publish(n: int) -> bytes:
        payload = f"tool {n}".encode()
        client.publish("power/tool", payload)
        return payload

    return publish


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    started = Mount(tmp_path / "s1-disk", tmp_path / "s1-mnt", tmp_path / "powerfs.log").start()
    try:
        yield started
    finally:
        started.cut()


def test_a_power_cut_loses_nothing_the_server_acknowledged(tmp_path: Path, mount: Mount) -> None:
    schedule = PowerSchedule(
        seed=48, layout="two domains", per_server=2, chains=3, ttl=60, balance=1000, faults=()
    )
    config = write_config(schedule, tmp_path)
    (port,) = free_ports(1)
    text = config.read_text()
    at = text.index("</server>", text.index(f'<server id="{LOSSY}"'))
    listener = (
        f'  <property name="aaabus.mqtt.port" value="{port}"/>\n'
        '    <property name="aaabus.mqtt.anonymous" value="true"/>\n  '
    )
    config.write_text(text[:at] + listener + text[at:])
    stores = tmp_path / "stores"
    stores.mkdir()
    (stores / f"s{LOSSY}").symlink_to(mount.mountpoint)
    bus = Bus(config, schedule.servers, stores, cwd=REPO_ROOT)
    try:
        bus.start()
        with Client(config, LOSSY) as client:
            client.subscribe("power/#", name="watch").close()
        producers = [
            Producer("q1", device(port, mq.V311, 1, "q1")),
            Producer("q2", device(port, mq.V5, 2, "q2")),
            Producer("tool", tool(config)),
        ]
        wait_until(
            "every producer acknowledged",
            lambda: all(p.acked.qsize() >= BEFORE_CUT for p in producers),
            timeout=60,
        )
        bus[LOSSY].kill()  # the power cut: the server, then what it had not synced
        mount.cut()
        acked = {p.name: p.stop() for p in producers}
        (stores / f"s{LOSSY}").unlink()
        (stores / f"s{LOSSY}").symlink_to(mount.backing)  # the disk, as the cut left it
        bus[LOSSY].start().wait_ready(60)
        history = published_until_marker(config)
    finally:
        codes = stop_all(bus)
    for name, payloads in acked.items():
        mine = [p for p in history if p.startswith(f"{name} ".encode())]
        # In its publisher's order, each once; at most the one publication in flight at the cut
        # beyond what was acknowledged.
        assert mine == sorted(set(mine), key=lambda p: int(p.split()[1])), (name, mine)
        assert mine[: len(payloads)] == payloads, f"{name}: acknowledged, then lost"
        assert len(mine) <= len(payloads) + 1, (name, mine[len(payloads) :])
    assert codes == dict.fromkeys(schedule.servers, 0), codes
    accounts, _at_stop = finish_in_process(config, stores, schedule, timeout=60)
    outcome = Outcome(schedule.seed, schedule.layout, expected_messages=schedule.messages)
    judge(schedule, accounts, outcome)
    assert outcome.ok, outcome.problems


def published_until_marker(config: Path, timeout: float = 60.0) -> list[bytes]:
    """What the bus published on ``power/#``, in the order the watch received it, up to a
    marker published through the restarted server now (after everything before the cut)."""
    marker = b"marker after the cut"
    out: list[bytes] = []
    with Client(config, LOSSY) as client, client.subscribe("power/#", name="watch") as watch:
        client.publish("power/end", marker)
        while (item := watch.get(timeout=timeout)) is not None:
            if item.payload == marker:
                return out
            out.append(item.payload)
    raise AssertionError(f"the marker was not published in {timeout} s; before it: {out[-5:]}")
