"""The code blocks of the documentation run, in order, against a real bus.

Fences say what to do with a block (the first word stays the language, for highlighting):

* ```` ```python file=NAME ```` — written to ``NAME`` in the working directory;
* ```` ```python run ```` — run with Python;
* ```` ```console run ```` — every ``$ command`` line is run by bash (``set -e``); the other lines
  are sample output and are not compared. A command ending in ``&`` keeps running in the
  background until the doc stops it (the test stops whatever is left).

Any other fence (``python``, ``console``, ``text``, ``xml``...) is illustrative and not run. All
blocks of one file share one temporary directory, and ``--base-port N`` is replaced with free
ports, so a doc can use fixed, readable numbers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples._bus import free_base
from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

DOCS = ["README.md", "docs/tutorial.md", "docs/operations.md"]
FENCE = re.compile(r"^```(\w+)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, info, body)`` of every block the test must write or run."""
    return [
        (lang, info.strip(), body)
        for lang, info, body in FENCE.findall(text)
        if info.strip() == "run" or info.strip().startswith("file=")
    ]


def console_script(body: str) -> str:
    commands = [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
    return "set -e\n" + "\n".join(commands) + "\n"


def stop_group(pgid: int, timeout: float = 20.0) -> None:
    """SIGTERM a process group we started (aaabus launch then stops its servers), then KILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_blocks_run(doc: str, tmp_path: Path) -> None:
    text = (REPO_ROOT / doc).read_text()
    blocks = runnable_blocks(text)
    assert blocks, f"{doc} has no runnable block"
    base = free_base(20)  # and their admin ports, +1000
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(tmp_path)
    env["PYTHONUNBUFFERED"] = "1"
    groups: list[int] = []
    log = tmp_path / "_output.log"
    try:
        with log.open("w") as out:
            for number, (lang, info, body) in enumerate(blocks):
                body = re.sub(r"--base-port \d+", f"--base-port {base}", body)
                where = f"{doc}, runnable block {number + 1} ({lang} {info})"
                if info.startswith("file="):
                    (tmp_path / info[5:]).write_text(body)
                    continue
                if lang == "python":
                    script = tmp_path / f"_block{number}.py"
                    script.write_text(body)
                    command = [sys.executable, str(script)]
                elif lang == "console":
                    command = ["bash", "-c", console_script(body)]
                else:
                    raise AssertionError(f"{where}: cannot run {lang}")
                out.write(f"--- {where}\n")
                out.flush()
                proc = subprocess.Popen(
                    command,
                    cwd=tmp_path,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own group: background jobs stopped with it
                )
                groups.append(proc.pid)
                try:
                    code = proc.wait(120)
                except subprocess.TimeoutExpired:
                    code = None
                assert code == 0, f"{where} failed ({code}):\n{log.read_text()[-3000:]}"
    finally:
        if (tmp_path / "a3.xml").exists():
            subprocess.run(
                [sys.executable, "-m", "aaabus", "stop", "a3.xml", "--timeout", "20"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                timeout=60,
            )
        for pgid in groups:
            stop_group(pgid)
