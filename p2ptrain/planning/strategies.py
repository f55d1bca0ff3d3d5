"""The search methods ``schedule`` can run, by name (``p2ptrain plan --search NAME``).

- ``clustered`` (the default): the partition search on the network's recovered regions and instances,
  then on the links as measured (``clustered``). On exact matrices it is ``partition``.
- ``partition``: the partition search alone (``search``), on the links as given.
- ``gcma``: the paper's scheduler (``gcma``), for comparison; it stops on the time or evaluation budget.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.clustered import clustered_search
from p2ptrain.planning.cost import Objective
from p2ptrain.planning.gcma import GcmaConfig, gcma_search
from p2ptrain.planning.search import Search, SearchConfig, SearchResult
from p2ptrain.planning.workload import Workload

SEARCH_METHODS = ("clustered", "partition", "gcma")
DEFAULT_METHOD = "clustered"


def run_search(
    method: str,
    objective: Objective,
    cluster: Cluster,
    workload: Workload,
    twin_class: np.ndarray,
    rng: np.random.Generator,
    config: SearchConfig,
    deadline: Callable[[], bool] | None,
    gcma: GcmaConfig | None = None,
) -> SearchResult:
    """Run search ``method`` on ``objective`` (``cluster`` in canonical order, exact twins ``twin_class``)."""
    if method == "clustered":
        return clustered_search(objective, cluster, workload, twin_class, rng, config, deadline)
    if method == "partition":
        return Search(objective, twin_class, rng, config, deadline).run()
    if method == "gcma":
        return gcma_search(objective, rng, gcma or GcmaConfig(), deadline)
    raise ValueError(f"unknown search {method!r} (choose from {', '.join(SEARCH_METHODS)})")
