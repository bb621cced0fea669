"""The web console (``aaabus console``) in a real headless browser against a live bus.

A bus of five server processes in two domains joined by a router, with MQTT devices: the page
shows every server, the domain graph and its router, figures that move while a stream runs, a
device that connects, a server SIGKILLed (down within 5 s) and restarted (up again); bad input
(a config with errors, a key of the wrong scope, a key of another bus, a bus that is not
running) gives one line at start or a message on the page. The screenshots it takes are the
ones docs/operations.md shows, written there with ``AAABUS_CONSOLE_SHOTS=docs/img``.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.secret import ensure_secret
from aaabus.config.topology import generate
from aaabus.tools.launch import Bus
from tests.support.console import browser_page, console, needs_browser, shots
from tests.support.harness import REPO_ROOT, contiguous_free_base, free_ports
from tests.support.mqtt import Device
from tests.support.tls import make_certificate

pytestmark = [pytest.mark.slow, needs_browser]

#: Two domains, server 2 the router between them.
LAYOUT = [[0, 1, 2], [2, 3, 4]]
PUBLISHER, SUBSCRIBER, KILLED = 1, 4, 3


def _figure(page: Any, server: int, name: str) -> float:
    text = page.inner_text(f'#servers tr[data-server="{server}"] td[data-figure="{name}"]')
    return float(text or 0)


def _api(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=10) as answer:
        return json.load(answer)


def test_the_console_shows_a_live_bus_in_a_browser(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    started = time.monotonic()
    mqtt = dict(zip((PUBLISHER, SUBSCRIBER), free_ports(2), strict=True))
    config = make_config(
        layout=LAYOUT,
        extra={s: f'<property name="aaabus.mqtt.port" value="{p}"/>' for s, p in mqtt.items()},
        properties={"aaabus.mqtt.anonymous": "true", "aaabus.mqtt.roaming": "true"},
    )
    with (
        Bus(config, range(5), tmp_path / "store", cwd=REPO_ROOT) as bus,
        console(config) as shown,
        browser_page() as page,
    ):
        page.goto(shown.url)
        # Every server, up, and the graph: two domains, the router drawn as one.
        page.wait_for_function(
            "document.querySelectorAll('#servers tr[data-state=\"up\"]').length === 5",
            timeout=10_000,
        )
        assert page.locator("#graph g.hub").count() == 2
        assert page.locator('#graph g.srv[data-server="2"] [data-router="true"]').count() == 1
        assert page.locator("#graph line.edge.up").count() == 6  # 4 servers x 1 + router x 2

        # A device that connects appears in the client list; a stream makes the counts move.
        # A persistent session: with roaming on, anchored where it was created.
        subscriber = Device(mqtt[SUBSCRIBER], "console-watcher", clean=False)
        publisher = Device(mqtt[PUBLISHER], "console-sensor-7")
        assert subscriber.connect()[0] == 0 and publisher.connect()[0] == 0
        subscriber.subscribe("plant/#", 1)
        page.wait_for_selector('#clients tr[data-client="console-sensor-7"]', timeout=5_000)
        page.fill("#client-search", "sensor")
        assert page.locator("#clients tbody tr").count() == 1
        page.fill("#client-search", "")
        before = _figure(page, PUBLISHER, "publications_in")
        stop = threading.Event()

        def stream() -> None:
            n = 0
            while not stop.is_set() and n < 2000:  # bounded: ~10 s at most
                publisher.publish(f"plant/line{n % 3}", b"%d" % n, 1)
                n += 1
                stop.wait(0.005)

        streamer = threading.Thread(target=stream, name="console-stream", daemon=True)
        streamer.start()
        try:
            page.wait_for_function(
                f"""() => {{
                  const cell = (s, k) => Number(document.querySelector(
                    `#servers tr[data-server="${{s}}"] td[data-figure="${{k}}"]`
                  )?.textContent || 0);
                  return cell({PUBLISHER}, "publications_in") > {before} + 20
                    && cell({PUBLISHER}, "msgs_out_per_s") > 0
                    && cell({SUBSCRIBER}, "publications_out") > 0;
                }}""",
                timeout=10_000,
            )
            page.wait_for_selector("#topics td:text-is('plant/#')", timeout=5_000)
            page.wait_for_selector(
                f'#roaming tr[data-client="console-watcher"][data-anchor="{SUBSCRIBER}"]',
                timeout=5_000,
            )
            page.screenshot(path=str(shots(tmp_path) / "console-bus.png"), full_page=True)
        finally:
            stop.set()
            streamer.join(15)
        servers = _api(shown.url, "api/servers")
        assert [s["id"] for s in servers] == [0, 1, 2, 3, 4]
        assert [s["router"] for s in servers] == [False, False, True, False, False]
        assert servers[PUBLISHER]["figures"]["publications_in"] > before

        # SIGKILL: down on the page within 5 s, and the rest keeps being read.
        bus[KILLED].kill()
        killed_at = time.monotonic()
        page.wait_for_selector(
            f'#servers tr[data-server="{KILLED}"][data-state="down"]', timeout=5_000
        )
        down_after = time.monotonic() - killed_at
        assert page.locator('#servers tr[data-state="up"]').count() == 4
        assert page.locator(f'#graph g.srv.down[data-server="{KILLED}"]').count() == 1
        page.wait_for_selector("#graph line.edge.down", state="attached", timeout=5_000)
        page.screenshot(path=str(shots(tmp_path) / "console-server-down.png"), full_page=True)
        # A server that hangs (SIGSTOP): no longer up within 5 s, whatever its socket says.
        hung = bus[0]
        assert hung.proc is not None
        hung.proc.send_signal(signal.SIGSTOP)
        try:
            page.wait_for_selector(
                '#servers tr[data-server="0"]:not([data-state="up"])', timeout=5_000
            )
        finally:
            hung.proc.send_signal(signal.SIGCONT)
        page.wait_for_selector('#servers tr[data-server="0"][data-state="up"]', timeout=10_000)
        bus[KILLED].start().wait_ready(60)
        page.wait_for_selector(
            f'#servers tr[data-server="{KILLED}"][data-state="up"]', timeout=10_000
        )
        subscriber.close()
        publisher.close()
    print(
        f"console browser test: down after {down_after:.2f}s, "
        f"whole test {time.monotonic() - started:.1f}s"
    )


def test_a_bus_of_150_servers_that_are_not_running_is_shown_down(tmp_path: Path) -> None:
    config = tmp_path / "a3.xml"
    config.write_text(generate("star", 150, domain_size=10, base_port=contiguous_free_base(1)))
    ensure_secret(tmp_path / "bus.key")
    with console(config) as shown, browser_page() as page:
        page.goto(shown.url)
        page.wait_for_function(
            "document.querySelectorAll('#servers tr[data-state=\"down\"]').length === 150",
            timeout=5_000,
        )
        assert page.locator("#graph g.srv").count() == 150
        assert "does not answer" in page.inner_text('#servers tr[data-server="149"] td.why')
        page.screenshot(path=str(shots(tmp_path) / "console-150-down.png"))


def test_a_key_of_another_bus_is_a_message_on_the_page(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config("flat", 1)
    other = tmp_path / "other.key"
    ensure_secret(other)
    with (
        Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT),
        console(config, "--key", str(other)) as shown,
        browser_page() as page,
    ):
        page.goto(shown.url)
        page.wait_for_selector("#banner:not([hidden])", timeout=5_000)
        assert "refuse" in page.inner_text("#banner")
        assert page.locator('#servers tr[data-state="refused"]').count() == 1


def _start_fails(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "aaabus", "console", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_at_start_is_one_line(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    broken = tmp_path / "broken.xml"
    broken.write_text("<config><server id='x'/></config>")
    assert "broken.xml" in _start_fails(str(broken))
    config = make_config("flat", 2)
    operate = tmp_path / "operate.key"
    subprocess.run(
        [sys.executable, "-m", "aaabus", "secret", "--tool", "--scope", "operate",
         "--from", str(tmp_path / "bus.key"), "--out", str(operate)],
        check=True, cwd=REPO_ROOT,
    )  # fmt: skip
    assert "read key only" in _start_fails(str(config), "--key", str(operate))
    assert "loopback" in _start_fails(str(config), "--host", "0.0.0.0")
    assert "not found" in _start_fails(str(config), "--key", str(tmp_path / "nothing.key"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "choose another --port" in _start_fails(str(config), "--port", port)


def _post(url: str, body: Any, token: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["X-Console-Token"] = token
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_stopping_a_server_needs_an_operate_key_the_token_and_its_name(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config("flat", 2)
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT) as bus:
        with console(config) as reader:  # read only: no token, and stop refused
            assert _api(reader.url, "api/session") == {"operate": False, "token": None}
            code, answer = _post(reader.url + "api/servers/1/stop", {"confirm": "s1"}, "x")
            assert code == 403 and "operate key" in answer["error"]
        with console(config, "--operate-key", str(tmp_path / "bus.key")) as operator:
            token = _api(operator.url, "api/session")["token"]
            stop = operator.url + "api/servers/1/stop"
            assert _post(stop, {"confirm": "s1"}, None)[0] == 403
            assert _post(stop, {"confirm": "s1"}, "not-the-token")[0] == 403
            code, answer = _post(stop, {"confirm": "s0"}, token)  # another server's name
            assert code == 400 and "'s1'" in answer["error"]
            assert bus[1].running()
            assert _post(stop, {"confirm": "s1"}, token) == (200, {"ok": True, "stopped": 1})
            assert bus[1].proc is not None and bus[1].proc.wait(30) == 0
            assert bus[0].running()


def test_the_console_serves_https_with_the_operators_certificate(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """``--tls-cert``/``--tls-key``: the page and its API over HTTPS only, the certificate the
    operator gave; a client that does not trust it, or speaks plain HTTP, gets nothing."""
    cert, key = make_certificate(tmp_path, "console")
    config = make_config("flat", 2)
    with console(config, "--tls-cert", str(cert), "--tls-key", str(key)) as shown:
        assert shown.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(shown.url + "api/servers", timeout=20, context=trusted) as ok:
            servers = json.load(ok)
        assert [s["id"] for s in servers] == [0, 1]
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(shown.url + "api/servers", timeout=20)
        plain = "http://" + shown.url.removeprefix("https://")
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(plain + "api/servers", timeout=20)
