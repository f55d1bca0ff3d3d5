"""The exact optimum for small clusters, by enumeration: the oracle the scheduler is tested against.

It enumerates every partition of the devices into D_pp groups of D_dp (each once: groups listed by their
smallest device, so the group holding device 0 comes first, then the group of the smallest device left,
…), and for each partition every stage order (each path once: a path and its reverse cost the same).
A hop's cost is the bottleneck over every perfect matching between the two groups (all D_dp! of them).
Nothing is shared with the search but the objective itself, so agreement is a real check.

It assumes, as the paper's objective satisfies, that the cost is a function of the groups' values plus the
sum of the hops' values, so that the best order of a partition is its cheapest path. Sizes: up to 12
devices (15,400 partitions × 360 orders at worst, 4 × 3 groups), well under a second each with numpy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from p2ptrain.planning.cost import CostBreakdown, Objective
from p2ptrain.planning.path import held_karp_path

MAX_DEVICES = 12
_CHUNK = 256
_MAX_PERMUTED_STAGES = 7  # beyond, only D_dp = 1 is possible at ≤ 12 devices: one partition, Held–Karp


@dataclass(frozen=True)
class ExhaustiveResult:
    assignment: np.ndarray
    cost: CostBreakdown
    partitions: int  # how many partitions had their stage order solved (the rest were bounded out)


def solve_exhaustive(objective: Objective, max_devices: int = MAX_DEVICES) -> ExhaustiveResult:
    """The optimal assignment of ``objective`` (D_dp × D_pp device indices)."""
    s, d = objective.num_stages, objective.num_replicas
    n = s * d
    if n > max_devices:
        raise ValueError(f"exhaustive search is for at most {max_devices} devices, not {n}")
    groups = np.array(list(itertools.combinations(range(n), d)))
    index = {tuple(g): i for i, g in enumerate(groups.tolist())}
    parts = np.array([[index[g] for g in p] for p in _partitions(tuple(range(n)), d)])
    group_value = np.array([objective.group_terms(g).max() for g in groups])
    hop = _hop_matrix(objective.hop_link_s, groups, parts)
    # Branch and bound over partitions: a path has S−1 hops, so it costs at least the S−1 cheapest hops
    # among the partition's group pairs; partitions are solved in order of that bound until it exceeds the
    # best cost found.
    fixed = np.array([objective.combine(group_value[row].tolist(), [0.0] * (s - 1)).cost_s for row in parts])
    pair_idx = list(itertools.combinations(range(s), 2))
    if pair_idx:
        pair_hops = np.sort(hop[parts[:, [a for a, _ in pair_idx]], parts[:, [b for _, b in pair_idx]]], axis=1)
        bound = fixed + pair_hops[:, : s - 1].sum(axis=1)
    else:
        bound = fixed
    by_bound = np.argsort(bound, kind="stable")
    best_cost, best, best_order, solved = None, -1, None, 0
    for start in range(0, len(parts), _CHUNK):
        chunk = by_bound[start : start + _CHUNK]
        if best_cost is not None and bound[chunk[0]] >= best_cost.cost_s:
            break
        orders = _best_orders(hop, parts[chunk])
        solved += len(chunk)
        for i, order in zip(chunk, orders, strict=False):
            row = parts[i][order]
            cost = objective.combine(group_value[row].tolist(), _path_hops(hop, row))
            if best_cost is None or cost.cost_s < best_cost.cost_s:
                best_cost, best, best_order = cost, i, order
    stage_groups = groups[parts[best][best_order]]
    sigma = _compose(objective.hop_link_s, stage_groups)
    return ExhaustiveResult(sigma, objective.evaluate(sigma), solved)


def _partitions(items: tuple[int, ...], size: int):
    """Every partition of ``items`` into blocks of ``size``, each once (block of the first item first)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        block = (first, *others)
        left = tuple(x for x in rest if x not in others)
        for tail in _partitions(left, size):
            yield [block, *tail]


def _bottleneck_all(link: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bottleneck value of every pair (a[k], b[k]) of groups, over all D! matchings."""
    d = a.shape[1]
    perms = np.array(list(itertools.permutations(range(d))))
    sub = link[a[:, :, None], b[:, None, :]]  # (pairs, d, d)
    matched = sub[:, np.arange(d)[None, :], perms]  # (pairs, d!, d)
    return matched.max(axis=2).min(axis=1)


def _hop_matrix(link: np.ndarray, groups: np.ndarray, parts: np.ndarray) -> np.ndarray:
    g = len(groups)
    hop = np.full((g, g), np.inf)
    s = parts.shape[1]
    if s < 2:
        return hop
    pairs = np.sort(parts[:, list(itertools.combinations(range(s), 2))], axis=2).reshape(-1, 2)
    codes = np.unique(pairs[:, 0] * g + pairs[:, 1])
    pairs = np.stack([codes // g, codes % g], axis=1)
    values = _bottleneck_all(link, groups[pairs[:, 0]], groups[pairs[:, 1]])
    hop[pairs[:, 0], pairs[:, 1]] = values
    hop[pairs[:, 1], pairs[:, 0]] = values
    return hop


def _best_orders(hop: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """For each partition, the stage order (positions into the partition) with the cheapest path."""
    p, s = parts.shape
    if s == 1:
        return np.zeros((p, 1), dtype=int)
    if s > _MAX_PERMUTED_STAGES:
        return np.array([held_karp_path(hop[np.ix_(row, row)]) for row in parts])
    perms = np.array([q for q in itertools.permutations(range(s)) if q[0] < q[-1]])
    weights = hop[parts[:, :, None], parts[:, None, :]]  # (p, s, s)
    cost = np.zeros((p, len(perms)))
    for k in range(s - 1):
        cost += weights[:, perms[:, k], perms[:, k + 1]]
    return perms[cost.argmin(axis=1)]


def _path_hops(hop: np.ndarray, ordered: np.ndarray) -> list[float]:
    return [float(hop[a, b]) for a, b in zip(ordered[:-1], ordered[1:], strict=False)]


def _compose(link: np.ndarray, stage_groups: np.ndarray) -> np.ndarray:
    """Pipelines through the stage groups, one bottleneck matching (found by enumeration) per hop."""
    d = stage_groups.shape[1]
    perms = np.array(list(itertools.permutations(range(d))))
    current = stage_groups[0]
    columns = [current]
    for nxt in stage_groups[1:]:
        sub = link[np.ix_(current, nxt)]
        p = perms[sub[np.arange(d)[None, :], perms].max(axis=1).argmin()]
        current = nxt[p]
        columns.append(current)
    return np.stack(columns, axis=1)
