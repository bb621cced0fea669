"""TLS handshakes from strangers do not stall established links.

Server 0 runs in the test process (so that the test can see its threads), server 1 is a real
process holding an echo agent; every round trip crosses server 0's I/O thread twice. A separate
process floods server 0's network port with TLS ClientHellos, each of which makes the server
compute a key exchange and a signature. The round trips before, during and after the flood are
printed (``pytest -s``); the handshakes must have run on the ``-tls`` worker threads, not on the
I/O thread (which ran every one of them in the old code).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentServer
from aaabus.config.reader import load_config
from aaabus.testing.workload import Bounce, Echo
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, Inbox
from tests.support.tls import make_certificate

pytestmark = pytest.mark.slow  # a server process and a flooding process

FLOOD_SECONDS = 4.0


def round_trips(
    server0: AgentServer, inbox: Inbox, echo: Any, count: int, first: int
) -> list[float]:
    times = []
    for i in range(first, first + count):
        started = time.perf_counter()
        server0.send(echo, Bounce(i))
        assert inbox.get(timeout=10.0) == Bounce(i)
        times.append(time.perf_counter() - started)
    return times


def test_a_tls_handshake_flood_leaves_established_links_alone(
    tmp_path: Path, make_config: Any
) -> None:
    make_certificate(tmp_path, "bus")
    props = {"aaabus.tls.cert": "bus.pem", "aaabus.tls.key": "bus-key.pem"}
    config = make_config(servers=2, properties=props)
    cfg = load_config(config)
    port = cfg.server(0).networks[0].port
    with Bus(config, [1], tmp_path / "store", cwd=REPO_ROOT):
        server0 = AgentServer(cfg, 0, storage=tmp_path / "s0")
        server0.start()
        inbox = Inbox()
        server0.add_listener(inbox)
        try:
            echo = server0.deploy(Echo(), 1)
            round_trips(server0, inbox, echo, 20, 0)  # warm up
            before = round_trips(server0, inbox, echo, 200, 1000)
            flood = subprocess.Popen(
                [sys.executable, "-m", "tests.support.hostile", "tls-flood", "127.0.0.1",
                 str(port), str(FLOOD_SECONDS)],
                cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                during: list[float] = []
                workers: set[str] = set()
                deadline = time.monotonic() + FLOOD_SECONDS - 0.5
                while time.monotonic() < deadline:
                    during += round_trips(server0, inbox, echo, 10, 2000 + len(during))
                    workers |= {t.name for t in threading.enumerate() if "-tls" in t.name}
                out, _ = flood.communicate(timeout=FLOOD_SECONDS + 30)
            finally:
                if flood.poll() is None:
                    flood.kill()
                    flood.wait()
            after = round_trips(server0, inbox, echo, 200, 5000)
        finally:
            server0.stop()
    handshakes = int(out.strip())

    def ms(values: list[float]) -> str:
        q = statistics.quantiles(values, n=100)
        return f"median {statistics.median(values) * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms"

    print(f"\nround trip before: {ms(before)} ({len(before)})")
    print(f"round trip during: {ms(during)} ({len(during)}, {handshakes} TLS handshakes)")
    print(f"round trip after:  {ms(after)} ({len(after)})")
    assert handshakes > 50, "the flood did not make the server handshake"
    assert workers, "TLS handshakes ran on the I/O thread"
    # Generous (a shared 2-core machine): the figures above are the measurement.
    assert statistics.median(during) < 5 * statistics.median(before) + 0.010
