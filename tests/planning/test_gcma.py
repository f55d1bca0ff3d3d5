"""The paper's scheduler (GCMA), run live: balanced partitions throughout, exact scores, seeded, budgeted."""

import numpy as np
import pytest

from p2ptrain.planning import PAPER_WORKLOAD, DtfmObjective, GcmaConfig, make_objective, scenario, schedule
from p2ptrain.planning.exhaustive import solve_exhaustive
from p2ptrain.planning.gcma import _Gcma, gcma_search

from .random_clusters import random_instance


def _sizes(labels, s):
    return np.bincount(labels, minlength=s).tolist()


def test_crossover_and_cyclic_partitioning_keep_groups_balanced():
    obj = DtfmObjective(scenario("worldwide", 32), PAPER_WORKLOAD, 4)
    g = _Gcma(obj, np.random.default_rng(0), GcmaConfig(), None)
    base = np.repeat(np.arange(4), 8)
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b = base[rng.permutation(32)], base[rng.permutation(32)]
        child = g.crossover(a, b)
        assert _sizes(child, 4) == [8] * 4 and (child != b).sum() <= 2 * 5
        assert _sizes(g.cyclic_partitioning(child), 4) == [8] * 4


def test_gcma_plans_are_valid_seeded_and_budgeted():
    cluster = scenario("regional", 16)
    obj = make_objective("dtfm", cluster, PAPER_WORKLOAD, 4)
    cfg = GcmaConfig(population=10, offspring=40)
    a = gcma_search(obj, np.random.default_rng(3), cfg, None)
    b = gcma_search(obj, np.random.default_rng(3), cfg, None)
    assert np.array_equal(a.assignment, b.assignment) and a.cost == b.cost
    assert sorted(a.assignment.ravel().tolist()) == list(range(16))
    assert a.cost == obj.evaluate(a.assignment)
    assert a.evaluations == 10 + 40 and a.stopped_by == "evaluations"
    ticks = iter(range(10**6))
    cut = gcma_search(obj, np.random.default_rng(3), cfg, lambda: next(ticks) >= 5)
    assert cut.stopped_by == "time budget" and cut.evaluations < 50


@pytest.mark.parametrize("seed", range(6))
def test_gcma_never_beats_the_exhaustive_optimum(seed):
    cluster, workload, stages = random_instance(seed)
    obj = make_objective("dtfm", cluster, workload, stages)
    best = solve_exhaustive(obj).cost.cost_s
    found = gcma_search(obj, np.random.default_rng(seed), GcmaConfig(population=20, offspring=100), None)
    assert found.cost.cost_s >= best - 1e-9


def test_schedule_runs_gcma_by_name():
    plan = schedule(scenario("multi_dc", 16), PAPER_WORKLOAD, 4, search="gcma", exhaustive_max_devices=0,
                    gcma=GcmaConfig(population=10, offspring=50))
    assert plan.search.method == "gcma" and plan.search.evaluations == 60 and plan.cost.cost_s <= plan.baselines["megatron"].cost_s
    with pytest.raises(ValueError, match="unknown search 'sa'"):
        schedule(scenario("multi_dc", 16), PAPER_WORKLOAD, 4, search="sa")
