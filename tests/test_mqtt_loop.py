"""Nothing a device is told is acknowledged before it is durable: the MQTT listener's PUBACK
and the subscriber's delivery wait for the commit on disk (issue 43, point 2).

A real server process keeps its store on :mod:`tests.support.powerfs` (a FUSE file system in a
child process); stopping that child (SIGSTOP) stops the store's writes and syncs where they are,
as a disk that takes its time would: the group committing a device's publication is held in its
commit, in the kernel, until the child continues. Meanwhile the publisher gets no PUBACK and the
persistent subscriber no PUBLISH; once the file system continues, both arrive.

The loop itself runs the batch when the engine is idle, and so waits through that commit with
every device: a PINGREQ of another device is answered after it (docs/mqtt.md says why, with the
figures: handing every batch to the engine thread cost more per round trip than it freed).

Mutants (docs/testing.md): a batch's completion run as soon as its operations ran, before the
commit (``done(outcomes)`` instead of ``engine.effects.when_durable(...)`` in
``Engine.run_batch``), fails the PUBACK's absence; a mailbox's push run as its reaction notified
it (``flusher()`` instead of ``effects.when_durable_once(flusher)`` in ``Sends.notify``), the
delivery's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import RawDevice, publish_packet, subscribe_packet
from tests.support.powerfs import Mount
from tests.support.topics import wait_until

pytestmark = [
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="reads x86-64 system call numbers"),
    pytest.mark.slow,
    pytest.mark.powerloss,
    pytest.mark.skipif(
        not os.path.exists("/dev/fuse") or os.geteuid() != 0,
        reason="needs /dev/fuse and root to mount tests/support/powerfs.py",
    ),
]

PUBACK = 0x40
PUBLISH_QOS1 = 0x32


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Mount]:
    started = Mount(tmp_path / "disk", tmp_path / "mnt", tmp_path / "powerfs.log").start()
    try:
        yield started
    finally:
        started.cut()


@contextlib.contextmanager
def stopped(mount: Mount) -> Iterator[None]:
    """The file system's process stopped: every write and sync on it waits (continued on exit,
    whatever happens, so that the server can stop)."""
    assert mount.proc is not None
    mount.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        mount.proc.send_signal(signal.SIGCONT)


#: x86-64 system calls that write a file or sync it (write, pwrite64, writev, pwritev,
#: pwritev2, fsync, fdatasync): what a thread committing a group blocks in.
WRITE_OR_SYNC = {1, 18, 20, 296, 328, 74, 75}


def waiting_on_disk(pid: int, mountpoint: Path) -> bool:
    """Whether a thread of process ``pid`` is inside a write or a sync of a file on the stopped
    file system (``/proc/<pid>/task/<tid>/syscall``: the call, then its arguments): the thread
    committing the group, held there."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            call = (task / "syscall").read_text().split()
            if int(call[0]) in WRITE_OR_SYNC:
                target = os.readlink(f"/proc/{pid}/fd/{int(call[1], 16)}")
                if target.startswith(f"{mountpoint}/"):
                    return True
    return False


def settled(pid: int) -> bool:
    """Whether no thread of process ``pid`` is running or runnable (state R): what any of them
    had started before the commit was held (an answer queued to the loop by the engine thread,
    written by the loop) is done."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            stat = (task / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "R":
                return False
    return True


def nothing_received(device: RawDevice) -> bool:
    """Whether nothing from the server waits in ``device``'s socket (read without waiting)."""
    device.sock.setblocking(False)
    try:
        device.sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        device.sock.setblocking(True)
        device.sock.settimeout(10)
    return False


def test_a_puback_and_a_delivery_wait_for_their_commit_on_disk(
    tmp_path: Path, mount: Mount, make_config: Callable[..., Path]
) -> None:
    (port,) = free_ports(1)
    config = make_config(
        properties={"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
    )
    with Bus(config, [0], mount.mountpoint / "store", cwd=REPO_ROOT) as bus:
        subscriber, publisher = RawDevice(port), RawDevice(port)
        try:
            # A persistent subscriber: the publication changes its mailbox, so its group writes.
            assert subscriber.connect("sub", flags=0x00) == 0
            subscriber.send(subscribe_packet(["t"], qos=1))
            assert subscriber.packet()[0] == 0x90  # SUBACK
            assert publisher.connect("pub") == 0
            pid = bus.servers[0].pid
            on_disk = mount.mountpoint.resolve()  # not once stopped: resolving reads the mount
            with stopped(mount):
                publisher.send(publish_packet(b"t", b"held", qos=1, pid=7))
                wait_until(
                    "the commit held on disk, the server's other threads asleep",
                    lambda: waiting_on_disk(pid, on_disk) and settled(pid),
                    10,
                )
                assert nothing_received(publisher), "a PUBACK left before its commit was durable"
                assert nothing_received(subscriber), "a delivery left before it was durable"
                assert waiting_on_disk(pid, on_disk)  # the commit was held all along
            assert publisher.packet() == (PUBACK, (7).to_bytes(2, "big"))
            first, body = subscriber.packet()
            assert first & 0xF6 == PUBLISH_QOS1 & 0xF6 and body.endswith(b"held")
        finally:
            subscriber.close()
            publisher.close()
