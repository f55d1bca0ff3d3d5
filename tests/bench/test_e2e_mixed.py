"""The e2e benchmark on mixed GPUs, without a swarm: every plan is priced at its own layer split on what
the scheduled swarm's leader planned with (its measured links, every agent's speed, the per-layer costs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.bench.e2e import E2EConfig, leader_objectives, speedups
from p2ptrain.planning import Cluster, Device, LayerCosts, LayeredWorkload, Parts, StepProfile, scenario
from p2ptrain.planning.simulated import SimulatedObjective

COSTS = LayerCosts(num_layers=8, forward_s=Parts(0.01, 0.002, 0.004), backward_s=Parts(0.02, 0.003, 0.008),
                   update_s=Parts(0.001), gradient_gb=Parts(0.01, 0.02, 0.02), memory_gb=Parts(0.1))
STEP = StepProfile(micro_batches=2, message_s=0.001, boundary_s=0.01, reference_tflops=4.0)


def summary(layers):
    net = scenario("worldwide", 4)
    return {
        "plan": {"pipelines": [[0, 1], [2, 3]], "layers": layers},
        "workload": {"activation_gb": 0.05, "gradient_gb": 0.08, "step": dataclasses.asdict(STEP),
                     "layer_costs": dataclasses.asdict(COSTS)},
        "measured": {"latency_ms": net.latency_ms.tolist(), "bandwidth_gbps": net.bandwidth_gbps.tolist(),
                     "tflops": [4.0, 2.0, 1.0, 4.0]},
    }


def direct(pipelines, layers):
    net = scenario("worldwide", 4)
    cluster = Cluster(tuple(Device(f"agent-{k}", tflops=t) for k, t in enumerate([4.0, 2.0, 1.0, 4.0])),
                      net.latency_ms, net.bandwidth_gbps)
    workload = LayeredWorkload(0.05, 0.08, step=STEP, costs=COSTS).at(layers)
    return SimulatedObjective(cluster, workload, 2).evaluate(np.array(pipelines)).cost_s


def test_plans_are_priced_at_their_own_split_with_every_agents_speed():
    simulated = leader_objectives(summary([[0, 6], [6, 8]]))["simulated"]
    uneven = simulated.evaluate(np.array([[0, 1], [2, 3]]), [[0, 6], [6, 8]]).cost_s
    even = simulated.evaluate(np.array([[0, 1], [2, 3]])).cost_s
    assert uneven == pytest.approx(direct([[0, 1], [2, 3]], ((0, 6), (6, 8))))
    assert even == pytest.approx(direct([[0, 1], [2, 3]], ((0, 4), (4, 8))))
    assert uneven != pytest.approx(even)
    plans = {"scheduled": {"pipelines": [[0, 1], [2, 3]], "layers": [[0, 6], [6, 8]], "measured_step_s": 1.0,
                           "predicted_step_s": 1.0},
             "communication_only": {"pipelines": [[0, 2], [1, 3]], "layers": None, "measured_step_s": 1.5,
                                    "predicted_step_s": 1.4}}
    ratios = speedups(plans, leader_objectives(summary([[0, 6], [6, 8]])))["over_communication_only"]
    assert ratios["measured"] == pytest.approx(1.5)
    assert ratios["predicted"] == pytest.approx(direct([[0, 2], [1, 3]], ((0, 4), (4, 8)))
                                                / direct([[0, 1], [2, 3]], ((0, 6), (6, 8))))


def test_mixed_networks_compare_the_compute_aware_plan_with_the_papers_and_megatrons():
    assert E2EConfig(scenario="volunteers").plans == ("scheduled", "communication_only", "megatron")
    assert E2EConfig(scenario="worldwide").plans == ("scheduled", "megatron", "random")
    with pytest.raises(ValueError, match="unknown scenario"):
        E2EConfig(scenario="moon")
