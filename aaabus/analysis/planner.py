"""Causality domains planned from observed traffic: heavy talkers share a small domain, routers
sit on light edges, and the domains form a tree.

Input: the servers and a traffic matrix ``notes[u, v]`` (notifications from u to v); a size
limit K (members per domain, routers included); a
:class:`~aaabus.analysis.costmodel.CostModel`.

The algorithm (deterministic for a given seed):

1. **Communities.** The undirected traffic graph (weight of {u, v}: notes both ways; servers with
   no traffic are isolated nodes) is cut into communities by Louvain modularity maximisation
   (``networkx.community.louvain_communities``, seeded).
2. **Size limit.** A community becomes the *core* of one domain, and a domain may have to take in
   the router to its parent domain (step 4), so cores are limited to K - 1 servers. A larger
   community is split: Louvain again on its own subgraph, or, when that finds nothing to cut,
   a Kernighan–Lin bisection (minimum traffic cut between two halves); recursively.
3. **Merging.** Greedily, heaviest mutual traffic first, two cores are merged when the union fits
   in K - 1 and the model says it pays: the router hop (``HOP_MS``) the merge saves on their
   mutual traffic outweighs the larger clock that all traffic in and out of both cores then
   pays. Servers without traffic end up together (a merge of them costs nothing).
4. **Tree of domains.** Two candidate trees over the cores, rooted at the core with the most
   traffic to other cores: the maximum-weight spanning tree of the inter-core traffic (heavy
   pairs of cores become neighbours), and the star around that root (every core one router
   from the root: better when the traffic between cores is spread evenly). Each tree edge
   (parent P, child C) gets a router, in breadth-first order: the member of P with the most
   traffic to C joins C, or the member of C with the most traffic to P joins P if that is
   heavier and P still has room. A child's core has at most K - 1 servers, so the first choice
   always fits: every domain stays within K.
5. **Choice.** Both candidates are costed with the model
   (:func:`aaabus.analysis.costmodel.evaluate`) and the cheaper one is the plan (the spanning
   tree on a tie).

Why the result is a tree: every server has one edge to its core's domain, and each tree edge
between domains adds exactly one more (the router's): N + (D - 1) edges joining N + D nodes,
all connected, is a tree of the servers–domains graph, which is what
:meth:`aaabus.config.domains.Topology.from_config` requires.

Runs on the caller's thread; the matrix is small (servers x servers), Spark is not involved.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aaabus.analysis.costmodel import CostModel, LayoutCost, evaluate

if TYPE_CHECKING:
    import networkx as nx
    import numpy as np
    import numpy.typing as npt

__all__ = ["Plan", "plan_domains"]


@dataclass(frozen=True)
class Plan:
    """A planned layout: ``domains[d]`` lists the members of domain d (indices of the matrix),
    root domain first, each sorted; ``cores`` the communities they were built from."""

    domains: list[list[int]]
    cores: list[list[int]]
    tree: str  # "spanning tree" or "star": which candidate of step 4 won
    cost: LayoutCost


def plan_domains(
    notes: npt.NDArray[np.float64], max_domain: int, model: CostModel, *, seed: int = 0
) -> Plan:
    """Plan domains of at most ``max_domain`` members for the traffic ``notes`` (N x N)."""
    import numpy as np

    if max_domain < 2:
        raise ValueError(f"a domain holds 2 servers or more, got a limit of {max_domain}")
    n = notes.shape[0]
    if n == 1:
        return Plan([[0]], [[0]], "single domain", evaluate("planned", [[0]], notes, model))
    weights = notes + notes.T
    np.fill_diagonal(weights, 0.0)
    graph = _graph(weights)
    cores = _communities(graph, max_domain - 1, seed)
    cores = _merge(cores, weights, max_domain - 1, model)
    candidates = []
    for tree in ("spanning tree", "star"):
        domains = _domains(cores, weights, max_domain, tree)
        candidates.append(Plan(domains, cores, tree, evaluate("planned", domains, notes, model)))
    return min(candidates, key=lambda p: p.cost.ms_per_note)  # min keeps the first on a tie


def _graph(weights: npt.NDArray[np.float64]) -> nx.Graph:
    import networkx as nx
    import numpy as np

    graph = nx.Graph()
    graph.add_nodes_from(range(weights.shape[0]))
    us, vs = np.nonzero(np.triu(weights, 1))
    graph.add_weighted_edges_from(
        (int(u), int(v), float(weights[u, v])) for u, v in zip(us, vs, strict=True)
    )
    return graph


def _communities(graph: nx.Graph, cap: int, seed: int) -> list[list[int]]:
    """Step 1 and 2: Louvain communities, split until none exceeds ``cap`` servers."""
    import networkx as nx

    found = nx.community.louvain_communities(graph, weight="weight", seed=seed)
    out: list[list[int]] = []
    todo = [sorted(c) for c in found]
    while todo:
        part = todo.pop()
        if len(part) <= cap:
            out.append(part)
            continue
        sub = graph.subgraph(part)
        pieces = nx.community.louvain_communities(sub, weight="weight", seed=seed)
        if len(pieces) == 1:  # no structure left: cut the lightest way into two halves
            pieces = nx.community.kernighan_lin_bisection(sub, weight="weight", seed=seed)
        todo.extend(sorted(p) for p in pieces)
    return sorted(out)


def _merge(
    cores: list[list[int]], weights: npt.NDArray[np.float64], cap: int, model: CostModel
) -> list[list[int]]:
    """Step 3: merge cores greedily by mutual traffic while the model says it pays."""
    import numpy as np

    cores = [list(c) for c in cores]
    member = _membership(cores, weights.shape[0])
    between = member @ weights @ member.T  # traffic between cores (both ways); inside: twice
    # leg_ms by domain size; +1 below: the router a domain takes in from its parent.
    leg = np.array([model.leg_ms(k) for k in range(cap + 2)])
    while len(cores) > 1:
        sizes = np.array([len(c) for c in cores])
        touching = between.sum(axis=1) - np.diag(between) / 2  # in, out and inside each core
        union = sizes[:, None] + sizes[None, :]
        fits = np.triu(union <= cap, 1)
        union = np.minimum(union, cap)
        extra = leg[union + 1] - leg[np.maximum(sizes[:, None], sizes[None, :]) + 1]
        gain = between * model.hop_ms - (touching[:, None] + touching[None, :]) * extra
        allowed = fits & (gain >= 0)
        if not allowed.any():
            break
        # Heaviest mutual traffic first; argmax keeps the first (lowest) pair on a tie.
        a, b = np.unravel_index(np.argmax(np.where(allowed, between, -1.0)), between.shape)
        cores[a] = sorted(cores[a] + cores[b])
        del cores[b]
        between[a, :] += between[b, :]
        between[:, a] += between[:, b]
        between = np.delete(np.delete(between, b, axis=0), b, axis=1)
    return sorted(cores)


def _membership(cores: Sequence[Sequence[int]], servers: int) -> npt.NDArray[np.float64]:
    """The cores x servers 0/1 matrix: products with it sum traffic per core."""
    import numpy as np

    member = np.zeros((len(cores), servers))
    for i, core in enumerate(cores):
        member[i, list(core)] = 1.0
    return member


def _domains(
    cores: list[list[int]], weights: npt.NDArray[np.float64], limit: int, tree: str
) -> list[list[int]]:
    """Step 4: one domain per core, linked by routers along a tree of cores."""
    import networkx as nx
    import numpy as np

    c = len(cores)
    member = _membership(cores, weights.shape[0])
    to_core = weights @ member.T  # to_core[s, i]: traffic of server s with core i
    between = member @ to_core
    outside = between.sum(axis=1) - np.diag(between)
    root = int(np.argmax(outside))
    if tree == "star":
        parent = {i: root for i in range(c) if i != root}
        order = [i for i in range(c) if i != root]
    else:
        core_graph = nx.Graph()
        core_graph.add_nodes_from(range(c))
        core_graph.add_weighted_edges_from(
            (a, b, float(between[a, b])) for a in range(c) for b in range(a + 1, c)
        )
        spanning = nx.maximum_spanning_tree(core_graph, weight="weight")
        parent, order = {}, []
        todo = deque([root])
        while todo:
            node = todo.popleft()
            for child in sorted(spanning.neighbors(node)):
                if child != root and child not in parent:
                    parent[child] = node
                    order.append(child)
                    todo.append(child)
    domains = [list(core) for core in cores]
    for child in order:
        up = parent[child]
        down_server = _heaviest(domains[up], to_core[:, child])
        up_server = _heaviest(cores[child], to_core[:, up])
        if to_core[up_server, up] > to_core[down_server, child] and len(domains[up]) < limit:
            domains[up].append(up_server)
        else:
            domains[child].append(down_server)
    ranked = [root, *order]
    return [sorted(domains[i]) for i in ranked]


def _heaviest(candidates: Sequence[int], traffic: npt.NDArray[np.float64]) -> int:
    """The candidate with the most ``traffic`` (the lowest index on a tie)."""
    return max(sorted(candidates), key=lambda s: (traffic[s], -s))
