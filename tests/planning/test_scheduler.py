import itertools

import numpy as np
import pytest

from p2ptrain.planning import (
    PAPER_REFERENCE,
    PAPER_WORKLOAD,
    SCENARIOS,
    DtfmObjective,
    Infeasible,
    Plan,
    SearchConfig,
    scenario,
    schedule,
)

from .random_clusters import random_instance

_PLANS: dict[str, Plan] = {}


def _paper_plan(name: str) -> Plan:
    if name not in _PLANS:
        _PLANS[name] = schedule(scenario(name), PAPER_WORKLOAD, 8, seed=0)
    return _PLANS[name]


def _check_plan(plan: Plan, cluster, stages: int, workload=PAPER_WORKLOAD) -> None:
    assert isinstance(plan, Plan)
    devices = [d for row in plan.pipelines for d in row]
    assert sorted(devices) == list(range(cluster.num_devices))  # every device exactly once
    assert plan.num_stages == stages and plan.num_replicas * stages == cluster.num_devices
    exact = DtfmObjective(cluster, workload, stages).evaluate(np.array(plan.pipelines))
    assert exact.cost_s == pytest.approx(plan.cost.cost_s, rel=1e-12)


@pytest.mark.parametrize("name", SCENARIOS)
def test_paper_networks_no_worse_than_gcma(name):
    plan = _paper_plan(name)
    _check_plan(plan, scenario(name), 8)
    assert round(plan.cost.cost_s, 3) <= PAPER_REFERENCE[name]["gcma_s"]
    assert plan.baselines["megatron"].cost_s == pytest.approx(PAPER_REFERENCE[name]["megatron_s"], abs=5e-4)
    assert plan.cost.cost_s <= plan.baselines["random"].cost_s


def test_spot_reaches_the_hand_made_optimum():
    plan = _paper_plan("spot")
    assert round(plan.cost.cost_s, 3) == 31.634
    # each pipeline: four single-GPU instances, then one 4-GPU instance for stages 4–7 (or the reverse)
    names = [[scenario("spot").devices[d].name for d in row] for row in plan.pipelines]
    for row in names:
        inside = [n for n in row if "-i" in n]
        assert len(inside) == 4 and len({n.rsplit("-g", 1)[0] for n in inside}) == 1


@pytest.mark.parametrize("name", ["spot", "regional"])
def test_plans_do_not_depend_on_device_order(name):
    cluster = scenario(name)
    perm = np.random.default_rng(11).permutation(64)
    shuffled = schedule(cluster.permuted(perm), PAPER_WORKLOAD, 8, seed=0)
    assert shuffled.cost == _paper_plan(name).cost
    assert shuffled.search.evaluations == _paper_plan(name).search.evaluations  # the same search, relabelled


def test_generic_cluster_order_independence_without_twins():
    cluster, workload, stages = random_instance(7, max_devices=12, jitter=0.3)
    kwargs = dict(seed=3, exhaustive_max_devices=0)
    base = schedule(cluster, workload, stages, **kwargs)
    for k in range(3):
        perm = np.random.default_rng(k).permutation(cluster.num_devices)
        again = schedule(cluster.permuted(perm), workload, stages, **kwargs)
        assert again.cost == base.cost
        assert sorted(tuple(sorted(perm[list(col)])) for col in again.stage_groups()) == sorted(
            tuple(sorted(col)) for col in base.stage_groups()
        )


def test_same_seed_same_plan():
    cluster = scenario("worldwide", 16)
    a = schedule(cluster, PAPER_WORKLOAD, 4, seed=5)
    b = schedule(cluster, PAPER_WORKLOAD, 4, seed=5)
    assert a == b and a.search.seed == 5 and a.search.seconds is None


def test_infeasible_stage_counts():
    cluster = scenario("worldwide", 12)
    out = schedule(cluster, PAPER_WORKLOAD, 5)
    assert isinstance(out, Infeasible) and "multiple of the stage count" in out.reason
    assert isinstance(schedule(cluster, PAPER_WORKLOAD, 0), Infeasible)


def test_degenerate_shapes():
    cluster = scenario("regional", 16)
    for stages in (1, 16):
        plan = schedule(cluster, PAPER_WORKLOAD, stages, exhaustive_max_devices=0)
        _check_plan(plan, cluster, stages)
    one = schedule(scenario("worldwide", 1), PAPER_WORKLOAD, 1)
    assert one.pipelines == ((0,),) and one.cost.cost_s == 0.0


def test_small_clusters_are_solved_exactly():
    cluster, workload, stages = random_instance(2)
    plan = schedule(cluster, workload, stages)
    assert plan.search.method == "exhaustive"
    objective = DtfmObjective(cluster, workload, stages)
    n = cluster.num_devices
    if n <= 8:
        best = min(objective.evaluate(np.array(p).reshape(-1, stages)).cost_s for p in itertools.permutations(range(n)))
        assert plan.cost.cost_s == pytest.approx(best)


def test_time_budget_stops_the_search_with_a_valid_plan():
    ticks = iter(range(10**9))
    cluster = scenario("worldwide", 128)
    plan = schedule(cluster, PAPER_WORKLOAD, 16, seed=0, time_budget_s=50, clock=lambda: float(next(ticks)))
    _check_plan(plan, cluster, 16)
    assert plan.search.stopped_by == "time budget" and plan.search.seconds is not None
    assert plan.cost.cost_s < plan.baselines["random"].cost_s
    with pytest.raises(ValueError, match="needs a clock"):
        schedule(cluster, PAPER_WORKLOAD, 16, time_budget_s=1.0)


def test_evaluation_budget_is_a_deterministic_stop():
    cluster = scenario("worldwide", 32)
    cfg = SearchConfig(max_evaluations=300)
    a = schedule(cluster, PAPER_WORKLOAD, 4, config=cfg)
    assert a.search.stopped_by == "evaluations" and a == schedule(cluster, PAPER_WORKLOAD, 4, config=cfg)


def test_plan_json_has_the_contract_fields():
    doc = _paper_plan("worldwide").to_json()
    assert list(doc)[:9] == ["stages", "replicas", "objective", "cost_s", "data_parallel_s", "pipeline_s",
                             "pipelines", "baselines", "search"]
    assert doc["objective"] == "dtfm" and doc["stages"] == doc["replicas"] == 8
    assert set(doc["baselines"]) == {"megatron", "random"} and "cost_s" in doc["baselines"]["random"]
    assert {"seconds", "evaluations", "seed"} <= set(doc["search"])
    assert doc["cost_s"] == pytest.approx(doc["data_parallel_s"] + doc["pipeline_s"])


def test_report_shows_the_table_and_truncates_large_plans():
    from p2ptrain.planning import CostBreakdown, SearchStats, megatron_assignment
    from p2ptrain.planning.report import format_plan

    cluster = scenario("worldwide", 128)
    sigma = megatron_assignment(128, 16)  # 8 pipelines × 16 stages: more stages than the table shows
    cost = DtfmObjective(cluster, PAPER_WORKLOAD, 16).evaluate(sigma)
    plan = Plan(tuple(map(tuple, sigma.tolist())), "dtfm", cost, {"megatron": cost, "random": CostBreakdown(9, 4, 5)},
                SearchStats(seed=0, evaluations=1))
    text = format_plan(plan, cluster, PAPER_WORKLOAD, "worldwide")
    assert "stage 11" in text and "stage 12 " not in text.split("regions of")[0]
    assert "4 more stages (--json prints the whole plan)" in text
    assert "stage 0: 8×Oregon" in text and "stage 15: 8×Ireland" in text  # every stage's regions
