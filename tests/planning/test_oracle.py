"""The search against the exhaustive optimum (small clusters) and against a 20× longer run of itself."""

import numpy as np
import pytest

from p2ptrain.planning import SearchConfig, Workload, make_objective, schedule, solve_exhaustive
from p2ptrain.planning.measured import perturbed

from .random_clusters import _world, random_instance, region_cluster


def _gaps(seeds, jitter, perturb=0.0):
    gaps = []
    for seed in seeds:
        cluster, workload, stages = random_instance(seed, jitter=jitter)
        if perturb:  # measured: every link's latency and bandwidth off by up to ±perturb, order shuffled
            cluster, _ = perturbed(cluster, perturb, np.random.default_rng(seed + 1))
        best = solve_exhaustive(make_objective("dtfm", cluster, workload, stages)).cost.cost_s
        # the search itself: the exhaustive shortcut for small clusters is switched off
        plan = schedule(cluster, workload, stages, seed=seed, exhaustive_max_devices=0)
        assert plan.search.method == "clustered"
        gaps.append(plan.cost.cost_s / best - 1.0)
    return np.array(gaps)


@pytest.mark.timeout(240)
def test_search_finds_the_optimum_on_100_region_clusters():
    gaps = _gaps(range(100), jitter=0.0)
    assert (gaps > -1e-9).all()  # never below the optimum: the oracle is right
    assert (gaps < 1e-9).mean() >= 0.98
    assert gaps.max() <= 0.02


@pytest.mark.timeout(240)
def test_search_on_measured_like_clusters_without_twins():
    # every link jittered by up to ±30 %: no two devices alike, as in a measured network
    gaps = _gaps(range(1000, 1050), jitter=0.3)
    assert (gaps > -1e-9).all()
    assert (gaps < 1e-9).mean() >= 0.95
    assert gaps.max() <= 0.02


@pytest.mark.timeout(240)
@pytest.mark.parametrize("level, first", [(0.10, 3000), (0.25, 4000)])
def test_search_on_perturbed_region_clusters(level, first):
    gaps = _gaps(range(first, first + 60), jitter=0.0, perturb=level)
    assert (gaps > -1e-9).all()
    assert (gaps < 1e-9).mean() >= 0.95
    assert gaps.max() <= 0.02


def _mid_instance(seed):
    rng = np.random.default_rng(seed)
    names, _ = _world()
    n = int(rng.choice([16, 24, 32, 48]))
    stages = int(rng.choice([s for s in range(2, 9) if n % s == 0 and n // s >= 2]))
    k = int(rng.integers(2, 7))
    chosen = rng.choice(names, size=k, replace=False)
    regions = list(rng.choice(chosen, size=n, p=rng.dirichlet(np.full(k, 0.7))))
    gradient_gb = float(rng.uniform(0.2, 1.0))
    ratio = float(np.exp(rng.uniform(np.log(0.1), np.log(10.0))))
    return region_cluster(regions, rng), Workload(ratio * gradient_gb, gradient_gb), stages


@pytest.mark.timeout(240)
def test_default_search_matches_a_run_with_20_times_the_budget():
    default = SearchConfig()
    long = SearchConfig(
        random_starts=20 * default.random_starts,
        elite=2 * default.elite,
        patience=20 * default.patience,
        min_evaluations=20 * default.min_evaluations,
        max_evaluations=20 * default.max_evaluations,
    )
    ratios = []
    for seed in range(6):
        cluster, workload, stages = _mid_instance(2000 + seed)
        ours = schedule(cluster, workload, stages, seed=0)
        longer = schedule(cluster, workload, stages, seed=1, config=long)
        ratios.append(ours.cost.cost_s / longer.cost.cost_s - 1.0)
    assert max(ratios) <= 1e-9, ratios
