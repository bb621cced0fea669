"""libmosquitto, the C client library of the Debian mosquitto tools (package libmosquitto1, a
dependency of mosquitto-clients), driven through ctypes: for what the tools' own option checks
refuse before the library is asked (``mosquitto_sub -k 0`` in 2.0.11)."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

import pytest

_NAME = ctypes.util.find_library("mosquitto")
needs_libmosquitto = pytest.mark.skipif(_NAME is None, reason="apt-get install libmosquitto1")

#: mosquitto.h: MOSQ_OPT_PROTOCOL_VERSION, and MQTT_PROTOCOL_V311 / MQTT_PROTOCOL_V5.
_OPT_PROTOCOL_VERSION = 1
VERSIONS = {3: 4, 5: 5}


class _Message(ctypes.Structure):
    _fields_ = [
        ("mid", ctypes.c_int),
        ("topic", ctypes.c_char_p),
        ("payload", ctypes.c_void_p),
        ("payloadlen", ctypes.c_int),
        ("qos", ctypes.c_int),
        ("retain", ctypes.c_bool),
    ]


_ON_CONNECT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
_ON_MESSAGE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Message))
_ON_SUBSCRIBE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
)


def _library() -> Any:
    lib = ctypes.CDLL(_NAME)
    lib.mosquitto_lib_init()
    lib.mosquitto_new.restype = ctypes.c_void_p
    lib.mosquitto_new.argtypes = [ctypes.c_char_p, ctypes.c_bool, ctypes.c_void_p]
    handle = [ctypes.c_void_p]
    lib.mosquitto_int_option.argtypes = [*handle, ctypes.c_int, ctypes.c_int]
    lib.mosquitto_connect.argtypes = [*handle, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.mosquitto_connect_callback_set.argtypes = [*handle, _ON_CONNECT]
    lib.mosquitto_message_callback_set.argtypes = [*handle, _ON_MESSAGE]
    lib.mosquitto_subscribe_callback_set.argtypes = [*handle, _ON_SUBSCRIBE]
    lib.mosquitto_subscribe.argtypes = [*handle, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.mosquitto_publish.argtypes = [
        *handle,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_bool,
    ]
    lib.mosquitto_loop.argtypes = [*handle, ctypes.c_int, ctypes.c_int]
    lib.mosquitto_disconnect.argtypes = handle
    lib.mosquitto_destroy.argtypes = handle
    return lib


class LibMosquitto:
    """One libmosquitto client (MQTT ``version`` 3 for 3.1.1, or 5), driven by its own
    ``mosquitto_loop`` from the calling thread (each wait below runs it, with a deadline)."""

    def __init__(self, client_id: str, version: int) -> None:
        self._lib = _library()
        self._mosq = self._lib.mosquitto_new(client_id.encode(), True, None)
        self._lib.mosquitto_int_option(self._mosq, _OPT_PROTOCOL_VERSION, VERSIONS[version])
        self.connack: list[int] = []
        self.messages: list[tuple[str, bytes]] = []
        self.subacks: list[list[int]] = []  # each SUBACK's granted QoS
        # Kept as attributes: ctypes callbacks must outlive the C side's use of them.
        self._on_connect = _ON_CONNECT(lambda _m, _u, rc: self.connack.append(rc))
        self._on_message = _ON_MESSAGE(self._message)
        self._on_subscribe = _ON_SUBSCRIBE(
            lambda _m, _u, _mid, n, granted: self.subacks.append([granted[i] for i in range(n)])
        )
        self._lib.mosquitto_connect_callback_set(self._mosq, self._on_connect)
        self._lib.mosquitto_message_callback_set(self._mosq, self._on_message)
        self._lib.mosquitto_subscribe_callback_set(self._mosq, self._on_subscribe)

    def _message(self, _mosq: Any, _user: Any, msg: Any) -> None:
        m = msg.contents
        self.messages.append((m.topic.decode(), ctypes.string_at(m.payload, m.payloadlen)))

    def connect(self, port: int, keep_alive: int) -> int:
        """CONNECT with ``keep_alive``; CONNACK's code (raises if the library refuses first)."""
        rc = self._lib.mosquitto_connect(self._mosq, b"127.0.0.1", port, keep_alive)
        if rc:
            raise OSError(f"mosquitto_connect: error {rc}")
        self.run_until(lambda: self.connack)
        return self.connack[0]

    def subscribe(self, topic_filter: str, qos: int) -> list[int]:
        """SUBSCRIBE; the SUBACK's granted QoS."""
        self._lib.mosquitto_subscribe(self._mosq, None, topic_filter.encode(), qos)
        self.run_until(lambda: self.subacks)
        return self.subacks.pop(0)

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        self._lib.mosquitto_publish(
            self._mosq, None, topic.encode(), len(payload), payload, qos, False
        )

    def run_until(self, done: Any, timeout: float = 10.0) -> None:
        """Run the client's network loop until ``done()`` is true; TimeoutError after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"libmosquitto: nothing after {timeout} s")
            rc = self._lib.mosquitto_loop(self._mosq, 50, 1)
            if rc:
                raise OSError(f"mosquitto_loop: error {rc}")

    def close(self) -> None:
        self._lib.mosquitto_disconnect(self._mosq)
        self._lib.mosquitto_destroy(self._mosq)
