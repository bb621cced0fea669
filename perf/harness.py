"""Running a bus of real server processes for a measurement, and always cleaning up after it."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from defusedxml.ElementTree import parse as safe_parse

from aaabus.config.reader import BusConfig, load_config
from aaabus.tools.launch import Bus, free_port_base

REPO_ROOT = Path(__file__).resolve().parent.parent


def with_services(
    src: str | Path,
    dst: Path,
    services: Mapping[int, Sequence[tuple[str, str]]],
    properties: Mapping[str, str] | None = None,
    replicas: int = 0,
) -> Path:
    """Copy config ``src`` to ``dst`` adding boot services per server and global properties,
    and ``replicas`` ``<replica>`` elements to every server (on free ports of 127.0.0.1)."""
    tree = safe_parse(str(src))
    root = tree.getroot()
    servers = root.findall("server")
    if replicas:
        base = free_port_base(replicas * len(servers))
        for n, server in enumerate(servers):
            for k in range(replicas):
                port = str(base + n * replicas + k)
                ElementTree.SubElement(server, "replica", {"index": str(k + 1), "port": port})
    for name, value in (properties or {}).items():
        for old in [p for p in root.findall("property") if p.get("name") == name]:
            root.remove(old)
        prop = ElementTree.Element("property", {"name": name, "value": value})
        root.insert(0, prop)
    for server in root.findall("server"):
        for cls, args in services.get(int(server.get("id", "-1")), ()):
            ElementTree.SubElement(server, "service", {"class": cls, "args": args})
    tree.write(dst, encoding="unicode")
    return dst


def wait_for_file(
    path: Path, bus: Bus, timeout: float, tick: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Wait until ``path`` exists (a result written by an agent); fail fast if a server died.
    ``tick``, if given, is called on every poll (it decides itself whether it is its time)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if tick is not None:
            tick()
        for proc in bus.servers.values():
            if not proc.running():
                tail = " | ".join(list(proc.lines)[-3:])
                raise RuntimeError(f"server {proc.server_id} died during the run: {tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result in {path} after {timeout:.0f}s")
        time.sleep(0.02)  # polling a file written by another process: no event to wait on
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@contextmanager
def scratch(keep: str | None = None) -> Iterator[Path]:
    """A working directory for one run: ``keep`` if given, else a temporary one removed after."""
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="aaabus-perf-") as tmp:
            yield Path(tmp)


def config_of(path: str | Path) -> BusConfig:
    return load_config(path)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux /proc), 0 if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (Linux /proc), 0 if it is gone.

    A cost measured in CPU time is far less sensitive to other work on the machine than a rate
    measured in wall time: the process is charged only for what it ran."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # Fields after the command name (which may hold spaces, inside parentheses): utime is the
    # 14th field of the line, stime the 15th; in clock ticks.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store_bytes(root: Path, ids: Sequence[int]) -> dict[str, int]:
    """Bytes each server's storage directory ``root/s<id>`` takes (every file in it: data.fs
    and its index, or the log store's segments, spares and free ones alike)."""
    sizes: dict[str, int] = {}
    for sid in ids:
        directory = root / f"s{sid}"
        files = directory.rglob("*") if directory.exists() else iter(())
        sizes[str(sid)] = sum(p.stat().st_size for p in files if p.is_file())
    return sizes
