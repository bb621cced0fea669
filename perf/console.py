"""The console's page load on a large bus: ``python -m perf console [--servers 150]``.

Generates a star-style config of ``--servers`` servers (none of them running, the worst case:
every one is read as down), starts ``aaabus console`` on it, and loads its page in Debian's
headless Chromium ``--runs`` times, each time in a fresh page: the time from navigation to the
page showing every server (one row each, every one marked down), its median and worst. The
acceptance bound is 2 s (docs/operations.md, "The console"). Needs ``aaabus[console]``,
Playwright's Python package and ``/usr/bin/chromium`` (``make browser``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aaabus.config.secret import ensure_secret
from aaabus.config.topology import generate
from aaabus.tools.launch import free_port_base

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BOUND_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=int, default=150, help="servers in the config")
    parser.add_argument("--runs", type=int, default=5, help="page loads measured")


def run(args: argparse.Namespace) -> int:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="perf-console-") as work:
        config = Path(work) / "a3.xml"
        config.write_text(generate("star", args.servers, base_port=free_port_base(args.servers)))
        ensure_secret(Path(work) / "bus.key")
        proc = subprocess.Popen(
            [sys.executable, "-m", "aaabus", "console", str(config), "--port", "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split()[2]
            loads = []
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                for _ in range(args.runs):
                    # bypass_csp: the page forbids eval, which the wait below needs.
                    page = browser.new_page(
                        viewport={"width": 1400, "height": 1000}, bypass_csp=True
                    )
                    started = time.perf_counter()
                    page.goto(url)
                    page.wait_for_function(
                        "document.querySelectorAll('#servers tr[data-state=\"down\"]').length"
                        f" === {args.servers}",
                        timeout=30_000,
                    )
                    loads.append(time.perf_counter() - started)
                    page.close()
                browser.close()
        finally:
            proc.terminate()
            proc.wait(10)
    result = {
        "servers": args.servers,
        "runs": args.runs,
        "load_s_median": round(statistics.median(loads), 3),
        "load_s_max": round(max(loads), 3),
        "bound_s": BOUND_S,
        "within_bound": max(loads) < BOUND_S,
    }
    print(json.dumps(result))
    return 0 if result["within_bound"] else 1
