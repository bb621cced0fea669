"""The bus of ``python -m perf failover``: two servers in one domain, server 1 with members.

Server 0 is a single process; server 1 is member 0 (``aaabus-server --id 1``) and one or two
replicas (``--replica K``), each member on its own loopback address (127.0.0.1, 127.0.0.2,
127.0.0.3: the failover contract's "Members") with the server's own port numbers, and its own
store directory (``s1``, ``s1r1``, ``s1r2`` as :class:`~aaabus.tools.launch.Bus` names them).
Every port is picked free on every address used; each process is started, SIGKILLed,
SIGSTOPped, SIGCONTed and stopped by its PID only.

:func:`probe` asks one member's admin port for the server's status: only the primary listens
there, so an answer names the primary and its epoch (a follower refuses the connection).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.config.reader import BusConfig
from aaabus.config.secret import ensure_secret, load_credential, secret_path
from aaabus.config.topology import render
from aaabus.errors import AaabusError, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.tools.launch import ServerProcess, free_port_base, ports_free
from perf.harness import REPO_ROOT

#: The server whose primary fails.
FAILING = 1
#: Its members' addresses, member 0 first.
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@dataclass(frozen=True)
class Layout:
    """Where everything of the run's bus listens."""

    config: Path
    hosts: tuple[str, ...]
    admin: Mapping[int, int]
    mqtt: Mapping[int, int]
    network: Mapping[int, int]

    @property
    def members(self) -> int:
        return len(self.hosts)


def _ports(count: int, hosts: tuple[str, ...]) -> int:
    """A base port such that ``count`` ports from it are free on every one of ``hosts``."""
    for _ in range(50):
        base = free_port_base(count)
        if all(ports_free(host, range(base, base + count)) for host in hosts):
            return base
    raise RuntimeError(f"no {count} consecutive ports free on all of {', '.join(hosts)}")


def write_config(
    work: Path, replicas: int, properties: Mapping[str, str], dial_proxy: int | None = None
) -> Layout:
    """The run's a3.xml in ``work`` with a bus key beside it. ``dial_proxy``: server 0 dials
    server 1 through a proxy listening on that port of 127.0.0.1 (``aaabus.dial.1``)."""
    if not 1 <= replicas <= len(HOSTS) - 1:
        raise ValueError(f"--replicas takes 1 or 2, got {replicas}")
    hosts = HOSTS[: replicas + 1]
    base = _ports(7 + replicas, hosts)
    network = {0: base, 1: base + 1}
    admin = {0: base + 2, 1: base + 3}
    mqtt = {0: base + 4, 1: base + 5}
    text = render(
        [[0, 1]],
        2,
        base_port=base,
        # The ponger's class (perf.agents.failover) is deployed by name: trusted.
        properties={
            "aaabus.mqtt.anonymous": "true",
            "aaabus.trust": "perf.agents.failover",
            **properties,
        },
    )
    own: dict[int, dict[str, str]] = {
        sid: {"aaabus.admin.port": str(admin[sid]), "aaabus.mqtt.port": str(mqtt[sid])}
        for sid in (0, 1)
    }
    own[1]["aaabus.replication.port"] = str(base + 6)  # member 0's, when it follows
    if dial_proxy is not None:
        own[0]["aaabus.dial.1"] = f"127.0.0.1:{dial_proxy}"
    extra = {
        1: [
            f'<replica index="{k}" hostname="{hosts[k]}" port="{base + 6 + k}"/>'
            for k in range(1, replicas + 1)
        ]
    }
    for sid, props in own.items():
        start = text.index(f'<server id="{sid}"')
        end = text.index("</server>", start)
        xml = "".join(f'  <property name="{k}" value="{v}"/>\n  ' for k, v in props.items())
        xml += "".join(f"  {element}\n  " for element in extra.get(sid, ()))
        text = text[:end] + xml + text[end:]
    path = work / "a3.xml"
    path.write_text(text)
    ensure_secret(work / "bus.key")
    return Layout(path, hosts, admin, mqtt, network)


class Processes:
    """Server 0's process and server 1's members' (by member index), stores under ``root``."""

    def __init__(self, layout: Layout, root: Path, sink: Callable[[str], None]) -> None:
        config = layout.config

        def process(sid: int, replica: int | None) -> ServerProcess:
            name = f"s{sid}" if replica is None else f"s{sid}r{replica}"
            return ServerProcess(
                config, sid, root / name, sink=sink, cwd=REPO_ROOT, replica=replica
            )

        self.server0 = process(0, None)
        self.members = [process(FAILING, k or None) for k in range(layout.members)]

    def all(self) -> list[ServerProcess]:
        return [*self.members, self.server0]

    def start(self, timeout: float = 60.0) -> None:
        """Members first (followers, then member 0: today's first boot), server 0 last."""
        for proc in [*self.members[1:], self.members[0], self.server0]:
            proc.start()
        for proc in self.all():
            proc.wait_ready(timeout)

    def kill_and_wipe(self, member: int, wipe: bool = True) -> None:
        """SIGKILL member ``member`` (waits until it is gone) and delete its store directory."""
        proc = self.members[member]
        proc.kill()
        if wipe:
            shutil.rmtree(proc.storage, ignore_errors=True)

    def pause(self, member: int) -> None:
        self._signal(member, signal.SIGSTOP)

    def resume(self, member: int) -> None:
        self._signal(member, signal.SIGCONT)

    def _signal(self, member: int, signum: signal.Signals) -> None:
        proc = self.members[member]
        if proc.running():
            assert proc.proc is not None
            proc.proc.send_signal(signum)

    def stop(self) -> dict[str, int | None]:
        """SIGCONT (a paused process cannot stop), then SIGTERM every process once, server 0
        and the members in parallel; SIGKILL after a deadline. Exit statuses by process."""
        for member in range(len(self.members)):
            self.resume(member)
        for proc in self.all():
            proc.terminate()
        return {proc.name: proc.stop(20.0) for proc in self.all()}


def probe(cfg: BusConfig, layout: Layout, member: int, timeout: float = 0.5) -> Any:
    """Server 1's status as member ``member`` answers it on its admin port, or None when it
    does not (not listening: a follower or a member down; or no answer within ``timeout``)."""
    address = (layout.hosts[member], layout.admin[FAILING])
    try:
        link = AdminLink.connect(
            address, load_credential(secret_path(cfg, FAILING)), FAILING, timeout=timeout
        )
    except (AaabusError, WireError, OSError):
        return None
    try:
        link.sock.settimeout(timeout)
        answer = link.request({"op": "status"})
    except (AaabusError, WireError, OSError):
        return None
    finally:
        link.close()
    return answer.get("status") if answer.get("ok") else None


def epoch_of(status: Mapping[str, Any]) -> int | None:
    """The epoch a primary's status says it serves at (``"epoch": [epoch, member]``); None when
    it says none."""
    value = status.get("epoch")
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value[0]
    return value if isinstance(value, int) else None


def caught_up(status: Mapping[str, Any], members: int, lag: int) -> bool:
    """Whether the primary whose status this is has every other member connected and at most
    ``lag`` commits behind it (each one acknowledged since the primary started)."""
    replication = status.get("replication")
    if not isinstance(replication, Mapping):
        return False
    followers = replication.get("replicas") or {}
    if len(followers) < members - 1:
        return False
    return all(
        f.get("connected") and f.get("behind_commits") is not None and f["behind_commits"] <= lag
        for f in followers.values()
    )


@contextlib.contextmanager
def running(layout: Layout, root: Path, sink: Callable[[str], None]) -> Iterator[Processes]:
    """Start every process of ``layout``; stop each by PID on the way out, also on error."""
    procs = Processes(layout, root, sink)
    try:
        procs.start()
        yield procs
    finally:
        procs.stop()
