"""Where the search starts, and which devices its moves treat as one.

Starts are assignments (D_dp × D_pp) built from the structure of the links, in the canonical device order:
groups grown around cheap links, pipelines grown along cheap links, and pipelines that keep clusters
(regions, multi-GPU instances) together at the same stages of every pipeline.
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage

NEAR_TWIN_RATIO = 1.25


def near_twin_classes(link: np.ndarray, twin: np.ndarray, ratio: float = NEAR_TWIN_RATIO) -> np.ndarray:
    """Classes of devices whose links to every other device are within ``ratio`` of each other (complete
    linkage: every pair in a class), each a union of exact twin classes. Numbered like ``twin`` (the class
    of its first twin class), so they are canonical too."""
    reps = [int(np.flatnonzero(twin == c)[0]) for c in range(int(twin.max()) + 1)]
    if len(reps) < 2:
        return twin.copy()
    rows = np.log(np.maximum(link[np.ix_(reps, reps)], 1e-12))
    for k, r in enumerate(reps):
        mates = np.flatnonzero(twin == twin[r])
        # a class's link to itself: its internal link, or (alone) its cheapest link
        rows[k, k] = np.log(max(link[r, mates[1]], 1e-12)) if len(mates) > 1 else np.delete(rows[k], k).min()
    tree = linkage(rows, method="complete", metric="chebyshev")
    labels = fcluster(tree, t=np.log(ratio), criterion="distance")
    first: dict[int, int] = {}
    for k, lab in enumerate(labels):
        first.setdefault(int(lab), k)
    return np.array([first[int(labels[c])] for c in twin])


def greedy_groups(link: np.ndarray, size: int) -> np.ndarray:
    """Groups grown around the first free device from its cheapest free links (rows: groups)."""
    free = np.ones(len(link), dtype=bool)
    groups = []
    while free.any():
        seed = int(np.flatnonzero(free)[0])
        free[seed] = False
        cand = np.flatnonzero(free)
        near = cand[np.argsort(link[seed, cand], kind="stable")[: size - 1]]
        free[near] = False
        groups.append(np.concatenate([[seed], near]))
    return np.array(groups)


def greedy_chains(link: np.ndarray, length: int) -> np.ndarray:
    """Pipelines grown from the first free device by always taking the cheapest free next link."""
    free = np.ones(len(link), dtype=bool)
    chains = []
    while free.any():
        chain = [int(np.flatnonzero(free)[0])]
        free[chain[0]] = False
        while len(chain) < length:
            cand = np.flatnonzero(free)
            nxt = int(cand[np.argmin(link[chain[-1], cand])])
            free[nxt] = False
            chain.append(nxt)
        chains.append(chain)
    return np.array(chains)


def aligned_chains(link: np.ndarray, twin: np.ndarray, length: int) -> np.ndarray:
    """Pipelines that keep clusters together, with the clusters at the same stages in every pipeline.

    A cluster is a twin class whose internal link is cheaper than any link leaving it (a region, a
    multi-GPU instance). Clusters are cut into runs of at most ``length`` devices, the runs packed into
    pipelines (largest first, each into the emptiest pipeline), the rest of each pipeline filled with the remaining devices,
    and every pipeline ends with its longest run: so consecutive stages share fast links in *all*
    pipelines at once, which is what makes a hop fast (the "spot" optimum: four single-GPU instances,
    then one 4-GPU instance, in every pipeline).
    """
    n = len(link)
    classes: dict[int, list[int]] = {}
    for d in range(n):
        classes.setdefault(int(twin[d]), []).append(d)
    runs = []
    for members in classes.values():
        if len(members) < 2:
            continue
        outside = np.setdiff1d(np.arange(n), members)
        inner = link[members[0], members[1]]
        if outside.size and inner >= link[members[0], outside].min():
            continue
        runs += [members[i : i + length] for i in range(0, len(members), length)]
    runs.sort(key=len, reverse=True)
    room = [length] * (n // length)
    placed: list[list[list[int]]] = [[] for _ in room]
    for run in runs:
        fits = [i for i, r in enumerate(room) if r >= len(run)]
        if fits:
            i = min(fits, key=lambda k: (-room[k], k))  # the emptiest: one cluster a pipeline if possible
            placed[i].append(run)
            room[i] -= len(run)
    used = {d for chain in placed for run in chain for d in run}
    rest = iter(d for d in range(n) if d not in used)
    chains = []
    for r, chain in zip(room, placed, strict=False):
        head = [next(rest) for _ in range(r)]
        chains.append(head + [d for run in sorted(chain, key=len) for d in run])
    return np.array(chains)
