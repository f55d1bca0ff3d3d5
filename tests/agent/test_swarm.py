"""The local swarm end to end: real agent processes, real DHT, real libp2p on loopback."""

from __future__ import annotations

import pytest
from agent_helpers import run_swarm

from p2ptrain.config import config_from_dict
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_swarm_losses_equal_single_process_training(tmp_path):
    code, summary, stderr = run_swarm(tmp_path, "--agents", "4", "--stages", "2", "--steps", "3")
    assert code == 0, stderr[-3000:]
    assert summary["finished"] and summary["stages"] == 2 and summary["replicas"] == 2
    cfg = config_from_dict(TrainConfig, summary["config"])
    reference = train_reference(cfg)
    assert len(summary["losses"]) == len(summary["step_time_s"]) == 3
    for got, want in zip(summary["losses"], reference.losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (summary["losses"], reference.losses)
    # the plan: every agent once, in 2 pipelines of 2 stages, led by the lowest peer ID
    pipelines = summary["plan"]["pipelines"]
    assert sorted(a for row in pipelines for a in row) == [0, 1, 2, 3] and all(len(r) == 2 for r in pipelines)
    peers = summary["peers"]
    assert peers[str(summary["leader"])] == min(peers.values())
