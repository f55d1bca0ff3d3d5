"""Link measurement through the agents: emulated links are measured within 10%, and the leader's plan on
a measured network is as good as the plan computed from the true matrices."""

from __future__ import annotations

import json

import numpy as np
import pytest
from agent_helpers import run_swarm

from p2ptrain.planning import Workload, make_objective, scenario, schedule

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_agents_measure_emulated_links_within_ten_percent(tmp_path):
    # three devices, time scale 1 and size factor 1: the links are emulated exactly as written
    latency_ms = [[0, 50, 5], [50, 0, 20], [5, 20, 0]]
    bandwidth_gbps = [[1, 0.020, 0.200], [0.020, 1, 0.050], [0.200, 0.050, 1]]
    cluster = tmp_path / "three.json"
    cluster.write_text(json.dumps({"devices": [{"name": f"d{i}"} for i in range(3)], "latency_ms": latency_ms,
                                   "bandwidth_gbps": bandwidth_gbps}))  # fmt: skip
    code, summary, stderr = run_swarm(tmp_path / "swarm", "--agents", "3", "--stages", "3", "--steps", "1",
                                      "--cluster", str(cluster), "--batch-size", "4")  # fmt: skip
    assert code == 0, stderr[-3000:]
    assert summary["emulation"] == {"time_scale": 1.0, "size_factor": 1.0, "compute_scale": 1.0}
    measured = summary["measured"]  # the leader's cluster: both directions combined, in the file's units
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        assert measured["latency_ms"][i][j] == pytest.approx(latency_ms[i][j], rel=0.10), (i, j, measured)
        assert measured["bandwidth_gbps"][i][j] == pytest.approx(bandwidth_gbps[i][j], rel=0.10), (i, j, measured)


@pytest.mark.timeout(300)
def test_leader_plans_a_measured_worldwide_swarm_as_well_as_the_true_network(tmp_path):
    code, summary, stderr = run_swarm(tmp_path, "--agents", "8", "--stages", "2", "--steps", "1",
                                      "--scenario", "worldwide")  # fmt: skip
    assert code == 0, stderr[-3000:]
    truth = scenario("worldwide", 8)
    workload = Workload(**summary["workload"])  # this run's volumes over the size factor, as the leader used
    objective = make_objective("dtfm", truth, workload, 2)
    measured_plan_s = objective.evaluate(np.array(summary["plan"]["pipelines"])).cost_s
    true_plan_s = schedule(truth, workload, 2).cost.cost_s
    assert measured_plan_s <= 1.02 * true_plan_s, (summary["plan"], measured_plan_s, true_plan_s)
    # bandwidths are measured within 10%; latencies too where the emulated delay (α × time scale) is at least
    # 5 ms: each hop adds a few tenths of a millisecond of real processing, small only against longer delays
    off = ~np.eye(8, dtype=bool)
    bandwidth = np.array(summary["measured"]["bandwidth_gbps"], dtype=float)
    assert np.allclose(bandwidth[off], truth.bandwidth_gbps[off], rtol=0.10)
    latency = np.array(summary["measured"]["latency_ms"], dtype=float)
    slow = off & (truth.latency_ms * summary["emulation"]["time_scale"] >= 5.0)
    assert slow.sum() >= 20 and np.allclose(latency[slow], truth.latency_ms[slow], rtol=0.10)
