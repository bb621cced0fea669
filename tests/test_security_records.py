"""The store loads only what it wrote: records planted in a stopped server's store are refused.

Each payload of the attack review of issue 30 is planted as the root record of a store, which
is then opened the way a server opens it: in this process (through ``open_store`` with the
test suite's trust policy) and at boot of a real server process. The store must refuse it with
one line naming the record (its oid) and the global or opcode at fault, before any of it runs:
no marker file, no import of ``aaabus.__main__``, ``AgentId.parse`` unchanged, no gigabytes.
Before the fix each payload ran (or allocated) at the first load.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentId
from aaabus.config.trust import TrustPolicy
from aaabus.core.store import open_store
from aaabus.errors import StoreError
from tests.support import records
from tests.support.harness import REPO_ROOT, TEST_TRUST
from tests.support.records import BOMBS, glob, plant_root, root_record


class Pair(tuple):
    """A tuple subclass built by tuple.__new__, which copies (or iterates) its argument."""


#: What a refusal must name for each payload, with the payload (the value under "planted").
MARKED: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "walk to FunctionType": (records.walk_to_function, "PersistentMapping.__init__.__class__"),
    "walk through a trusted module": (
        records.walk_through_a_trusted_module,
        "tests.support.tls.subprocess.Popen",
    ),
}
UNMARKED: dict[str, tuple[bytes, str]] = {
    "aaabus.__main__": (records.MAIN_MODULE, "aaabus.__main__.main"),
    "BUILD AgentId.parse = int": (records.PARSE_BY_INT, "builtins.int"),
    "BUILD AgentId.parse = AgentId": (records.PARSE_BY_CLASS, "BUILD at byte"),
    "NEWOBJ of a tuple subclass over a range": (
        glob(__name__, "Pair") + records.call(glob("builtins", "range"), 10**9) + b"\x85\x81",
        f"{__name__}.Pair",
    ),
    **{name: (payload, "refused to unpickle") for name, payload in BOMBS.items()},
}  # fmt: skip


def planted(kind: str, tmp_path: Path, name: str) -> tuple[Path, Path, str]:
    """A store directory whose root holds the payload ``name``; its marker; what to expect."""
    marker = tmp_path / "pwned"
    if name in MARKED:
        build, says = MARKED[name]
        record = root_record(build(marker))
    elif name == "BUILD across the record's two pickles":
        record, says = records.build_across_pickles(), "BUILD at byte"
    else:
        payload, says = UNMARKED[name]
        record = root_record(payload)
    storage = tmp_path / "s0"
    plant_root(kind, storage, record)
    return storage, marker, says


PAYLOADS = [*MARKED, *UNMARKED, "BUILD across the record's two pickles"]


@contextlib.contextmanager
def agent_id_parse_kept() -> Iterator[None]:
    """Assert that ``AgentId.parse`` is untouched; put it back if a payload changed it (so that
    a failing run leaves the rest of the suite a sane class)."""
    parse = AgentId.__dict__["parse"]
    try:
        yield
    finally:
        changed = AgentId.__dict__["parse"] is not parse
        type.__setattr__(AgentId, "parse", parse)
    assert not changed, "the record changed AgentId.parse for the whole process"
    assert AgentId.parse("#1.2.3") == AgentId(1, 2, 3)


@contextlib.contextmanager
def address_space_capped(extra: int) -> Iterator[None]:
    """Lower this process's address-space limit to its size now plus ``extra`` bytes: a bomb
    that gets through fails with MemoryError instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("kind", ["log", "file"])
@pytest.mark.parametrize("name", PAYLOADS)
def test_a_planted_record_is_refused_in_one_line_and_nothing_of_it_runs(
    tmp_path: Path, kind: str, name: str
) -> None:
    storage, marker, says = planted(kind, tmp_path, name)
    main_loaded = "aaabus.__main__" in sys.modules
    tracemalloc.start()
    try:
        with (
            agent_id_parse_kept(),
            address_space_capped(1 << 30),
            pytest.raises(StoreError) as refused,
        ):
            open_store(kind, storage, 0, TrustPolicy(TEST_TRUST.split(",")))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert "record 0x00" in message and says in message and "\n" not in message, message
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse {name}"
    assert not marker.exists()
    assert ("aaabus.__main__" in sys.modules) == main_loaded


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["log", "file"])
@pytest.mark.parametrize(
    "name",
    [
        "walk to FunctionType",
        "walk through a trusted module",
        "aaabus.__main__",
        "BUILD AgentId.parse = AgentId",
        "BUILD across the record's two pickles",
        "bytearray(2e9)",
        "list(range(1e9))",
        "deque(range(1e9))",
    ],
)
def test_a_planted_record_stops_the_server_at_boot_with_one_line(
    tmp_path: Path, make_config: Any, kind: str, name: str
) -> None:
    config = make_config(servers=1, properties={"aaabus.store": kind})
    storage, marker, says = planted(kind, tmp_path, name)
    code, stderr, peak_kb, seconds = boot(config, storage)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "record 0x00" in lines[0] and says in lines[0], lines[0]
    assert not marker.exists()
    assert peak_kb < 300 << 10, f"the server peaked at {peak_kb} kB refusing {name}"
    assert seconds < 30


def boot(config: Path, storage: Path) -> tuple[int, str, int, float]:
    """Run server 0 on ``storage`` until it exits (killed after 60 s): its exit status, stderr,
    peak resident size (kB, of that process alone) and run time. Its address space is capped
    at 4 GiB so that a bomb that gets through cannot take the machine's memory."""
    err = storage.parent / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aaabus", "server", "--id", "0", "--config", str(config),
             "--storage", str(storage)],
            cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)),
        )  # fmt: skip
    killer = threading.Timer(60, proc.kill)
    started = time.monotonic()
    killer.start()
    try:
        _pid, status, usage = os.wait4(proc.pid, 0)
    finally:
        killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err.read_text(), usage.ru_maxrss, time.monotonic() - started
