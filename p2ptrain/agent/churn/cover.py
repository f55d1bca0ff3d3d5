"""Who explains a set of disputes: the peers in every smallest vertex cover of the dispute graph (pure).

Two members that refused each other without evidence (``churn.replan.disputes_of``) are an edge: one of the two
lied (or its wire did), nobody can say which. Honest peers do not dispute with each other, so the liars are a
vertex cover of the graph — every dispute has a liar at one end — and, the honest being the many, the smallest
one is the likeliest. A peer in *every* smallest cover is needed by every such explanation; a peer that some
smallest cover leaves out is not, however many disputes it has:

* one rogue that disputed with H1, then, kept apart from it, with H2: the path H1 – R – H2 has one smallest
  cover, {R};
* two colluders R1, R2 that disputed with H4 and H5, then, re-paired, with H3 and H4: the path
  H3 – R1 – H4 – R2 – H5 has one smallest cover, {R1, R2}; H4, with its two counterparts, is in none (counted
  by counterpart alone, H4 reached the count like the rogues and went with them: the campaign's
  ``clean_commit @ colluding``);
* two colluders that each disputed with both of H1 and H2: the square has two smallest covers, {R1, R2} and
  {H1, H2}, so nobody is needed yet; kept apart from all four pairs, a rogue's next dispute (with a fresh peer)
  leaves {R1, R2} the one smallest cover.

A peer *v* is in every smallest cover exactly when a cover that leaves it out — which must hold all its
neighbours N(v) — is larger: |N(v)| + τ(G − N[v]) > τ(G), τ the size of a smallest cover. τ is computed per
connected component: by König's theorem (a maximum matching) where the component is bipartite, as a dispute
graph of honest peers and rogues is; by branching where it is not (rogues disputing with each other) and has
at most ``MAX_BRANCHED`` peers; beyond that nobody is spared (``essential`` is True: the count alone decides,
as it did before the cover).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import networkx as nx

MAX_BRANCHED = 30  # peers in one non-bipartite component whose smallest cover is searched for exactly


def essential(edges: Iterable[tuple[Hashable, Hashable]], peer: Hashable) -> bool:
    """Whether ``peer`` is in every smallest vertex cover of the graph of ``edges``. A peer on no edge is in
    none (there is nothing to explain)."""
    graph = nx.Graph()
    graph.add_edges_from((a, b) for a, b in edges if a != b)
    if peer not in graph:
        return False
    component = graph.subgraph(nx.node_connected_component(graph, peer)).copy()
    if not nx.is_bipartite(component) and component.number_of_nodes() > MAX_BRANCHED:
        return True
    neighbours = set(component[peer])
    without = component.copy()
    without.remove_nodes_from(neighbours | {peer})
    return len(neighbours) + cover_size(without) > cover_size(component)


def cover_size(graph: nx.Graph) -> int:
    """τ: the size of a smallest vertex cover of ``graph``."""
    total = 0
    for nodes in nx.connected_components(graph):
        part = graph.subgraph(nodes)
        if part.number_of_edges() == 0:
            continue
        if nx.is_bipartite(part):
            top = {n for n, side in nx.bipartite.color(part).items() if side == 0}
            total += len(nx.bipartite.hopcroft_karp_matching(part, top_nodes=top)) // 2
        else:
            total += _branched({n: set(part[n]) for n in part})
    return total


def _branched(adjacency: dict[Hashable, set[Hashable]]) -> int:
    """τ by branching on a peer of the highest degree: it is in the cover, or all its neighbours are."""
    adjacency = {n: nbrs for n, nbrs in adjacency.items() if nbrs}
    if not adjacency:
        return 0
    peer = max(adjacency, key=lambda n: len(adjacency[n]))
    if len(adjacency[peer]) == 1:  # a matching: one end of each edge
        return len(adjacency) // 2
    take = _removed(adjacency, {peer})
    leave = _removed(adjacency, adjacency[peer] | {peer})
    return min(1 + _branched(take), len(adjacency[peer]) + _branched(leave))


def _removed(adjacency: dict[Hashable, set[Hashable]], gone: set[Hashable]) -> dict[Hashable, set[Hashable]]:
    return {n: nbrs - gone for n, nbrs in adjacency.items() if n not in gone}
