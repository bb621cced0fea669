"""Helpers of the MQTT tests: paho devices that collect what they receive, and the Debian
``mosquitto_pub``/``mosquitto_sub`` tools."""

from __future__ import annotations

import queue
import shutil
import subprocess
import time
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

#: The Debian clients (package mosquitto-clients); tests that run them skip without them.
TOOLS = shutil.which("mosquitto_pub") is not None and shutil.which("mosquitto_sub") is not None
needs_tools = pytest.mark.skipif(not TOOLS, reason="apt-get install mosquitto-clients")


class Device:
    """A paho client (MQTT 3.1.1) whose received messages land in :attr:`inbox`.

    ``connect()`` waits for CONNACK and returns its reason code (0: accepted)."""

    def __init__(
        self,
        port: int,
        client_id: str,
        *,
        clean: bool = True,
        user: str | None = None,
        password: str | None = None,
        will: tuple[str, bytes, int] | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self.port = port
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean
        )
        self.inbox: queue.Queue[tuple[str, bytes, int, bool]] = queue.Queue()
        self.connack: queue.Queue[Any] = queue.Queue()
        self.suback: queue.Queue[Any] = queue.Queue()
        self.client.on_message = lambda _c, _u, m: self.inbox.put(
            (m.topic, bytes(m.payload), m.qos, bool(m.retain))
        )
        self.client.on_connect = lambda _c, _u, flags, rc, _p: self.connack.put(
            (rc.value, flags.session_present)
        )
        self.client.on_subscribe = lambda _c, _u, mid, codes, _p: self.suback.put(mid)
        if user is not None:
            self.client.username_pw_set(user, password)
        if will is not None:
            self.client.will_set(will[0], will[1], will[2])
        if tls_ca is not None:
            self.client.tls_set(ca_certs=tls_ca)
            self.client.tls_insecure_set(True)  # the test certificate names 127.0.0.1 only

    def connect(self, timeout: float = 10.0) -> tuple[int, bool]:
        self.client.connect("127.0.0.1", self.port, keepalive=30)
        self.client.loop_start()
        result: tuple[int, bool] = self.connack.get(timeout=timeout)
        return result

    def pause(self) -> None:
        """Stop paho's network thread: no packet is read or written, no reconnection tried."""
        self.client.loop_stop()

    def resume(self, timeout: float = 10.0) -> tuple[int, bool]:
        """Reconnect once (paho resends its unfinished QoS flows) and restart the thread."""
        self.client.reconnect()
        self.client.loop_start()
        result: tuple[int, bool] = self.connack.get(timeout=timeout)
        return result

    def subscribe(self, topic_filter: str, qos: int, timeout: float = 10.0) -> None:
        self.client.subscribe(topic_filter, qos)
        self.suback.get(timeout=timeout)

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos, retain).wait_for_publish(10)

    def receive(self, count: int, timeout: float = 20.0) -> list[tuple[str, bytes, int, bool]]:
        """Exactly ``count`` messages (fails if fewer arrive by the deadline)."""
        deadline = time.monotonic() + timeout
        out: list[tuple[str, bytes, int, bool]] = []
        while len(out) < count:
            out.append(self.inbox.get(timeout=max(0.01, deadline - time.monotonic())))
        return out

    def nothing_more(self, wait: float = 0.5) -> bool:
        try:
            self.inbox.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def tool(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run a mosquitto client tool to its end."""
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
