"""Bottleneck perfect matching between two stage groups: the cost of one hop of the pipelines.

Between consecutive stages s and s+1, every pipeline links its device in group C_s to its device in
C_{s+1}: the pairs form a perfect matching between the two groups, and the hop costs the most expensive
matched link. So the cheapest hop between two groups is the *bottleneck* matching: the least t such that
the links of cost ≤ t contain a perfect matching. Matchings of different hops are independent (pipeline i
is the chain of partners), so a partition plus a stage order plus one bottleneck matching per hop gives
the exact optimum for that partition and order.

We find t by a binary search over the distinct link costs, testing each candidate with one assignment
solve on the 0/1 matrix [cost > t] (a perfect matching exists iff its minimum is 0). The search starts at
a lower bound every matching must meet (each row and each column must use one of its links, so
t ≥ max(max_i min_j, max_j min_i)), which is usually the answer: one solve.

Among bottleneck matchings we return one minimising Σ exp((cost − t)/τ): for small τ, the one with the
fewest links at the bottleneck, then the fewest near it. ``excess = τ·log Σ ≥ 0`` measures that crowding;
the scheduler uses it to break ties on the plateaus the max creates.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment


def _perfect_within(cost: np.ndarray, t: float) -> bool:
    over = (cost > t).astype(np.float64)
    r, c = linear_sum_assignment(over)
    return not over[r, c].any()


def bottleneck_value(cost: np.ndarray) -> float:
    """min over perfect matchings of the largest matched entry of the square matrix ``cost``."""
    lower = max(cost.min(axis=1).max(), cost.min(axis=0).max())
    if _perfect_within(cost, lower):
        return float(lower)
    values = np.unique(cost[cost > lower])
    lo, hi = 0, len(values) - 1  # values[hi] = the largest entry always works
    while lo < hi:
        mid = (lo + hi) // 2
        if _perfect_within(cost, values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def bottleneck_matching(cost: np.ndarray, tau: float) -> tuple[float, float, np.ndarray]:
    """(bottleneck value t, crowding excess ≥ 0, cols): row i is matched to column ``cols[i]``."""
    d = cost.shape[0]
    if d == 1:
        return float(cost[0, 0]), 0.0, np.zeros(1, dtype=np.intp)
    # Usually the lower bound is the answer, and one solve both proves it and picks the least crowded
    # matching; otherwise search t first.
    t = float(max(cost.min(axis=1).max(), cost.min(axis=0).max()))
    for _ in range(2):
        with np.errstate(under="ignore"):
            weights = np.where(cost <= t, np.exp((cost - t) / tau), 2.0 * d)
        rows, cols = linear_sum_assignment(weights)
        total = float(weights[rows, cols].sum())
        if total < 2.0 * d:  # no link above t used: t is feasible, hence the bottleneck
            return t, tau * math.log(total), cols
        t = bottleneck_value(cost)
    raise AssertionError("bottleneck value not feasible")
