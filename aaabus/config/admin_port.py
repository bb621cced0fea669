"""Where a server's admin endpoint listens: property ``aaabus.admin.port`` or the default.

Read by the server (to bind it) and by every tool (to reach it); a pure function of the config.
"""

from __future__ import annotations

from aaabus.config.reader import BusConfig

__all__ = ["ADMIN_PORT_OFFSET", "admin_address"]

#: Default admin port: the server's first network port plus this.
ADMIN_PORT_OFFSET = 1000


def admin_address(config: BusConfig, server_id: int) -> tuple[tuple[str, int] | None, bool]:
    """``((host, port), explicit)`` of a server's admin endpoint; ``(None, True)`` when off.

    ``explicit`` tells whether property ``aaabus.admin.port`` chose it: an explicit port must be
    bound or the server does not start, the default one is used when free (see docs/config.md).
    """
    spec = config.server(server_id)
    if not config.prop(server_id, "aaabus.admin.port"):  # unset or empty: the default port
        port = spec.networks[0].port + ADMIN_PORT_OFFSET
        if port > 65535:
            return None, False
        return (spec.hostname, port), False
    chosen: int | None = config.setting(server_id, "aaabus.admin.port")
    return (None if chosen is None else (spec.hostname, chosen)), True
