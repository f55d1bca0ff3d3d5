"""The stage order: an open path through all groups minimising the sum of hop costs.

With W[g, h] the bottleneck hop cost between groups g and h, the best stage order for a partition is a
shortest Hamiltonian path (any start, any end; W symmetric). Exact by Held–Karp dynamic programming,
O(2^S · S²), vectorised over subsets — cheap while S ≤ ``EXACT_PATH_LIMIT``. Beyond that, a heuristic:
nearest neighbour from every start, the cheapest few improved by 2-opt (segment reversal) and or-opt (moving a run of
1–3 groups elsewhere) until neither helps.
"""

from __future__ import annotations

import numpy as np

EXACT_PATH_LIMIT = 12
NEIGHBOUR_STARTS = 4  # nearest-neighbour paths improved by 2-opt/or-opt: the cheapest few


def path_cost(weights: np.ndarray, order: np.ndarray | list[int]) -> float:
    o = np.asarray(order)
    return float(weights[o[:-1], o[1:]].sum())


def best_path(weights: np.ndarray, exact_limit: int = EXACT_PATH_LIMIT) -> np.ndarray:
    """An order of the S groups; optimal when S ≤ ``exact_limit``."""
    s = len(weights)
    if s <= 2:
        return np.arange(s)
    if s <= exact_limit:
        return held_karp_path(weights)
    return heuristic_path(weights)


def held_karp_path(weights: np.ndarray) -> np.ndarray:
    """The optimal open path. best[mask, j]: cheapest path visiting ``mask`` and ending at j."""
    s = len(weights)
    full = 1 << s
    best = np.full((full, s), np.inf)
    came = np.full((full, s), -1, dtype=np.int64)
    for j in range(s):
        best[1 << j, j] = 0.0
    masks = np.arange(full)
    popcount = np.array([bin(m).count("1") for m in range(full)])
    for size in range(2, s + 1):
        layer = masks[popcount == size]
        for j in range(s):
            here = layer[(layer >> j) & 1 == 1]
            prev = best[here ^ (1 << j)] + weights[:, j]  # (masks, s): come from k
            k = prev.argmin(axis=1)
            best[here, j] = prev[np.arange(len(here)), k]
            came[here, j] = k
    mask, j = full - 1, int(best[full - 1].argmin())
    order = []
    while j >= 0:
        order.append(j)
        mask, j = mask ^ (1 << j), int(came[mask, j])
    return np.array(order[::-1])


def heuristic_path(weights: np.ndarray) -> np.ndarray:
    """Nearest neighbour from every start; the best few improved by 2-opt and or-opt; the best found."""
    s = len(weights)
    starts = sorted(range(s), key=lambda g: path_cost(weights, _nearest_neighbour(weights, g)))
    best_order, best_cost = None, np.inf
    for start in starts[:NEIGHBOUR_STARTS]:
        order = _improve(weights, _nearest_neighbour(weights, start))
        cost = path_cost(weights, order)
        if cost < best_cost - 1e-12:
            best_order, best_cost = order, cost
    return best_order


def _nearest_neighbour(weights: np.ndarray, start: int) -> np.ndarray:
    s = len(weights)
    seen = np.zeros(s, dtype=bool)
    order = [start]
    seen[start] = True
    for _ in range(s - 1):
        row = np.where(seen, np.inf, weights[order[-1]])
        nxt = int(row.argmin())
        order.append(nxt)
        seen[nxt] = True
    return np.array(order)


def _improve(weights: np.ndarray, order: np.ndarray) -> np.ndarray:
    order = order.copy()
    improved = True
    while improved:
        improved = _two_opt(weights, order) or _or_opt(weights, order)
    return order


def _two_opt(weights: np.ndarray, order: np.ndarray) -> bool:
    """Reverse order[i..j] when that is cheaper; the ends of an open path may be reversed too."""
    s = len(order)
    for i in range(s - 1):
        a = order[i - 1] if i > 0 else -1
        b = order[i]
        js = np.arange(i + 1, s)
        c = order[js]
        d = np.where(js + 1 < s, order[np.minimum(js + 1, s - 1)], -1)
        old = (weights[a, b] if a >= 0 else 0.0) + np.where(d >= 0, weights[c, np.maximum(d, 0)], 0.0)
        new = (weights[a, c] if a >= 0 else 0.0) + np.where(d >= 0, weights[b, np.maximum(d, 0)], 0.0)
        gain = old - new
        k = int(gain.argmax())
        if gain[k] > 1e-12:
            j = js[k]
            order[i : j + 1] = order[i : j + 1][::-1].copy()
            return True
    return False


def _or_opt(weights: np.ndarray, order: np.ndarray) -> bool:
    """Move a run of 1–3 groups (either way round) to another place in the path when that is cheaper."""
    s = len(order)
    w = weights.__getitem__

    def edge(a: int, b: int) -> float:  # -1 marks "no neighbour": an end of the path
        return 0.0 if a < 0 or b < 0 else w((a, b))

    for length in (1, 2, 3):
        for i in range(s - length + 1):
            run = [int(x) for x in order[i : i + length]]
            before = int(order[i - 1]) if i > 0 else -1
            after = int(order[i + length]) if i + length < s else -1
            removed = edge(before, run[0]) + edge(run[-1], after) - edge(before, after)
            rest = [int(x) for x in order[:i]] + [int(x) for x in order[i + length :]]
            for pos in range(len(rest) + 1):
                if pos == i:
                    continue
                u = rest[pos - 1] if pos > 0 else -1
                v = rest[pos] if pos < len(rest) else -1
                for first, last in ((run[0], run[-1]), (run[-1], run[0])):
                    added = edge(u, first) + edge(last, v) - edge(u, v)
                    if added < removed - 1e-12:
                        seg = run if first == run[0] else run[::-1]
                        order[:] = rest[:pos] + seg + rest[pos:]
                        return True
    return False
