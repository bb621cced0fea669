"""The settings of a server's MQTT bridge (properties ``aaabus.mqtt.bridge.*``), read and checked
once at boot, before the bridge (:mod:`aaabus.mqtt.bridge`) starts: the broker's address and
TLS, the filters each way and their prefixes, the client id and credentials, the protocol.

Every bad setting is a one-line :class:`~aaabus.errors.ConfigError`: a bad filter or prefix,
``out`` and ``in`` filters that would echo in 3.1.1 (:func:`filters_meet`), a password file
missing or open to others, a CA file that does not load. Pure: reads files, starts nothing.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from aaabus.config.reader import BusConfig
from aaabus.config.secret import read_private
from aaabus.errors import ConfigError, TopicError
from aaabus.model.topicnames import check_filter

__all__ = ["BridgeSettings", "filters_meet"]


def filters_meet(a: str, b: str) -> bool:
    """Whether some topic could match both valid filters ``a`` and ``b`` (``$`` names are not
    set apart: a conservative answer)."""
    la, lb = a.split("/"), b.split("/")
    for i in range(max(len(la), len(lb))):
        x = la[i] if i < len(la) else None
        y = lb[i] if i < len(lb) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != y and x != "+" and y != "+":
            return False
    return True


@dataclass(frozen=True, eq=False)
class BridgeSettings:
    """The checked ``aaabus.mqtt.bridge.*`` properties of one server (see :meth:`load`)."""

    host: str
    port: int
    out: tuple[str, ...]
    into: tuple[str, ...]
    client_id: str
    username: str | None
    password: str | None = field(repr=False)  # never in a log line
    tls: ssl.SSLContext | None
    prefix_out: str
    prefix_in: str
    protocol: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def mark(self) -> str:
        """The ``origin`` of what this bridge publishes on the bus (never sent back out)."""
        return f"bridge:{self.client_id}"

    @classmethod
    def load(cls, cfg: BusConfig, sid: int) -> BridgeSettings:
        """Read and check the properties of server ``sid`` (the address is set). Raises
        :class:`ConfigError` (one line) for bad filters or prefixes, out and in filters that
        would echo in 3.1.1, a password file that is missing or open to others, a CA file that
        does not load."""

        def setting(name: str) -> Any:
            return cfg.setting(sid, f"aaabus.mqtt.bridge.{name}")

        host, port = cast(tuple[str, int], setting("address"))
        base = Path(cfg.path).resolve().parent
        prefixes = []
        for side in ("out", "in"):
            prefix = setting(f"prefix_{side}") or ""
            if prefix and (not prefix.endswith("/") or "+" in prefix or "#" in prefix):
                raise ConfigError(
                    f"aaabus.mqtt.bridge.prefix_{side}={prefix!r}: a prefix is topic levels "
                    "ending with / and without wildcards, e.g. site-7/"
                )
            prefixes.append(prefix)
        filters: dict[str, tuple[str, ...]] = {}
        for side in ("out", "in"):
            for topic_filter in setting(side):
                try:
                    check_filter(topic_filter)
                except TopicError as exc:
                    raise ConfigError(f"aaabus.mqtt.bridge.{side}: {exc}") from None
            filters[side] = tuple(dict.fromkeys(setting(side)))
        if not filters["out"] and not filters["in"]:
            raise ConfigError(
                "aaabus.mqtt.bridge.address is set but neither aaabus.mqtt.bridge.out nor "
                "aaabus.mqtt.bridge.in: give the topic filters to bridge"
            )
        protocol: int = setting("protocol")
        if protocol == 3:
            # 3.1.1 has no no-local: the broker would send the bridge its own messages back,
            # and the bus would publish them again, in a loop.
            for out_filter in filters["out"]:
                for in_filter in filters["in"]:
                    if filters_meet(prefixes[0] + out_filter, in_filter):
                        raise ConfigError(
                            f"aaabus.mqtt.bridge: out filter {prefixes[0] + out_filter!r} (at "
                            f"the broker) and in filter {in_filter!r} overlap, so MQTT 3.1.1 "
                            "would echo the bridge's own messages back; use disjoint filters, "
                            "a prefix_out, or aaabus.mqtt.bridge.protocol=5 (no-local)"
                        )
        password: str | None = None
        password_file: str | None = setting("password_file")
        if password_file:
            password = _read_password(base / password_file)
        ca: str | None = setting("tls.ca")
        tls = None
        if ca:
            try:
                tls = ssl.create_default_context(cafile=str(base / ca))
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"aaabus.mqtt.bridge.tls.ca: {base / ca} does not load ({exc})"
                ) from None
        return cls(
            host,
            port,
            filters["out"],
            filters["in"],
            setting("client_id") or f"aaabus-bridge-{sid}",
            setting("username"),
            password,
            tls,
            prefixes[0],
            prefixes[1],
            protocol,
        )


def _read_password(path: Path) -> str:
    """The first line of a private file; :class:`ConfigError` if it is missing or readable by
    its group or others (as the bus's key files, :mod:`aaabus.config.secret`)."""

    def open_to_others(mode: int) -> Exception:
        return ConfigError(
            f"aaabus.mqtt.bridge.password_file: {path} is open to group or others "
            f"(mode {mode:o}); run `chmod 600 {path}`"
        )

    try:
        text = read_private(str(path), "utf-8", open_to_others)
        return text.split("\n", 1)[0].rstrip("\r")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"aaabus.mqtt.bridge.password_file: {path}: {reason}") from None
