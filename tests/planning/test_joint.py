"""The joint planner (layer split + assignment, memory limits) against the exhaustive optimum of the
simulated step time, on small mixed clusters."""

import itertools

import numpy as np
import pytest

from p2ptrain.planning import Cluster, Device, schedule
from p2ptrain.planning.layers import LayerCosts, LayeredWorkload, Parts
from p2ptrain.planning.simulated import SimulatedObjective, StepProfile
from p2ptrain.planning.split import layers_from_sizes

from .random_clusters import _world, region_cluster

CARDS = [(312.0, 80.0), (165.2, 24.0), (35.6, 24.0), (65.0, 16.0), (125.0, 32.0)]


def mixed_instance(seed: int):
    """≤ 6 devices in random regions with random cards; 2–3 stages; 4–6 blocks priced at random so that
    compute, communication and memory all matter."""
    rng = np.random.default_rng(seed)
    names, _ = _world()
    stages, replicas = [(2, 2), (3, 2), (2, 3), (3, 1), (2, 1)][int(rng.integers(5))]
    n = stages * replicas
    regions = list(rng.choice(names, size=n))
    base = region_cluster(regions, rng, jitter=0.2)
    cards = [CARDS[int(i)] for i in rng.integers(len(CARDS), size=n)]
    num_layers = int(rng.integers(max(4, stages), 7))
    f = float(rng.uniform(0.02, 0.3))
    block_gb = float(rng.uniform(2.0, 8.0))
    devices = tuple(Device(d.name, d.region, tflops=t, memory_gb=m) for d, (t, m) in zip(base.devices, cards, strict=False))
    cluster = Cluster(devices, base.latency_ms, base.bandwidth_gbps)
    costs = LayerCosts(
        num_layers=num_layers,
        forward_s=Parts(f, float(rng.uniform(0, f)), float(rng.uniform(0.5 * f, 3 * f))),
        backward_s=Parts(2 * f, float(rng.uniform(0, f)), float(rng.uniform(f, 6 * f))),
        update_s=Parts(float(rng.uniform(0, 0.02)), 0.0, 0.0),
        gradient_gb=Parts(float(rng.uniform(0.05, 0.5)), float(rng.uniform(0, 0.5)), float(rng.uniform(0, 0.5))),
        memory_gb=Parts(block_gb, float(rng.uniform(0, 4)), float(rng.uniform(0, 8))),
    )
    step = StepProfile(micro_batches=int(rng.choice([1, 2, 4])), reference_tflops=312.0)
    workload = LayeredWorkload(float(rng.uniform(0.05, 1.0)), 0.0, step=step, costs=costs)
    return cluster, workload, stages


def splits(num_layers: int, stages: int):
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        yield layers_from_sizes(np.diff((0, *cuts, num_layers)).tolist())


def exhaustive(cluster: Cluster, workload: LayeredWorkload, stages: int) -> float:
    """The best simulated step over every split and every assignment (pipelines up to their order) that
    fits memory: plain enumeration, nothing shared with the planner but the simulation."""
    n = cluster.num_devices
    cap = np.array([d.memory_gb for d in cluster.devices])
    sigmas = [np.array(p).reshape(n // stages, stages) for p in itertools.permutations(range(n))]
    sigmas = [s for s in sigmas if (np.diff(s[:, 0]) > 0).all()]  # pipelines in any order cost the same
    best = np.inf
    for layers in splits(workload.costs.num_layers, stages):
        memory = np.array(workload.costs.memory(layers))
        obj = SimulatedObjective(cluster, workload.at(layers), stages)
        for sigma in sigmas:
            if (memory <= cap[sigma].min(axis=0)).all():
                best = min(best, obj.simulate(sigma).predicted_s)
    return best


def plan_cost(plan, cluster, workload, stages) -> float:
    layers = tuple(tuple(r) for r in plan.layers)
    sigma = np.array(plan.pipelines)
    assert sorted(sigma.ravel().tolist()) == list(range(cluster.num_devices))
    cap = np.array([d.memory_gb for d in cluster.devices])
    assert (np.array(workload.costs.memory(layers)) <= cap[sigma].min(axis=0) + 1e-12).all()
    assert plan.stage_memory_gb == pytest.approx(workload.costs.memory(layers))
    return SimulatedObjective(cluster, workload.at(layers), stages).simulate(sigma).predicted_s


@pytest.mark.timeout(600)
def test_joint_plans_reach_the_exhaustive_optimum_on_small_mixed_clusters():
    gaps, infeasible = [], 0
    for seed in range(40):
        cluster, workload, stages = mixed_instance(seed)
        best = exhaustive(cluster, workload, stages)
        plan = schedule(cluster, workload, stages, objective="simulated", seed=seed)
        if not np.isfinite(best):
            assert plan.__class__.__name__ == "Infeasible"
            infeasible += 1
            continue
        assert plan.search.method == "joint"
        gaps.append(plan_cost(plan, cluster, workload, stages) / best - 1.0)
    gaps = np.array(gaps)
    print(f"{len(gaps)} feasible, {infeasible} infeasible, optimum reached {np.mean(gaps < 1e-9):.0%}, "
          f"worst gap {gaps.max():.3%}")
    assert len(gaps) >= 30
    assert (gaps > -1e-9).all()  # never below the optimum: the oracle is right
    assert (gaps < 1e-9).mean() >= 0.95
