"""``schedule``: the planner's entry point — a cluster, a workload and a stage count in, a Plan out.

A pure function: no clock is read unless one is passed (for ``time_budget_s`` and the reported search
time), and all randomness comes from the seed (or the Generator passed in). It works in the canonical
device order (``canonical``) and maps the plan back, so the plan does not depend on how devices are
listed. Clusters of at most ``exhaustive_max_devices`` devices are solved exactly by enumeration; larger
ones by the partition search (``search``). A ``LayeredWorkload`` under the ``simulated`` objective (mixed
devices) is planned by ``joint``: the layer split and the assignment together, under memory limits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from p2ptrain.planning.baselines import RANDOM_SAMPLES, megatron_assignment, random_cost
from p2ptrain.planning.canonical import CanonicalOrder, canonical_order
from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import Objective
from p2ptrain.planning.exhaustive import MAX_DEVICES, solve_exhaustive
from p2ptrain.planning.gcma import GcmaConfig
from p2ptrain.planning.joint import schedule_layered
from p2ptrain.planning.layers import LayeredWorkload
from p2ptrain.planning.objectives import make_objective, refine_assignment
from p2ptrain.planning.plan import Infeasible, Plan, SearchStats
from p2ptrain.planning.search import DEFAULT_SEARCH, SearchConfig
from p2ptrain.planning.strategies import DEFAULT_METHOD, SEARCH_METHODS, run_search
from p2ptrain.planning.workload import Workload

log = logging.getLogger(__name__)


def schedule(
    cluster: Cluster,
    workload: Workload,
    num_stages: int,
    *,
    seed: int = 0,
    rng: np.random.Generator | None = None,
    objective: str = "dtfm",
    time_budget_s: float | None = None,
    clock: Callable[[], float] | None = None,
    config: SearchConfig = DEFAULT_SEARCH,
    exhaustive_max_devices: int = MAX_DEVICES,
    search: str = DEFAULT_METHOD,
    gcma: GcmaConfig | None = None,
    random_samples: int = RANDOM_SAMPLES,
) -> Plan | Infeasible:
    """Assign (pipeline, stage) to every device of ``cluster``, minimising ``objective``.

    ``seed`` makes the result reproducible (``rng``, when given, replaces it as the source of randomness;
    ``seed`` is then only reported). ``time_budget_s`` caps the search and needs ``clock`` (e.g.
    ``time.perf_counter``); a plan found within the evaluation budget does not depend on the clock.
    ``exhaustive_max_devices=0`` switches the exact solver off, so that small clusters are searched too.
    ``search`` names the search method (``SEARCH_METHODS``; the default is our best; ``gcma`` configures the
    paper's). ``random_samples``: the random baseline's assignments (0: no such baseline; at 1,024 devices its
    100 cost a third of a short search). When the search's
    plan costs more than Megatron's rank order (a budget too short for a large network), the plan is that
    order, and the plan's ``search`` says so (``fallback``).
    """
    if search not in SEARCH_METHODS:
        raise ValueError(f"unknown search {search!r} (choose from {', '.join(SEARCH_METHODS)})")
    n = cluster.num_devices
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        return Infeasible(f"the number of stages must be a positive integer, got {num_stages!r}")
    if n % num_stages:
        return Infeasible(f"{n} devices cannot be split into {num_stages} stages of equal size "
                          f"(the device count must be a multiple of the stage count)")
    if time_budget_s is not None and (clock is None or time_budget_s <= 0):
        raise ValueError("a time budget needs a clock and must be positive")
    rng = rng if rng is not None else np.random.default_rng(seed)
    if isinstance(workload, LayeredWorkload) and objective == "simulated":  # mixed devices: split and assign
        return schedule_layered(cluster, workload, num_stages, inner=schedule, seed=seed, rng=rng,
                                time_budget_s=time_budget_s, clock=clock,
                                search_kwargs={"config": config, "exhaustive_max_devices": exhaustive_max_devices,
                                               "search": search, "gcma": gcma})
    start = clock() if clock else None
    search_rng, baseline_rng = rng.spawn(2)
    out_of_time = None
    if time_budget_s is not None:
        assert clock is not None and start is not None
        out_of_time = lambda: clock() - start > time_budget_s  # noqa: E731
    canon = canonical_order(cluster)
    obj = make_objective(objective, cluster.permuted(canon.order), workload, num_stages)
    sigma, evaluations, method, stopped_by = _search(obj, cluster.permuted(canon.order), workload, canon, search_rng,
                                                     search, config, exhaustive_max_devices, out_of_time, gcma)
    sigma = refine_assignment(obj, sigma)  # the simulated objective re-orders stages under its exact cost
    if cluster.has_access_links:  # the plan's pipeline order is the groups' rank order, which orders their shards
        sigma = sigma[np.argsort(canon.order[sigma][:, 0], kind="stable")]
    cost = obj.evaluate(sigma)
    megatron_sigma = canon.inverse[megatron_assignment(n, num_stages)]
    baselines = {"megatron": obj.evaluate(megatron_sigma)}
    if random_samples:
        baselines["random"] = random_cost(obj, n, baseline_rng, random_samples)
    fallback = None
    if baselines["megatron"].cost_s < cost.cost_s:
        sigma, cost, fallback = megatron_sigma, baselines["megatron"], "megatron"
        log.warning("the %s search found nothing better than Megatron's rank order (%s): planning that order",
                    method, stopped_by)
    pipelines = canon.order[sigma]
    pipelines = pipelines[np.argsort(pipelines[:, 0], kind="stable")]
    seconds = clock() - start if clock and start is not None else None
    log.info("planned %d devices in %d stages: %.3f s/iteration (%s, %d evaluations)", n, num_stages, cost.cost_s,
             method, evaluations)
    return Plan(
        pipelines=tuple(tuple(int(d) for d in row) for row in pipelines),
        objective=obj.name,
        cost=cost,
        baselines=baselines,
        search=SearchStats(seed=seed, evaluations=int(evaluations), seconds=seconds, method=method,
                           stopped_by=stopped_by, fallback=fallback),
    )


def _search(obj: Objective, cluster: Cluster, workload: Workload, canon: CanonicalOrder, rng: np.random.Generator,
            search: str, config: SearchConfig, exhaustive_max_devices: int, out_of_time: Callable[[], bool] | None,
            gcma: GcmaConfig | None) -> tuple[np.ndarray, int, str, str]:
    """The assignment of ``cluster`` (in canonical order) the search finds, with its evaluations, its method and
    what stopped it: the exact solver up to ``exhaustive_max_devices``, one group for one stage, else ``search``."""
    n = cluster.num_devices
    if n <= exhaustive_max_devices:
        exact = solve_exhaustive(obj)
        return exact.assignment, exact.partitions, "exhaustive", "converged"
    if obj.num_stages == 1:  # one group of every device: nothing to search (the partition search needs two)
        return canon.inverse[megatron_assignment(n, 1)], 1, "exhaustive", "converged"
    found = run_search(search, obj, cluster, workload, canon.twin_class, rng, config, out_of_time, gcma)
    return found.assignment, found.evaluations, search, found.stopped_by
