"""Layer splits: which contiguous blocks each stage holds, as ``((a₀, b₀), (a₁, b₁), …)`` with stage j
holding blocks [a_j, b_j), a₀ = 0, b_{S−1} = L, b_j = a_{j+1}, every stage at least one block.

``even_layers`` is the split every plan without a ``layers`` field means (sizes differ by at most one, the
extra blocks at the front — the rule of ``p2ptrain.model.stage``). ``minmax_split`` is the exact
min-max partition by dynamic programming: for any per-stage cost of (stage, block count), the split whose
most expensive stage is cheapest (balancing compute over stages of unequal speed; or, with a memory cost,
the split that comes closest to fitting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Layers = tuple[tuple[int, int], ...]


def even_layers(num_layers: int, num_stages: int) -> Layers:
    """The even split: sizes differ by at most one, the first ``num_layers % num_stages`` stages one more."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages (need 1 ≤ stages ≤ layers)")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for j in range(num_stages):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


def layers_from_sizes(sizes: Sequence[int]) -> Layers:
    """The split whose stage j holds ``sizes[j]`` blocks."""
    out, start = [], 0
    for k in sizes:
        out.append((start, start + int(k)))
        start += int(k)
    return tuple(out)


def check_layers(layers: object, num_layers: int, num_stages: int) -> Layers:
    """``layers`` as a split of ``num_layers`` blocks into ``num_stages`` stages; a one-line ValueError if not."""
    if not isinstance(layers, list | tuple) or len(layers) != num_stages:
        raise ValueError(f"layers must list one [first, end) range per stage ({num_stages})")
    out, expect = [], 0
    for j, r in enumerate(layers):
        if (not isinstance(r, list | tuple) or len(r) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in r)):
            raise ValueError(f"layers[{j}] must be a pair of integers [first, end), got {r!r}")
        a, b = int(r[0]), int(r[1])
        if a != expect or b <= a:
            raise ValueError(f"layers[{j}] is [{a}, {b}): stages must hold contiguous, non-empty ranges "
                             f"starting at {expect}")
        out.append((a, b))
        expect = b
    if expect != num_layers:
        raise ValueError(f"layers end at block {expect} but the model has {num_layers} blocks")
    return tuple(out)


def minmax_split(num_layers: int, num_stages: int, stage_cost: Callable[[int, np.ndarray], np.ndarray]
                 ) -> tuple[Layers, float]:
    """The split minimising max_j ``stage_cost(j, k)`` (k: the stage's block count), and that maximum.

    ``stage_cost(j, ks)`` returns the cost of stage j for every block count in the array ``ks``. Dynamic
    programming over (stage, blocks used so far): O(S · L²) with numpy rows. Ties go to the split with
    fewer blocks at the back (deterministic; the even rule's preference).
    """
    s, n = num_stages, num_layers
    if not 1 <= s <= n:
        raise ValueError(f"cannot cut {n} layers into {s} stages (need 1 ≤ stages ≤ layers)")
    ks = np.arange(1, n + 1)
    best = np.full(n + 1, np.inf)  # best[l]: min max cost of stages 0..j holding l blocks
    best[0] = 0.0
    choice = np.zeros((s, n + 1), dtype=int)
    for j in range(s):
        cost = np.asarray(stage_cost(j, ks), dtype=float)  # cost[k-1]: stage j with k blocks
        new = np.full(n + 1, np.inf)
        for used in range(j + 1, n - (s - j - 1) + 1):  # leave at least one block per later stage
            k = np.arange(1, used - j + 1)  # blocks of stage j; earlier stages hold used − k ≥ j
            vals = np.maximum(best[used - k], cost[k - 1])
            i = int(np.argmin(vals))  # ties: the fewest blocks here, so later stages hold fewer
            new[used], choice[j, used] = vals[i], k[i]
        best = new
    sizes, used = [], n
    for j in reversed(range(s)):
        k = int(choice[j, used])
        sizes.append(k)
        used -= k
    return layers_from_sizes(list(reversed(sizes))), float(best[n])
