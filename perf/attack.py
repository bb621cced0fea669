"""``python -m perf attack``: what an attacker's bytes cost an MQTT listener (issue 44).

Each attack runs against a fresh one-server bus on 127.0.0.1 (a server process: its CPU seconds
from ``/proc/<pid>/stat``, its RSS from ``/proc/<pid>/status``, the bytes its storage directory
grew by) and stops by itself; the attacker is this process. Attacks (``--attack``, all by
default):

* ``logins``: ``--connects`` CONNECTs of a real user with a wrong password from 127.0.0.2, in
  waves of 200 sockets closed after sending; a device with the right password from 127.0.0.1
  connects during the flood. Measured: the server's CPU until it is idle again, how long it stayed
  busy after the last CONNECT, the device's time to CONNACK, and the refusal time of an unknown
  and a known user (user enumeration: medians of 5).
* ``anonymous``: devices without a user name publish 300 retained topics and open 60 persistent
  sessions, with ``retained_total=20`` and ``sessions_per_user=3``.
* ``wills``: 60 devices of one user leave retained wills of 2,000 bytes, with ``retained=5`` and
  ``retained_bytes=10000`` (no credentials file: the user name is taken as given).
* ``userprops``: six 5.0 PUBLISH packets of ~1 MiB of small user properties, each on a connection
  of its own, while another device pings every 10 ms: its slowest PINGRESP.

Runs against whatever ``aaabus`` this checkout holds, so the same command measures before and
after a change (run it from a checkout of the old commit). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aaabus import Client
from aaabus.mqtt.auth import hash_password
from perf.aaabus_mqtt import mqtt_servers
from perf.harness import cpu_seconds, rss_bytes, store_bytes

ATTACKS = ("logins", "anonymous", "wills", "userprops")
#: How long the server may stay busy after an attack before the measure stops waiting.
IDLE_DEADLINE_S = 120.0


def _text(raw: bytes) -> bytes:
    return len(raw).to_bytes(2, "big") + raw


def _connect(
    client_id: str,
    user: bytes | None = None,
    password: bytes | None = None,
    will: tuple[bytes, bytes] | None = None,
    clean: bool = True,
) -> bytes:
    """A 3.1.1 CONNECT (keep-alive 60), built by hand: the attacker is not a library."""
    flags = 0x02 if clean else 0
    rest = b""
    if will is not None:
        flags |= 0x04 | 0x08 | 0x20  # will, QoS 1, retained
        rest += _text(will[0]) + _text(will[1])
    if user is not None:
        flags |= 0x80
        rest += _text(user)
    if password is not None:
        flags |= 0x40
        rest += _text(password)
    body = _text(b"MQTT") + bytes([4, flags]) + (60).to_bytes(2, "big") + _text(client_id.encode())
    return _fixed(0x10, body + rest)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _fixed(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def _open(port: int, data: bytes, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _read(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("closed by the server")
        data += chunk
    return data


def _packet(sock: socket.socket) -> tuple[int, bytes]:
    """The server's next packet: its first byte, its body."""
    first = _read(sock, 1)[0]
    length, shift = 0, 0
    while True:
        byte = _read(sock, 1)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return first, _read(sock, length)


def _connack(sock: socket.socket) -> int:
    """The CONNACK's code (3.1.1 or 5.0)."""
    first, body = _packet(sock)
    assert first == 0x20, first
    return body[1]


class Server:
    """The server under attack: its PID, storage, status; the cost of what happens since
    :meth:`mark`."""

    def __init__(self, pid: int, store: Path, config: Path) -> None:
        self.pid, self.store, self.config = pid, store, config
        self.mark()

    def mark(self) -> None:
        self._cpu, self._bytes = cpu_seconds(self.pid), self._stored()
        self._written, self._rss = self._disk_writes(), rss_bytes(self.pid)

    def _stored(self) -> int:
        return store_bytes(self.store, [0])["0"]

    def _disk_writes(self) -> int:
        """Bytes the process had the kernel write to disk (``write_bytes`` of
        ``/proc/<pid>/io``): what a preallocated log store writes, whose files do not grow."""
        for line in Path(f"/proc/{self.pid}/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
        return 0

    def status(self) -> dict[str, Any]:
        client = Client(self.config, 0)
        try:
            return client.status()
        finally:
            client.close()

    def idle(self, since: float) -> float:
        """Wait until the server uses under 5 % of a CPU over half a second; the seconds from
        ``since`` (a ``time.monotonic()``) until then (capped by the deadline)."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        last = cpu_seconds(self.pid)
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = cpu_seconds(self.pid)
            if now - last < 0.025:
                return time.monotonic() - 0.5 - since
            last = now
        return time.monotonic() - since

    def cost(self) -> dict[str, Any]:
        return {
            "server_cpu_s": round(cpu_seconds(self.pid) - self._cpu, 2),
            "disk_bytes_written": self._disk_writes() - self._written,
            "store_growth_bytes": self._stored() - self._bytes,
            "rss_growth_bytes": rss_bytes(self.pid) - self._rss,
        }


def _attack_logins(server: Server, port: int, connects: int) -> dict[str, Any]:
    sent = 0
    legit: dict[str, Any] = {}

    def device() -> None:
        started = time.monotonic()
        try:
            sock = _open(port, _connect("legit", b"meter", b"pw"))
            legit["code"] = _connack(sock)
            sock.close()
        except (OSError, EOFError) as exc:
            legit["error"] = str(exc)
        legit["connack_s"] = round(time.monotonic() - started, 3)

    started = time.monotonic()
    thread = threading.Thread(target=device, name="legit-device")
    for wave in range(0, connects, 200):
        if wave >= connects // 2 and not thread.is_alive() and not legit:
            thread.start()  # during the flood
        socks = []
        for i in range(wave, min(connects, wave + 200)):
            data = _connect(f"f{i}", b"meter", b"wrong")
            sent += len(data)
            try:
                socks.append(_open(port, data, "127.0.0.2"))
            except OSError:
                continue
        for sock in socks:
            sock.close()
    flood_end = time.monotonic()
    busy_after = server.idle(flood_end)
    if thread.is_alive():
        thread.join(60)
    result = {
        "attacker_bytes": sent,
        "flood_s": round(flood_end - started, 2),
        "busy_after_flood_s": round(busy_after, 2),
        "legit_device": legit,
        **server.cost(),
    }
    figures = server.status().get("mqtt", {})
    result["logins_checked"] = figures.get("logins_checked")

    def refusal_s(user: bytes) -> float | None:
        """The median time to CONNACK (None: closed without one, the server still busy)."""
        times = []
        for _ in range(5):
            begun = time.monotonic()
            sock = _open(port, _connect("probe", user, b"wrong"))
            try:
                _connack(sock)
            except EOFError:
                return None
            finally:
                sock.close()
            times.append(time.monotonic() - begun)
        return round(statistics.median(times) * 1000, 2)

    result["refusal_ms"] = {"unknown_user": refusal_s(b"ghost"), "known_user": refusal_s(b"meter")}
    return result


def _attack_anonymous(server: Server, port: int) -> dict[str, Any]:
    sent = 0
    data = _connect("anon-pub")
    for i in range(300):
        data += _fixed(
            0x33, _text(f"anon/{i}".encode()) + (i % 65535 + 1).to_bytes(2, "big") + b"v"
        )
    sock = _open(port, data)
    sent += len(data)
    for _ in range(301):  # CONNACK, every PUBACK
        _packet(sock)
    sock.close()
    refused = 0
    for i in range(60):
        packet = _connect(f"anon-{i}", clean=False)
        sent += len(packet)
        session = _open(port, packet)
        refused += _connack(session) != 0
        session.close()
    status = server.status()
    return {
        "attacker_bytes": sent,
        "retained_kept": status["topics"]["retained"],
        "sessions_kept": status["mqtt"]["sessions_stored"],
        "sessions_refused": refused,
        **server.cost(),
    }


def _attack_wills(server: Server, port: int) -> dict[str, Any]:
    sent = 0
    for i in range(60):
        packet = _connect(f"w-{i}", b"meter", None, (f"will/{i}".encode(), b"x" * 2000))
        sent += len(packet)
        sock = _open(port, packet)
        _connack(sock)
        sock.close()  # no DISCONNECT: the will goes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # every will handled: published or refused
        status = server.status()
        if status["topics"]["retained"] + status["mqtt"]["refused"] >= 60:
            break
        time.sleep(0.2)
    return {"attacker_bytes": sent, "retained_kept": status["topics"]["retained"], **server.cost()}


def _attack_userprops(server: Server, port: int) -> dict[str, Any]:
    pinger = _open(port, _connect("pinger"))
    _connack(pinger)
    delays: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            begun = time.monotonic()
            pinger.sendall(b"\xc0\x00")
            _packet(pinger)
            delays.append(time.monotonic() - begun)
            stop.wait(0.01)

    thread = threading.Thread(target=ping, name="pinger")
    thread.start()
    pairs = b"".join(b"\x26" + _text(b"k%d" % (i % 10)) + _text(b"v") for i in range(130_000))
    props = _varint(len(pairs)) + pairs
    publish = _fixed(0x32, _text(b"up/x") + b"\x00\x01" + props + b"payload")
    connect = _fixed(
        0x10,
        _text(b"MQTT") + bytes([5, 0x02]) + (60).to_bytes(2, "big") + b"\x00" + _text(b"flood"),
    )
    sent = 0
    answers = []
    for _ in range(6):
        sock = _open(port, connect + publish)
        sent += len(connect) + len(publish)
        _connack(sock)
        try:
            answers.append(_packet(sock)[0])  # PUBACK 0x40 or DISCONNECT 0xe0
        except (EOFError, OSError):
            answers.append(-1)
        sock.close()
    server.idle(time.monotonic())
    stop.set()
    thread.join(10)
    pinger.close()
    return {
        "attacker_bytes": sent,
        "answers_first_byte": sorted(set(answers)),
        "ping_max_ms": round(max(delays) * 1000, 1),
        "ping_median_ms": round(statistics.median(delays) * 1000, 2),
        **server.cost(),
    }


def _one(name: str, connects: int) -> dict[str, Any]:
    properties: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="aaabus-attack-") as tmp:
        work = Path(tmp)
        if name == "logins":
            (work / "mqtt.passwd").write_text(f"meter:{hash_password('pw')}\n")
            properties = {
                "aaabus.mqtt.credentials": "mqtt.passwd",
                "aaabus.mqtt.anonymous": "false",
            }
        elif name == "anonymous":
            properties = {"aaabus.mqtt.retained_total": "20", "aaabus.mqtt.sessions_per_user": "3"}
        elif name == "wills":
            properties = {"aaabus.mqtt.retained": "5", "aaabus.mqtt.retained_bytes": "10000"}
        with mqtt_servers(work, [[0]], {0: 100}, properties=properties) as servers:
            port = servers.endpoints[0].port
            server = Server(servers.pids[0], work / "store", work / "a3.xml")
            attacks: dict[str, Callable[[], dict[str, Any]]] = {
                "logins": lambda: _attack_logins(server, port, connects),
                "anonymous": lambda: _attack_anonymous(server, port),
                "wills": lambda: _attack_wills(server, port),
                "userprops": lambda: _attack_userprops(server, port),
            }
            return attacks[name]()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attack", action="append", choices=ATTACKS, help="(default: all)")
    parser.add_argument("--connects", type=int, default=4000, help="logins: CONNECTs sent")


def run(args: argparse.Namespace) -> int:
    results = {}
    for name in args.attack or ATTACKS:
        results[name] = _one(name, args.connects)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    print(json.dumps(results))
    return 0
