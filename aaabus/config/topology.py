"""Generator of ``a3.xml`` files for the four layouts measured in the report.

* ``flat``: one domain holding every server.
* ``bus``: domains of ``domain_size`` chained in a line; consecutive domains share one router.
* ``star``: every domain holds server 0 and up to ``domain_size - 1`` others; s0 joins them all.
* ``tree``: a hierarchy: the root domain holds s0..s(K-1); breadth first, every member of a domain
  except the router it was entered through opens one child domain with up to K-1 new servers.

Servers are ``s0..s(N-1)``, domains ``D0, D1, ...``; each ``<network>`` element gets the next port
from ``base_port`` in document order. The result always passes
:meth:`aaabus.config.domains.Topology.from_config`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from xml.sax.saxutils import quoteattr

from aaabus.errors import ConfigError

__all__ = ["KINDS", "generate", "layout"]

KINDS = ("flat", "bus", "star", "tree")


def _flat(n: int, k: int) -> list[list[int]]:
    return [list(range(n))]


def _bus(n: int, k: int) -> list[list[int]]:
    # Domain i starts at the router it shares with domain i-1 (the last member of domain i-1).
    domains = [list(range(min(k, n)))]
    while domains[-1][-1] < n - 1:
        start = domains[-1][-1]
        domains.append(list(range(start, min(start + k, n))))
    return domains


def _star(n: int, k: int) -> list[list[int]]:
    if n == 1:
        return [[0]]
    others = list(range(1, n))
    return [[0, *others[i : i + k - 1]] for i in range(0, len(others), k - 1)]


def _tree(n: int, k: int) -> list[list[int]]:
    domains = [list(range(min(k, n)))]
    created = len(domains[0])
    # (domain index, its entry router or None for the root)
    todo: deque[tuple[int, int | None]] = deque([(0, None)])
    while created < n:
        index, entry = todo.popleft()
        for member in list(domains[index]):
            if created >= n:
                break
            if member == entry:
                continue
            fresh = list(range(created, min(created + k - 1, n)))
            created += len(fresh)
            domains.append([member, *fresh])
            todo.append((len(domains) - 1, member))
    return domains


_LAYOUTS = {"flat": _flat, "bus": _bus, "star": _star, "tree": _tree}


def layout(kind: str, servers: int, domain_size: int = 10) -> list[list[int]]:
    """Members of each domain ``D0, D1, ...`` of a layout (argument checks as :func:`generate`)."""
    if kind not in _LAYOUTS:
        raise ConfigError(f"unknown layout {kind!r}; use one of {', '.join(KINDS)}")
    if servers < 1:
        raise ConfigError(f"{servers} servers requested; ask for at least 1")
    if domain_size < 2:
        raise ConfigError(
            f"domain size {domain_size} is too small; a domain needs at least 2 members to hold "
            "a router and another server (use --domain-size 2 or more)"
        )
    return _LAYOUTS[kind](servers, domain_size)


def generate(
    kind: str,
    servers: int,
    *,
    domain_size: int = 10,
    base_port: int = 16300,
    host: str = "127.0.0.1",
    properties: Mapping[str, str] | None = None,
) -> str:
    """An ``a3.xml`` text for ``servers`` servers laid out as ``kind`` (one of :data:`KINDS`)."""
    args = f"{kind!r}, {servers}, domain_size={domain_size}, base_port={base_port}"
    return render(
        layout(kind, servers, domain_size),
        servers,
        base_port=base_port,
        host=host,
        properties=properties,
        recipe=f"aaabus.config.topology.generate({args}",
    )


def domain_memberships(
    domains: Sequence[Sequence[int]], servers: Iterable[int]
) -> dict[int, list[int]]:
    """Each of ``servers``' domains (indexes into ``domains``), in order."""
    memberships: dict[int, list[int]] = {sid: [] for sid in servers}
    for d, members in enumerate(domains):
        for sid in members:
            memberships[sid].append(d)
    return memberships


def check_port_span(domains: Sequence[Sequence[int]], base_port: int, option: str) -> int:
    """The number of ports a layout takes from ``base_port`` (one per ``<network>``);
    :class:`ConfigError` naming ``option`` if they do not fit in 1..65535."""
    n_ports = sum(len(m) for m in domains)
    if base_port < 1 or base_port + n_ports - 1 > 65535:
        raise ConfigError(
            f"ports {base_port}..{base_port + n_ports - 1} are needed ({n_ports} <network> "
            f"elements) but ports must lie in 1..65535; choose a {option} between 1 and "
            f"{65536 - n_ports}"
        )
    return n_ports


def render(
    domains: list[list[int]],
    servers: int,
    *,
    base_port: int = 16300,
    host: str = "127.0.0.1",
    properties: Mapping[str, str] | None = None,
    recipe: str = "aaabus.config.topology.render(...",
) -> str:
    """The ``a3.xml`` text of an explicit layout: ``domains[d]`` lists the members of ``Dd``.

    ``recipe`` is the start of the call shown in the leading comment (without its closing
    parenthesis, to which host and properties are added).
    """
    memberships = domain_memberships(domains, range(servers))
    n_ports = check_port_span(domains, base_port, "base port")
    props = dict(properties or {})
    # The comment says how to get the same file again. "--" may not appear inside an XML
    # comment, which rules out quoting command-line flags; host and property values come from
    # the caller and could contain it too.
    args = recipe
    if host != "127.0.0.1":
        args += f", host={host!r}"
    if props:
        args += f", properties={props!r}"
    recipe = (
        f"{args}): {len(domains)} domain(s), ports {base_port}..{base_port + n_ports - 1}"
    ).replace("--", "- -")
    out = ["<?xml version='1.0' encoding='utf-8'?>", f"<!-- generated by {recipe} -->", "<config>"]
    out += [f'  <domain name="D{d}"/>' for d in range(len(domains))]
    out += [f"  <property name={quoteattr(k)} value={quoteattr(v)}/>" for k, v in props.items()]
    port = base_port
    for sid in range(servers):
        ds = memberships[sid]
        note = f"  <!-- router: {', '.join(f'D{d}' for d in ds)} -->" if len(ds) > 1 else ""
        out.append(f'  <server id="{sid}" name="s{sid}" hostname={quoteattr(host)}>{note}')
        for d in ds:
            out.append(f'    <network domain="D{d}" port="{port}"/>')
            port += 1
        out.append("  </server>")
    out.append("</config>")
    return "\n".join(out) + "\n"
