"""The hosts of a server's members (issue 42): where whichever of them is primary listens.

Member 0 is the ``<server>`` itself, member K its ``<replica index="K">``; the primary serves
the server's ports (network, admin, MQTT) on its own member's host. Peers dial, and candidates
reach voters, at each member's host in turn (docs/architecture.md, "Replicas and failover").
A pure function of the config.
"""

from __future__ import annotations

from aaabus.config.reader import ServerConfig

__all__ = ["member_hosts"]


def member_hosts(spec: ServerConfig) -> tuple[str, ...]:
    """The hosts of the members of ``spec``, member 0 first, then its replicas in document
    order; a host shared by several members once."""
    hosts = [spec.hostname] + [replica.hostname for replica in spec.replicas]
    return tuple(dict.fromkeys(hosts))
