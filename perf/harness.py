"""Running a bus of real server processes for a measurement, and always cleaning up after it."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from defusedxml.ElementTree import parse as safe_parse

from aaabus.config.reader import BusConfig, load_config
from aaabus.tools.launch import Bus

REPO_ROOT = Path(__file__).resolve().parent.parent


def with_services(
    src: str | Path,
    dst: Path,
    services: Mapping[int, Sequence[tuple[str, str]]],
    properties: Mapping[str, str] | None = None,
) -> Path:
    """Copy config ``src`` to ``dst`` adding boot services per server and global properties."""
    tree = safe_parse(str(src))
    root = tree.getroot()
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


def store_bytes(root: Path, ids: Sequence[int]) -> dict[str, int]:
    """Bytes each server's storage directory ``root/s<id>`` takes (every file in it: data.fs
    and its index, or the log store's segments, spares and free ones alike)."""
    sizes: dict[str, int] = {}
    for sid in ids:
        directory = root / f"s{sid}"
        files = directory.rglob("*") if directory.exists() else iter(())
        sizes[str(sid)] = sum(p.stat().st_size for p in files if p.is_file())
    return sizes
