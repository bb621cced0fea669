"""Where a server's admin endpoint listens: property ``aaabus.admin.port`` or the default.

Read by the server (to bind it) and by every tool (to reach it); a pure function of the config.
"""

from __future__ import annotations

from aaabus.config.reader import BusConfig

__all__ = ["ADMIN_PORT_OFFSET", "admin_address", "member_admin_addresses"]

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


def member_admin_addresses(
    config: BusConfig, server_id: int
) -> tuple[tuple[int, tuple[str, int]], ...]:
    """``(member index, (host, port))`` of each member of a server, member 0 first: where its
    admin endpoint listens when that member is the primary (its own hostname, the server's admin
    port number; docs/architecture.md, "Replicas and failover"). Empty when the port is off.

    A tool tries them in turn (:meth:`aaabus.io.adminlink.AdminLink.connect_any`): a member that
    is not primary does not listen there. Members sharing a hostname share an address, listed
    once (the first member's index).
    """
    address, _ = admin_address(config, server_id)
    if address is None:
        return ()
    spec = config.server(server_id)
    # Member 0, then the replicas in document order: ServerConfig.members() (issue 42) once
    # merged lists the same hostnames.
    members = [(0, spec.hostname)] + [(rep.index, rep.hostname) for rep in spec.replicas]
    seen: dict[str, int] = {}
    for index, host in members:
        seen.setdefault(host, index)
    return tuple((index, (host, address[1])) for host, index in seen.items())
