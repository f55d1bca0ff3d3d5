"""Our default search ("clustered"): the partition search on the network's recovered structure, then on
the links as measured.

1. ``measured.link_clusters`` recovers regions and instances from the link rows. When every cluster is a
   class of exact twins (the paper's matrices), this is just the partition search (``search``).
2. Otherwise the partition search runs on the *snapped* network (each link the average over its cluster
   pair): its clusters are exact twins there, so whole regions move at once and group and hop values are
   cached by cluster, as on exact matrices.
3. Its best few plans, mapped to the real devices, are improved on the measured links by swapping members
   of one cluster between groups (the snapped search could not tell them apart; here they differ by their
   noise), with a short iterated local search. (Every single swap after that, tried on the five paper
   networks at ±10 %, found nothing more in three times the time: ``FULL_SWAP_MAX_DEVICES`` is 0.)
4. On networks of at most ``RAW_SEARCH_MAX_DEVICES`` devices, the partition search on the measured links
   runs as well (clusters of one or two devices guide poorly, and there it is cheap); the cheaper plan wins.

The measured network's cost is the only one reported. Pure, like the rest of ``planning``: the
Generator passed in is the only source of randomness, the deadline the only clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from p2ptrain.planning.canonical import canonical_order
from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import Objective
from p2ptrain.planning.measured import link_clusters, snapped
from p2ptrain.planning.objectives import make_objective
from p2ptrain.planning.search import Search, SearchConfig, SearchResult
from p2ptrain.planning.workload import Workload

FULL_SWAP_MAX_DEVICES = 0  # every single swap, after the swaps inside clusters, up to this many devices
IMPROVED_PLANS = 3  # the snapped search's best plans improved on the measured links
COARSE_PATIENCE = 1  # the snapped network is only a guide: fewer idle rounds than on exact matrices
FINE_PATIENCE = 2
FINE_EVALUATIONS_PER_DEVICE = 150  # the improvement's share of the evaluation budget, per device
RAW_SEARCH_MAX_DEVICES = 16  # small networks: the partition search on the measured links too (cheap there)


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two labelings split the devices the same way."""
    pairs = {(int(x), int(y)) for x, y in zip(a, b, strict=True)}
    return len(pairs) == len(np.unique(a)) == len(np.unique(b))


def clustered_search(
    objective: Objective,
    cluster: Cluster,
    workload: Workload,
    twin_class: np.ndarray,
    rng: np.random.Generator,
    config: SearchConfig,
    deadline: Callable[[], bool] | None,
) -> SearchResult:
    """Search ``objective`` (over ``cluster``, in canonical order, with exact twins ``twin_class``)."""
    labels = link_clusters(cluster)
    if same_partition(labels, twin_class):
        return Search(objective, twin_class, rng, config, deadline).run()
    snap_rng, improve_rng = rng.spawn(2)
    snap = snapped(cluster, labels)
    canon = canonical_order(snap)  # clusters contiguous, as the structured starts expect
    snap_obj = make_objective(objective.name, snap.permuted(canon.order), workload, objective.num_stages)
    coarse_cfg = replace(config, patience=min(config.patience, COARSE_PATIENCE), min_evaluations=0)
    coarse = Search(snap_obj, canon.twin_class, snap_rng, coarse_cfg, deadline)
    coarse.run()
    starts = [canon.order[np.array(groups).T] for groups in coarse.stage_groups(IMPROVED_PLANS)]
    n = cluster.num_devices
    fine_cfg = replace(config, patience=min(config.patience, FINE_PATIENCE),
                       max_evaluations=min(config.max_evaluations, FINE_EVALUATIONS_PER_DEVICE * n))
    fine = Search(objective, twin_class, improve_rng, fine_cfg, deadline)
    result = fine.improve(starts, labels, full_swaps=n <= FULL_SWAP_MAX_DEVICES)
    stopped = coarse.stopped_by if coarse.stopped_by != "converged" else result.stopped_by
    evaluations = coarse.p.evaluations + result.evaluations
    if n <= RAW_SEARCH_MAX_DEVICES:
        # a few devices make clusters of one or two, where the snapped network guides poorly
        raw = Search(objective, twin_class, rng.spawn(1)[0], config, deadline).run()
        evaluations += raw.evaluations
        if raw.cost.cost_s < result.cost.cost_s:
            result, stopped = raw, raw.stopped_by
    return SearchResult(result.assignment, result.cost, evaluations, stopped)
