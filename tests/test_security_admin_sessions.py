"""What a key of one scope can take from the others on an admin port (issue 44, findings 2, 3).

Real server processes on 127.0.0.1; the attacker holds only ``read.key`` and opens raw
sessions with it (:class:`~aaabus.io.adminlink.AdminLink`), as a tool of its own making would.

* A read key cannot empty others' backlogs: a mailbox records the scope of the key that opened
  it, and a session may resume, fetch or acknowledge only the mailboxes of scopes its own
  covers. (Before: a read session's ``fetch`` acknowledged any mailbox by name, and a durable
  subscription of the operator delivered 0 of 20.)
* A read key cannot lock the admin port: read sessions take at most 24 of the 32 slots, 8 from
  one address, so ``publish`` and ``aaabus stop`` with the operate key get in. (Before: 32 idle
  read sessions took every slot, and the operator got "busy".)
* No request pushes a session's end back forever: a session is closed between two requests
  once it has lasted ``aaabus.admin.lifetime`` seconds, and a Client goes on through it (a read
  key's unnamed subscription is still closed by its client, from its new session).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import Credential, load_credential
from aaabus.errors import RequestRefused, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.node.admin import MAX_CONNECTIONS, READ_SESSIONS_PER_ADDRESS
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # real server processes and tool subprocesses


def aaabus(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aaabus", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` (it reads another process) until it holds, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        pause.wait(0.05)
    return value


def tool_keys(tmp_path: Path) -> dict[str, Credential]:
    """``read.key`` and ``tool.key`` (scope operate), made by ``aaabus secret`` in tmp_path."""
    keys = {}
    for scope in ("read", "operate"):
        made = aaabus("secret", "--tool", "--scope", scope, "--out", f"{scope}.key", cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        keys[scope] = load_credential(tmp_path / f"{scope}.key")
    return keys


def admin(cfg: BusConfig) -> tuple[str, int]:
    address, _ = admin_address(cfg, 0)
    assert address is not None
    return address


def rss_kib(pid: int) -> int:
    """The resident set of process ``pid`` (Linux /proc), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


@contextlib.contextmanager
def sessions(address: tuple[str, int], key: Credential, count: int) -> Iterator[list[AdminLink]]:
    """``count`` authenticated admin connections of ``key``, open and idle until the end."""
    links: list[AdminLink] = []
    try:
        for _ in range(count):
            links.append(AdminLink.connect(address, key, 0, timeout=10))
        yield links
    finally:
        for link in links:
            link.close()


def held(link: AdminLink) -> bool:
    """Whether the server gave ``link`` a session: it answers a status (else it said busy)."""
    try:
        return bool(link.request({"op": "status"}).get("ok"))
    except (WireError, OSError):
        return False


def test_a_read_key_cannot_empty_a_durable_subscription(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    cfg = load_config(config)
    keys = tool_keys(tmp_path)
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT):
        # The operator's durable subscription, with 20 publications waiting in it.
        with Client(cfg, 0, secret=keys["operate"]) as operator:
            operator.subscribe("plant/#", name="keep").close()
            for i in range(20):
                operator.publish(f"plant/{i}", i)
        # Resuming it, or fetching it by name (acknowledging everything), is refused.
        refused = pytest.raises(
            RequestRefused, match="'keep' belongs to scope operate, this session holds read"
        )
        with Client(cfg, 0, secret=keys["read"]) as reader, refused:
            reader.subscribe("plant/#", name="keep")
        with contextlib.closing(AdminLink.connect(admin(cfg), keys["read"], 0, timeout=10)) as raw:
            for name in ("keep", "request-anything"):
                answer = raw.request(
                    {"op": "fetch", "name": name, "after": 10**9, "most": 0, "wait": 0}
                )
                if name == "keep":
                    assert answer["ok"] is False, answer
                    assert "'keep' belongs to scope operate" in answer["error"], answer
                else:  # none of that name: nothing to refuse, nothing to learn
                    assert answer == {"ok": True, "items": [], "dropped": 0, "exists": False}
            # What the read key opens itself is its own: subscribe, read, resume, close.
            mine = raw.request({"op": "subscribe", "name": "watch", "filter": "plant/#"})
            assert mine == {"ok": True, "existed": False}, mine
        with Client(cfg, 0, secret=keys["operate"]) as operator:
            operator.publish("plant/x", "for both")
            with operator.subscribe("plant/#", name="keep") as keep:
                got = [keep.get(10) for _ in range(21)]
            assert [p.payload for p in got if p is not None] == [*range(20), "for both"]
        with Client(cfg, 0, secret=keys["read"]) as reader:
            with reader.subscribe("plant/#", name="watch") as watch:
                item = watch.get(10)
                assert item is not None and item.payload == "for both"
            # The read key's own durable subscription ends with an operate key, as before, and
            # the operator's is not the read key's to end.
            with pytest.raises(RequestRefused, match="unsubscribe needs scope operate"):
                reader.unsubscribe("watch")
            with pytest.raises(RequestRefused, match="'keep' belongs to scope operate"):
                reader.unsubscribe("keep")


def test_read_sessions_leave_the_operator_a_way_in(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    cfg = load_config(config)
    keys = tool_keys(tmp_path)
    address = admin(cfg)
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT) as bus:
        pid = bus[0].pid
        with Client(cfg, 0, secret=keys["operate"]) as operator:
            operator.status()
        before = rss_kib(pid)
        # The attack of the review: every slot of the old endpoint, idle, with a read key.
        with sessions(address, keys["read"], MAX_CONNECTIONS) as attack:
            kept = sum(held(link) for link in attack)
            during = rss_kib(pid)
            with Client(cfg, 0, secret=keys["operate"], timeout=10) as operator:
                assert operator.publish("plant/1", "still in") is True
            stopped = aaabus(
                "stop", str(config), "--id", "0", "--key", str(tmp_path / "operate.key")
            )
            assert stopped.returncode == 0, (stopped.stdout, stopped.stderr)
            until(lambda: not bus[0].running(), 30, "server 0 did not stop")
        print(
            f"\nread sessions opened {MAX_CONNECTIONS}, held {kept}; server RSS {before} KiB "
            f"before, {during} KiB during"
        )
        assert kept == READ_SESSIONS_PER_ADDRESS  # all from 127.0.0.1


def test_a_session_ends_at_its_lifetime_however_often_it_asks(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(properties={"aaabus.admin.lifetime": "2"})
    cfg = load_config(config)
    keys = tool_keys(tmp_path)
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT):
        started = time.monotonic()
        link = AdminLink.connect(admin(cfg), keys["read"], 0, timeout=10)
        try:
            # A cheap request ten times a second: before, each one pushed the end back.
            until(lambda: not held(link), 20, "the session outlived its lifetime")
        finally:
            link.close()
        lasted = time.monotonic() - started
        assert 2.0 <= lasted < 10.0, lasted
        # A Client goes on through the ends of its sessions: a subscription loses nothing, and
        # a read key's unnamed one is closed by its client in a later session than its own.
        pace = threading.Event()  # never set: the pace of a slow tool, not a synchronisation
        with (
            Client(cfg, 0, secret=keys["operate"]) as operator,
            Client(cfg, 0, secret=keys["read"]) as reader,
        ):
            sub = reader.subscribe("p/#")
            assert operator.status()["topics"]["mailboxes"] == 1
            for i in range(12):  # about 3 lifetimes
                operator.publish(f"p/{i}", i)
                item = sub.get(10)
                assert item is not None and item.payload == i
                pace.wait(0.5)
            sub.close()
            until(lambda: operator.status()["topics"]["mailboxes"] == 0, 10, "not deleted")
