"""Mixed GPUs end to end: a local swarm on the ``volunteers`` network (compute emulated per agent) plans
with each agent's own calibration, cuts the model unevenly, and still trains to the single-process losses."""

from __future__ import annotations

import pytest
from agent_helpers import run_swarm

from p2ptrain.config import config_from_dict
from p2ptrain.planning import scenario
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_a_mixed_gpu_swarm_plans_uneven_stages_and_trains_exactly(tmp_path):
    code, summary, stderr = run_swarm(tmp_path, "--agents", "4", "--stages", "2", "--steps", "3", "--scenario",
                                      "volunteers", "--objective", "simulated", timeout_s=280)
    assert code == 0, stderr[-3000:]
    plan = summary["plan"]
    assert plan["search"]["method"] == "joint" and plan["schedule"] == "gpipe"
    layers = plan["layers"]
    assert layers[0][0] == 0 and layers[-1][1] == 8 and layers[0][1] == layers[1][0]
    # agents 0-3 play an A100, an RTX 4090, an RTX 3090 and a T4 (1, 1.9, 8.8 and 4.8 times the A100's
    # compute time): every grouping leaves the two stages' slowest cards unlike, so the split is uneven
    assert layers != [[0, 4], [4, 8]]
    speeds = summary["measured"]["tflops"]  # what the leader planned with: each agent's own calibration
    cards = [d.tflops for d in scenario("volunteers", 4).devices]
    assert speeds[2] == min(speeds) and cards[2] == min(cards)
    assert speeds[0] > speeds[3] > speeds[2]
    cfg = config_from_dict(TrainConfig, summary["config"])
    reference = train_reference(cfg)
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (summary["losses"], reference.losses)
