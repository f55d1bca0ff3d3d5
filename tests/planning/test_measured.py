"""The scheduler on networks as agents measure them: the paper's networks with every link perturbed.

Every perturbed network is made here, from this file's own seeds: each link's latency and bandwidth
scaled by its own factor in [1 − x, 1 + x] (the same both ways), device order shuffled.
"""

import numpy as np
import pytest

from p2ptrain.planning import PAPER_WORKLOAD, SCENARIOS, DtfmObjective, Plan, scenario, schedule
from p2ptrain.planning.canonical import canonical_order
from p2ptrain.planning.clustered import same_partition
from p2ptrain.planning.measured import link_clusters, perturbed, snapped

LEVELS = (0.10, 0.25)
_EXACT: dict[str, Plan] = {}


def _exact_plan(name: str) -> Plan:
    if name not in _EXACT:
        _EXACT[name] = schedule(scenario(name), PAPER_WORKLOAD, 8, seed=0)
    return _EXACT[name]


def test_perturbed_links_are_symmetric_within_bounds_and_shuffled():
    exact = scenario("worldwide")
    noisy, order = perturbed(exact, 0.25, np.random.default_rng(4))
    assert sorted(order) == list(range(64)) and not (order == np.arange(64)).all()
    back = noisy.permuted(np.argsort(order))
    off = ~np.eye(64, dtype=bool)
    for got, want in ((back.latency_ms, exact.latency_ms), (back.bandwidth_gbps, exact.bandwidth_gbps)):
        assert (got == got.T).all()
        ratio = got[off] / want[off]
        assert ratio.min() >= 0.75 and ratio.max() <= 1.25 and ratio.std() > 0.1
    with pytest.raises(ValueError, match="perturbation"):
        perturbed(exact, 1.5, np.random.default_rng(0))


@pytest.mark.parametrize("name", SCENARIOS)
def test_clusters_are_the_twin_classes_of_exact_networks_and_survive_noise(name):
    exact = scenario(name)
    truth = link_clusters(exact)
    assert same_partition(truth, canonical_order(exact).twin_class[np.argsort(canonical_order(exact).order)])
    for k, level in enumerate(LEVELS):
        noisy, order = perturbed(exact, level, np.random.default_rng(100 + k))
        assert same_partition(link_clusters(noisy), truth[order]), level


def test_snapping_averages_each_cluster_pair():
    noisy, order = perturbed(scenario("multi_dc"), 0.25, np.random.default_rng(5))
    labels = link_clusters(noisy)
    snap = snapped(noisy, labels)
    a, b = np.flatnonzero(labels == 0), np.flatnonzero(labels == 1)
    assert snap.latency_ms[a[0], b[0]] == pytest.approx(noisy.latency_ms[np.ix_(a, b)].mean())
    assert 1 / snap.bandwidth_gbps[a[0], a[1]] == pytest.approx(
        (1 / noisy.bandwidth_gbps[np.ix_(a, a)][~np.eye(len(a), dtype=bool)]).mean())
    assert len(np.unique(snap.latency_ms[np.ix_(a, b)])) == 1  # exact twins now
    assert snap.latency_ms[a[0], a[0]] == 0.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_measured_network_plan_no_worse_than_the_exact_plan_on_the_same_links(name, level):
    seed = 1000 + 100 * SCENARIOS.index(name) + round(100 * level)
    noisy, order = perturbed(scenario(name), level, np.random.default_rng(seed))
    plan = schedule(noisy, PAPER_WORKLOAD, 8, seed=0)  # no clock: the evaluation budget alone stops it
    assert isinstance(plan, Plan) and plan.search.method == "clustered"
    objective = DtfmObjective(noisy, PAPER_WORKLOAD, 8)
    assert objective.evaluate(np.array(plan.pipelines)).cost_s == pytest.approx(plan.cost.cost_s, rel=1e-12)
    # the plan found on the exact network, on the perturbed links (device k of ``noisy`` is order[k])
    reference = objective.evaluate(np.argsort(order)[np.array(_exact_plan(name).pipelines)]).cost_s
    assert plan.cost.cost_s <= reference, (plan.cost.cost_s, reference)
    assert plan.cost.cost_s <= plan.baselines["megatron"].cost_s
