"""The graph of servers and causality domains: validation, clock indexes and routes.

Servers and domains form a bipartite graph: an edge joins a server to every domain it has a
``<network>`` in. Causal order enforced inside each domain holds for the whole bus if and only if
that graph has no cycle, and every server reaches every other only if it is connected; so it must
be a tree. :meth:`Topology.from_config` refuses anything else with a one-line
:class:`~aaabus.errors.ConfigError` pointing into ``a3.xml``.

In a tree the path between two servers is unique, which gives each server its routing table: the
next hop towards every other server, and the domain shared with that hop (the domain whose matrix
clock stamps the message on that leg).

The graph work is a union-find (the first ``<network>`` that joins two parts already connected
closes a cycle) and breadth-first traversals, written here rather than imported: networkx cost
0.12 to 0.24 s at every start of a server, a client or a tool, for these few lines. They are
checked against an independent computation on random graphs (tests/test_topology.py) and by the
named-cycle tests (tests/test_domains.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aaabus.config.reader import BusConfig
from aaabus.errors import ConfigError

__all__ = ["Hop", "Topology"]

# Node keys of the bipartite graph. Tuples keep domain names and server ids from colliding.
_Node = tuple[str, Any]
# The graph: each node's neighbours, in the order the edges were added (document order), each
# with the line of the <network> element that made the edge.
_Adjacency = dict[_Node, dict[_Node, int]]


def _d(name: str) -> _Node:
    return ("d", name)


def _s(server: int) -> _Node:
    return ("s", server)


@dataclass(frozen=True)
class Hop:
    """One leg of a route: go to ``server`` through ``domain`` (shared by both ends of the leg)."""

    server: int
    domain: str


class Topology:
    """The validated servers-domains graph of a configuration.

    ``domains`` maps each domain name (document order) to its members sorted by id; a server's
    position in that tuple is its row/column in the domain's matrix clock. ``routers`` are the
    servers that belong to two domains or more.
    """

    domains: Mapping[str, tuple[int, ...]]
    routers: tuple[int, ...]

    def __init__(self, cfg: BusConfig, graph: _Adjacency, *, allow_cycles: bool = False) -> None:
        # Use from_config(); the constructor trusts that the graph has been validated.
        self.cfg = cfg
        self.allow_cycles = allow_cycles
        self._graph = graph
        # One pass over the <network> elements: a bus of a thousand servers is built in
        # milliseconds, not in (domains x servers) membership tests.
        order = {name: i for i, name in enumerate(cfg.domains)}
        members: dict[str, list[int]] = {name: [] for name in cfg.domains}
        self._domains_of: dict[int, tuple[str, ...]] = {}
        for sid, srv in cfg.servers.items():
            mine = sorted({net.domain for net in srv.networks}, key=order.__getitem__)
            self._domains_of[sid] = tuple(mine)
            for name in mine:
                members[name].append(sid)
        self.domains = {name: tuple(sorted(ids)) for name, ids in members.items()}
        self.routers = tuple(sorted(s for s, ds in self._domains_of.items() if len(ds) >= 2))
        self._routes: dict[int, dict[int, Hop]] = {}

    # -- construction and validation ----------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: BusConfig, *, allow_cycles: bool = False) -> Topology:
        """Build and validate the graph of ``cfg``.

        Refuses (``ConfigError``) a domain without member, a server without domain, a cycle and
        a disconnected graph. ``allow_cycles=True`` is meant for tests only: it skips the cycle
        check, and routes then follow shortest paths.
        """
        # Insertion order drives the traversals; document order makes every result below (cycle
        # found, tie-breaks) reproducible. The reader refuses two <network> elements of one
        # server in one domain: every edge is added once.
        graph: _Adjacency = {_d(name): {} for name in cfg.domains}
        graph.update((_s(sid), {}) for sid in cfg.servers)
        edges: list[tuple[_Node, _Node]] = []
        for sid, srv in cfg.servers.items():
            for net in srv.networks:
                graph[_s(sid)][_d(net.domain)] = graph[_d(net.domain)][_s(sid)] = net.line
                edges.append((_s(sid), _d(net.domain)))

        for name, dom in cfg.domains.items():
            if not graph[_d(name)]:
                raise ConfigError(
                    f'domain {name} has no member; add <network domain="{name}" port="..."/> '
                    "to a server or remove the domain",
                    cfg.where(dom.line),
                )
        for sid, srv in cfg.servers.items():
            if not graph[_s(sid)]:
                raise ConfigError(
                    f"server {srv.name} (id {sid}) is in no domain; add a "
                    '<network domain="..." port="..."/> element to it',
                    cfg.where(srv.line),
                )
        if not allow_cycles:
            cls._refuse_cycles(cfg, graph, edges)
        cls._refuse_disconnection(cfg, graph)
        return cls(cfg, graph, allow_cycles=allow_cycles)

    @staticmethod
    def _refuse_cycles(cfg: BusConfig, graph: _Adjacency, edges: list[tuple[_Node, _Node]]) -> None:
        nodes = _first_cycle(edges)
        if nodes is None:
            return
        # Canonical rotation: start at the cycle's first domain in document order, and walk in
        # the direction whose first server has the smaller id, so a given cycle always reads
        # the same whatever edge the search happened to close it with.
        order = {name: i for i, name in enumerate(cfg.domains)}
        start = min(
            (i for i, n in enumerate(nodes) if n[0] == "d"), key=lambda i: order[nodes[i][1]]
        )
        forward = nodes[start:] + nodes[:start]
        backward = [forward[0], *reversed(forward[1:])]
        walk = forward if forward[1][1] <= backward[1][1] else backward
        walk.append(walk[0])
        text = str(walk[0][1])
        for i in range(1, len(walk), 2):
            text += f" -{cfg.servers[walk[i][1]].name}- {walk[i + 1][1]}"
        # Point at the network element of the cycle that comes last in the file: the one most
        # likely added last, and removing any one of them breaks this cycle.
        line = max(graph[u][v] for u, v in zip(nodes, nodes[1:] + nodes[:1], strict=True))
        raise ConfigError(
            f"cycle: {text}; causal order across domains needs the servers-domains graph to be a "
            "tree (two domains may share only one router, and routers may not close a loop): "
            "remove one <network> element of this cycle",
            cfg.where(line),
        )

    @staticmethod
    def _refuse_disconnection(cfg: BusConfig, graph: _Adjacency) -> None:
        first = _s(next(iter(cfg.servers)))
        main = _component(graph, first)
        if len(main) == len(graph):
            return
        lost = next(sid for sid in cfg.servers if _s(sid) not in main)
        cut = _component(graph, _s(lost))
        srv, ref = cfg.servers[lost], cfg.servers[first[1]]
        theirs = [d for d in cfg.domains if _d(d) in cut]
        ours = [d for d in cfg.domains if _d(d) in main]
        raise ConfigError(
            f"server {srv.name} (id {lost}) cannot reach server {ref.name} (id {ref.id}): its "
            f"domains {', '.join(theirs)} are cut off from domains {', '.join(ours)}; make one "
            "server a router between the two parts (add a <network> element to it)",
            cfg.where(srv.line),
        )

    # -- queries -------------------------------------------------------------------------------

    def _check_server(self, server: int) -> None:
        if server not in self._domains_of:
            ids = ", ".join(str(s) for s in self._domains_of)
            raise ValueError(f"server {server} is not in the configuration (ids: {ids})")

    def domains_of(self, server: int) -> tuple[str, ...]:
        """The domains ``server`` belongs to, in document order."""
        self._check_server(server)
        return self._domains_of[server]

    def is_router(self, server: int) -> bool:
        """Whether ``server`` belongs to two domains or more."""
        return len(self.domains_of(server)) >= 2

    def neighbours(self, server: int) -> tuple[int, ...]:
        """Servers sharing at least one domain with ``server``, sorted by id."""
        self._check_server(server)
        return tuple(
            sorted({m for d in self._domains_of[server] for m in self.domains[d]} - {server})
        )

    def routes_from(self, src: int) -> dict[int, Hop]:
        """The routing table of ``src``: next hop towards every other server."""
        self._check_server(src)
        table = self._routes.get(src)
        if table is None:
            # One breadth-first traversal from src reaches everyone along a shortest path (the
            # unique path in a tree; with cycles allowed, the first one found in insertion
            # order). The first hop of a node is inherited from its parent in that traversal.
            me = _s(src)
            first: dict[_Node, Hop | str] = {}
            for parent, child in _bfs_edges(self._graph, me):
                if parent == me:
                    first[child] = child[1]  # a domain of src: no server chosen yet
                else:
                    up = first[parent]
                    first[child] = Hop(server=child[1], domain=up) if isinstance(up, str) else up
            hops = {n[1]: h for n, h in first.items() if n[0] == "s" and isinstance(h, Hop)}
            table = dict(sorted(hops.items()))
            self._routes[src] = table
        return dict(table)

    def next_hop(self, src: int, dst: int) -> Hop:
        """First hop from ``src`` towards ``dst``; ``ValueError`` if they are the same server."""
        if src == dst:
            raise ValueError(f"no hop from server {src} to itself")
        self._check_server(dst)
        self.routes_from(src)  # fills the cache
        return self._routes[src][dst]

    def route(self, src: int, dst: int) -> list[Hop]:
        """Every hop from ``src`` to ``dst`` (empty if ``src == dst``).

        Built by following next hops, which is exactly what the routers will do; in a tree this
        is the unique path.
        """
        hops: list[Hop] = []
        here = src
        while here != dst:
            hop = self.next_hop(here, dst)
            hops.append(hop)
            here = hop.server
        return hops

    # -- reporting -----------------------------------------------------------------------------

    def _label(self, server: int) -> str:
        return f"{self.cfg.servers[server].name} ({server})"

    def _grouped_routes(self, src: int) -> list[tuple[str, list[int]]]:
        # Direct neighbours grouped by shared domain, then farther servers grouped by next hop:
        # the table of a 150-server bus stays a handful of lines per server.
        groups: dict[str, list[int]] = {}
        for dst, hop in self.routes_from(src).items():
            key = (
                f"direct in {hop.domain}"
                if hop.server == dst
                else f"via {self._label(hop.server)} in {hop.domain}"
            )
            groups.setdefault(key, []).append(dst)
        return sorted(groups.items(), key=lambda kv: (not kv[0].startswith("direct"), kv[1][0]))

    def describe(self) -> str:
        """A human-readable account: domains and members, routers, each server's route table."""
        lines = [
            f"{self.cfg.path}: {len(self.cfg.servers)} server(s), {len(self.domains)} domain(s)"
            + (" (cycles allowed: test mode)" if self.allow_cycles else ", a tree"),
            "domains:",
        ]
        names = {sid: srv.name for sid, srv in self.cfg.servers.items()}
        # Default names (s<id>) already say the id, so runs can be shortened to s10..s18.
        plain = all(name == f"s{sid}" for sid, name in names.items())
        for name, members in self.domains.items():
            dom = self.cfg.domains[name]
            who = _ranges(members, names) if plain else ", ".join(map(self._label, members))
            lines.append(f"  {name} [{dom.order}, stamps {dom.stamps}]: {who}")
        lines.append("routers:" + ("" if self.routers else " none"))
        for r in self.routers:
            lines.append(f"  {self._label(r)}: {', '.join(self._domains_of[r])}")
        lines.append("routes (how each server reaches the others):")
        for src in self.cfg.servers:
            lines.append(f"  {self._label(src)}:" + ("" if len(self.cfg.servers) > 1 else " none"))
            for key, dsts in self._grouped_routes(src):
                lines.append(f"    {key} -> {_ranges(dsts, names)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The same content as :meth:`describe`, as JSON-serialisable data."""
        return {
            "path": self.cfg.path,
            "tree": not self.allow_cycles,
            "domains": [
                {
                    "name": name,
                    "order": self.cfg.domains[name].order,
                    "stamps": self.cfg.domains[name].stamps,
                    "members": [
                        {"id": m, "name": self.cfg.servers[m].name, "index": i}
                        for i, m in enumerate(members)
                    ],
                }
                for name, members in self.domains.items()
            ],
            "routers": [
                {"id": r, "name": self.cfg.servers[r].name, "domains": list(self._domains_of[r])}
                for r in self.routers
            ],
            "routes": {
                str(src): {
                    str(dst): {"via": hop.server, "domain": hop.domain}
                    for dst, hop in self.routes_from(src).items()
                }
                for src in self.cfg.servers
            },
        }


def _bfs_edges(
    graph: Mapping[_Node, Iterable[_Node]], start: _Node
) -> Iterator[tuple[_Node, _Node]]:
    """(parent, child) for every node reached from ``start``, breadth first, neighbours in the
    graph's order: each child once, after its parent."""
    seen = {start}
    todo = deque([start])
    while todo:
        parent = todo.popleft()
        for child in graph[parent]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
                yield parent, child


def _component(graph: _Adjacency, start: _Node) -> set[_Node]:
    """The nodes connected to ``start``, itself included."""
    return {start, *(child for _parent, child in _bfs_edges(graph, start))}


def _first_cycle(edges: Iterable[tuple[_Node, _Node]]) -> list[_Node] | None:
    """The nodes, in order around it, of the cycle closed by the first of ``edges`` (taken in
    order) that joins two nodes already connected by the ones before it; None if they form a
    forest. The cycle is that edge plus the one path between its ends in the forest so far."""
    parent: dict[_Node, _Node] = {}  # union-find: a node's parent, towards its part's root

    def root(node: _Node) -> _Node:
        while parent.get(node, node) != node:
            parent[node] = parent.get(parent[node], parent[node])  # path halving
            node = parent[node]
        return node

    forest: dict[_Node, list[_Node]] = {}
    for u, v in edges:
        ru, rv = root(u), root(v)
        if ru == rv:
            up = {child: above for above, child in _bfs_edges(forest, u)}
            path = [v]
            while path[-1] != u:
                path.append(up[path[-1]])
            return path[::-1]
        parent[ru] = rv
        forest.setdefault(u, []).append(v)
        forest.setdefault(v, []).append(u)
    return None


def _ranges(ids: Iterable[int], names: Mapping[int, str]) -> str:
    """Names of the servers ``ids`` (sorted); runs of 3+ consecutive ids shrink to ``a..b``."""
    runs: list[list[int]] = []
    for sid in ids:
        if runs and sid == runs[-1][-1] + 1:
            runs[-1].append(sid)
        else:
            runs.append([sid])
    parts = [
        f"{names[r[0]]}..{names[r[-1]]}" if len(r) >= 3 else ", ".join(names[i] for i in r)
        for r in runs
    ]
    return ", ".join(parts)
