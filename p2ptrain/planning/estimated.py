"""Links from a bounded set of measurements: whom each peer measures, and the rest of the matrix estimated.

Measuring every pair costs each peer n − 1 bulk probes through its own line (4,032 at 64 peers, about a
million at 1,000). Instead each peer measures the links of its **probe graph** and the planner estimates
the others from what was measured.

The probe graph (``probe_graph``, ``probe_partners``): ``degree // 2`` rings, each the members in the order of
a hash of the run's salt, the ring's number and their peer IDs; each member measures its two neighbours on
every ring, and they measure it: the graph is symmetric (both ends measure each pair, and each checks the
other's claim, ``agent.leadership.plan_maker.build_cluster``), ``degree`` pairs a member (fewer where two
rings put the same two side by side), a random regular graph (connected, every group a few measured hops
from every other). Every member has as many partners as every other: the link phase a first plan waits
for lasts as long as its busiest member's measurements, one after another (16 agents: 5 to 12 partners
each with fingers on one ring, where each member took ``degree // 2`` and as many landed on it by chance).
A join moves two pairs a ring: the newcomer sits between two neighbours there. Members sharing a label
(``labels``: where a member says it is, its host, its region) also form rings of their own, with about ``near``
partners each, every one when the label has
at most ``near + 1`` members: the links of one machine and one region, which a random graph would mostly
miss, and which the estimate needs to find the groups. A label is a hint of whom to measure, never a link's
value: a peer lying about its place is measured by the peers it named, and that is all. Every member
computes the same graph from the membership, the labels and the salt; a run of at most ``degree + 1``
members measures every pair. A plan adds the pairs it puts next to each other (``plan_pairs``:
neighbouring stages of a pipeline, the members of a stage's group), so the links a plan is priced on
become measured ones, and a re-plan uses them.

The estimate (``estimate_links``) leans on what networks are made of: groups of devices alike to all the
others (a region, a multi-GPU instance), the link between two devices mostly a matter of their groups.

1. **Twins.** A measured pair is a twin edge when its latency and bandwidth are both within ``TWIN_RATIO``
   of the best link either end measured (latency with ``TWIN_SLACK_MS`` of slack, for the 0 ms links of a
   data centre): the two are in one group. Groups are the connected components of twin edges. Only pairs
   both ends measured count (the worse of the two figures, as the planner takes them): a liar's own row
   cannot make a twin edge with an honest peer, nor join two groups.
2. **Group pairs.** An unmeasured link between groups A and B (A = B included) is the median of the
   measured links between A and B: latency the median, bandwidth the median too (medians: a few liars'
   links among many measured ones do not move it).
3. **Fallback.** Where no link between A and B was measured, the latency is the shortest two-hop path
   through a third group (an upper bound in any network where routing is no worse than relaying), and
   the bandwidth the lower of A's and B's typical links to other groups (the median of each group's
   measured links across: what its uplink or instance's network allows; a plan that uses the pair has it
   measured before the next re-plan). (The lowest measured link of either group would price a spot
   network's unmeasured instance pairs at the noise's low end, 10 % under the typical link.)

Estimates come from the signed rows alone and are deterministic (no random numbers, no clock), so every
follower derives the same matrix for its plan check; the mask says which entries were measured, and an
estimated entry is never taken for a measured one (the one-sided and disputed rules of the planner apply
to measured entries only). A peer reporting coordinates of itself could place itself anywhere; here a
peer's estimated links follow from its group, which needs both ends' agreement, and from medians.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_DEGREE = 8  # partners per member among all (two on each of DEGREE // 2 rings; fewer where rings coincide)
DEFAULT_NEAR = 8  # partners per member among those of each label it shares (its host, its region), alike
TWIN_RATIO = 1.5  # a twin edge's latency and bandwidth are within this factor of the best of either end
TWIN_SLACK_MS = 1.0  # latency slack of a twin edge (0 ms links of a data centre, jitter of a few 100 µs)


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest(), "big")


def probe_graph(members: Iterable[str], degree: int = DEFAULT_DEGREE, salt: str = "",
                labels: Mapping[str, Iterable[str]] | None = None, near: int = DEFAULT_NEAR) -> dict[str, frozenset[str]]:
    """Each member's partners in the probe graph (module docstring): symmetric; ``degree`` among all members
    (at most), plus ``near`` among those of each label it shares with others (``labels[p]``: the places ``p``
    says it is, its host, its region: a hint of whom to measure, never a link's value)."""
    members = sorted(set(members))
    partners: dict[str, set[str]] = {p: set() for p in members}
    _rings(members, degree, salt, "", partners)
    by_label: dict[str, list[str]] = {}
    for p in members:
        for label in set((labels or {}).get(p, ())):
            if label:
                by_label.setdefault(label, []).append(p)
    for label in sorted(by_label):
        _rings(by_label[label], near, salt, label, partners)
    return {p: frozenset(s) for p, s in partners.items()}


def probe_partners(me: str, members: Iterable[str], degree: int = DEFAULT_DEGREE, salt: str = "",
                   labels: Mapping[str, Iterable[str]] | None = None, near: int = DEFAULT_NEAR) -> frozenset[str]:
    """The peers ``me`` measures: its partners in the probe graph of ``members`` and ``me``."""
    return probe_graph(set(members) | {me}, degree, salt, labels, near)[me]


def _rings(members: Sequence[str], degree: int, salt: str, tag: str, partners: dict[str, set[str]]) -> None:
    """Add a label's pairs to ``partners`` (in place): every pair when it has at most ``degree + 1`` members,
    else each member's two neighbours on each of ``degree // 2`` rings, the members in the order of a hash of
    the salt, the label, the ring's number and their IDs."""
    if len(members) <= degree + 1:
        for p in members:
            partners[p].update(q for q in members if q != p)
        return
    for ring in range(degree // 2):
        order = sorted(members, key=lambda p: _hash(salt, tag, ring, p))
        for p, q in zip(order, order[1:] + order[:1], strict=True):
            partners[p].add(q)
            partners[q].add(p)


def plan_pairs(assignment: Sequence[Sequence[str]]) -> set[frozenset[str]]:
    """The pairs a plan puts next to each other: neighbouring stages of each pipeline (``assignment[i][s]``,
    pipeline i, stage s) and the members of each stage's data-parallel group."""
    pairs: set[frozenset[str]] = set()
    for pipeline in assignment:
        pairs.update(frozenset((a, b)) for a, b in zip(pipeline, pipeline[1:], strict=False) if a != b)
    for column in zip(*assignment, strict=False):
        pairs.update(frozenset((a, b)) for a in column for b in column if a != b)
    return pairs


def twin_groups(latency: np.ndarray, bandwidth: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Group labels 0, 1, … (in order of each group's first device) from the measured pairs' twin edges."""
    n = len(latency)
    off = measured & ~np.eye(n, dtype=bool)
    best_lat = np.where(off, latency, np.inf).min(axis=1)
    best_bw = np.where(off, bandwidth, 0.0).max(axis=1)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in zip(*np.nonzero(np.triu(off, 1)), strict=True):
        near = all(latency[i, j] <= TWIN_RATIO * best_lat[k] + TWIN_SLACK_MS and bandwidth[i, j] * TWIN_RATIO >= best_bw[k]
                   for k in (i, j))
        if near:
            parent[root(int(i))] = root(int(j))
    first: dict[int, int] = {}
    return np.array([first.setdefault(root(i), len(first)) for i in range(n)], dtype=np.intp)


@dataclass(frozen=True, eq=False)
class LinkEstimate:
    """Every pair's latency (ms) and bandwidth (Gbit/s): measured where ``measured`` (N×N bool, symmetric),
    estimated elsewhere; ``groups``: the twin groups the estimate used (None: nothing was estimated)."""

    latency_ms: np.ndarray
    bandwidth_gbps: np.ndarray
    measured: np.ndarray
    groups: np.ndarray | None

    @property
    def estimated_pairs(self) -> int:
        n = len(self.measured)
        return int((~self.measured[np.triu_indices(n, 1)]).sum())


def estimate_links(latency: np.ndarray, bandwidth: np.ndarray, measured: np.ndarray,
                   groups: np.ndarray | None = None) -> LinkEstimate:
    """The measured entries as given (``measured``: symmetric N×N bool, the diagonal ignored), the others
    estimated (module docstring). Values of unmeasured entries in the inputs are ignored. ``groups``: the
    twin groups when the caller found them (from the links both ends measured); else from ``measured``."""
    n = len(latency)
    off = ~np.eye(n, dtype=bool)
    measured = measured & off
    lat, bw = np.where(measured, latency, 0.0), np.where(measured, bandwidth, 0.0)
    if n < 2 or measured[off].all():
        return LinkEstimate(lat, bw, measured, None)
    if not measured.any():  # nothing to go by: every link alike (zero delay, 1 Gbit/s)
        return LinkEstimate(np.zeros((n, n)), np.where(off, 1.0, 0.0), measured, np.zeros(n, dtype=np.intp))
    labels = twin_groups(lat, bw, measured) if groups is None else np.asarray(groups, dtype=np.intp)
    k = int(labels.max()) + 1
    group_lat, group_bw = np.full((k, k), np.nan), np.full((k, k), np.nan)
    for g in range(k):
        for h in range(g, k):
            block = np.ix_(labels == g, labels == h)
            sel = measured[block]
            if sel.any():
                group_lat[g, h] = group_lat[h, g] = float(np.median(lat[block][sel]))
                group_bw[g, h] = group_bw[h, g] = float(np.median(bw[block][sel]))
    _fill_group_gaps(group_lat, group_bw, labels, lat, bw, measured)
    out_lat = np.where(measured, lat, group_lat[labels][:, labels])
    out_bw = np.where(measured, bw, group_bw[labels][:, labels])
    np.fill_diagonal(out_lat, 0.0)
    np.fill_diagonal(out_bw, 0.0)
    return LinkEstimate(out_lat, out_bw, measured, labels)


def _fill_group_gaps(group_lat: np.ndarray, group_bw: np.ndarray, labels: np.ndarray, lat: np.ndarray,
                     bw: np.ndarray, measured: np.ndarray) -> None:
    """Group pairs with no measured link (in place): latency by the shortest two-hop path through a third
    group, bandwidth the lower of the two groups' typical links to other groups (module docstring)."""
    k = len(group_lat)
    worst_lat = float(lat[measured].max())
    across = measured & (labels[:, None] != labels[None, :])
    typical = np.full(k, np.nan)  # each group's median measured link to other groups
    for g in range(k):
        sel = across[labels == g]
        if sel.any():
            typical[g] = float(np.median(bw[labels == g][sel]))
    typical[np.isnan(typical)] = float(np.median(bw[across])) if across.any() else float(bw[measured].min())
    known = ~np.isnan(group_lat)
    relay = np.where(known, group_lat, np.inf)
    two_hop = (relay[:, :, None] + relay[None, :, :]).min(axis=1)
    for g, h in zip(*np.nonzero(~known), strict=False):
        group_lat[g, h] = min(float(two_hop[g, h]), worst_lat) if np.isfinite(two_hop[g, h]) else worst_lat
        group_bw[g, h] = min(typical[g], typical[h])
