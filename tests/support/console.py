"""Helpers of the console tests: an ``aaabus console`` process and a headless Chromium.

The browser is Debian's (``make browser`` installs it), driven by Playwright's Python package
with ``executable_path``: Playwright never downloads a browser of its own here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page

from perf.console import ARGS, CHROMIUM
from tests.support.harness import REPO_ROOT

needs_browser = pytest.mark.skipif(
    not os.access(CHROMIUM, os.X_OK), reason="apt-get install chromium (make browser)"
)
#: A quiet, offline browser (the one ``python -m perf console`` times): no first-run, no
#: updates, no sync, no QUIC, no GPU.
BROWSER_ARGS = ARGS


def shots(tmp_path: Path) -> Path:
    """Where the browser tests' screenshots go: docs/img (the pictures docs/operations.md
    shows) only when asked, ``AAABUS_CONSOLE_SHOTS=docs/img``, so that a test run leaves the
    checkout as it found it; otherwise the test's own ``tmp_path``, which pytest clears (a
    directory of the temporary area per run was left behind by every run)."""
    asked = os.environ.get("AAABUS_CONSOLE_SHOTS")
    return Path(asked) if asked else tmp_path


class ConsoleProcess:
    """``aaabus console`` started on a free port; :attr:`url` once it printed its ready line."""

    def __init__(self, config: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aaabus", "console", str(config), "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO_ROOT,
        )
        self.url = self._ready_line(30.0)

    def _ready_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        found: list[str] = []
        reader = threading.Thread(
            target=lambda: found.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
            name="console-ready",
            daemon=True,
        )
        reader.start()
        reader.join(timeout)
        line = found[0] if found else ""
        if not line.startswith("aaabus console: http"):
            self.stop()
            raise AssertionError(f"the console did not start: {line!r}")
        return line.split()[2]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextmanager
def console(config: Path, *extra: str) -> Iterator[ConsoleProcess]:
    process = ConsoleProcess(config, *extra)
    try:
        yield process
    finally:
        process.stop()


@contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A Playwright page of a fresh headless Chromium with its own empty profile."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="aaabus-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=BROWSER_ARGS,
            viewport={"width": width, "height": height},
            # The page forbids eval (its Content-Security-Policy); Playwright's waits on a
            # JavaScript condition evaluate one, so the test's browser lets them through.
            bypass_csp=True,
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
