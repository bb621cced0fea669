"""The project's commands run as a user runs them, and their answer to a bad input judged."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.harness import REPO_ROOT


def cli(tool: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m TOOL ARGS`` (``aaabus``, or ``perf`` for its suites) from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", tool, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def the_json_line(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What a suite run with ``--json`` printed: exit status 0, and one line, its JSON object."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints the JSON line only"
    out: dict[str, Any] = json.loads(lines[0])
    return out


def one_clean_error(proc: subprocess.CompletedProcess[str], *needles: str, prog: str) -> None:
    """``proc`` refused its input as the project's commands do: exit status 2 and one line,
    ``PROG: error: ...``, holding every needle; no traceback (neither Python's nor the JVM's)."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: ")
    assert "Traceback" not in proc.stderr and "java." not in proc.stderr
    for needle in needles:
        assert needle in lines[0]
