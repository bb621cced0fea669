"""Helpers for tests that run a bus of real server processes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aaabus.config.reader import load_config
from aaabus.tools.launch import ServerProcess


def add_to_server(config: Path, server_id: int, xml: str) -> None:
    """Splice ``xml`` into ``<server id=server_id>`` of the config file."""
    text = config.read_text()
    start = text.index(f'<server id="{server_id}"')
    end = text.index("</server>", start)
    config.write_text(text[:end] + "  " + xml + "\n  " + text[end:])


def listen_port(config: Path, server_id: int) -> int:
    return load_config(config).servers[server_id].networks[0].port


def wait_json(path: Path, procs: Iterable[ServerProcess], timeout: float) -> Any:
    """Wait for an agent's result file; fail at once if a server process died meanwhile."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    procs = list(procs)
    while not path.exists():
        for proc in procs:
            if not proc.running():
                raise AssertionError(
                    f"server {proc.server_id} died: {' | '.join(list(proc.lines)[-5:])}"
                )
        if time.monotonic() > deadline:
            tails = {p.server_id: list(p.lines)[-3:] for p in procs}
            raise AssertionError(f"no {path.name} after {timeout}s; server output: {tails}")
        pause.wait(0.02)  # the file is written by another process: nothing to wait on but time
    return json.loads(path.read_text())
