"""The e2e benchmark's second prediction: the leader's plan priced again with the compute its trainers showed
in training (``bench.e2e.repriced``), on a summary shaped as a swarm writes it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from p2ptrain.bench.e2e import leader_objectives, repriced
from p2ptrain.planning.scenarios import scenario
from p2ptrain.planning.simulated import StepProfile

SCALE = 0.5
PROFILE = StepProfile(micro_batches=2, forward_s=(0.01, 0.02), backward_s=(0.02, 0.04), update_s=(0.001, 0.002),
                      gradient_gb=(0.05, 0.05), message_s=0.001, wire="bf16", schedule="1f1b", bucket_gb=0.01)


def summary() -> dict:
    net = scenario("worldwide", 4)
    return json.loads(json.dumps({
        "plan": {"pipelines": [[0, 1], [2, 3]], "cost_s": 1.0},
        "measured": {"latency_ms": net.latency_ms.tolist(), "bandwidth_gbps": net.bandwidth_gbps.tolist()},
        "workload": {"activation_gb": 0.02, "gradient_gb": 0.05, "step": dataclasses.asdict(PROFILE)},
    }))


def test_compute_shown_as_calibrated_gives_the_leaders_prediction_and_slower_compute_a_longer_step():
    per_stage = [(2 * (f + b) + u) * SCALE for f, b, u in zip(PROFILE.forward_s, PROFILE.backward_s,
                                                                 PROFILE.update_s, strict=True)]
    calibrated = {k: per_stage[k % 2] for k in range(4)}  # agents 0, 2 hold stage 0; 1, 3 stage 1
    leader = leader_objectives(summary())["simulated"].evaluate(np.array([[0, 1], [2, 3]])).cost_s * SCALE
    same = repriced(summary(), calibrated, SCALE)
    assert same["step_s"] == pytest.approx(leader) and same["compute_calibrated_s"] == pytest.approx(calibrated)
    slower = repriced(summary(), calibrated | {3: 3 * calibrated[3]}, SCALE)  # one trainer of stage 1
    assert slower["step_s"] > same["step_s"] and slower["compute_shown_s"][3] == 3 * calibrated[3]


def test_nothing_to_reprice_without_compute_or_a_trainer_that_showed_none():
    assert repriced(summary(), {0: 0.1, 1: 0.1, 2: 0.1}, SCALE) is None  # agent 3 reported nothing
    bare = summary()
    bare["workload"]["step"] = dataclasses.asdict(StepProfile())  # communication only
    assert repriced(bare, dict.fromkeys(range(4), 0.1), SCALE) is None


def test_the_measured_step_is_the_period_of_alternating_steps_and_sheds_a_lone_slow_one():
    from p2ptrain.bench.e2e import step_period

    alternating = [2.2, 2.5, 2.2, 2.5, 2.2, 2.5, 2.2, 2.5, 2.2]  # the single steps' median would say 2.2
    assert step_period(alternating) == pytest.approx(2.35)
    assert step_period([0.6, 0.6, 3.0, 0.6, 0.6, 0.6, 0.6]) == pytest.approx(0.6)
    assert step_period([1.5]) == 1.5
