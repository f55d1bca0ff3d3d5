"""A follower checks a mixed-device plan at the leader's own layer split, with every trainer's measured
speed (``agent.plan_check`` with a layered workload; no I/O)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership.plan_check import cost_check
from p2ptrain.agent.leadership.plan_maker import build_cluster, make_plan, run_workload
from p2ptrain.net.dht.records import ComputeMeasurement, LinkMeasurement, LinksRecord, PeerRecord, PlanRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.planning import make_objective
from p2ptrain.planning.scenarios import scenario
from p2ptrain.runtime.calibration import layered_workload, measured_speed
from p2ptrain.runtime.config import TrainConfig

TRAIN = TrainConfig(model="tiny", steps=2, global_batch_size=8, micro_batches=2, stages=2)
FAST = ComputeMeasurement(rows=2, seq_len=64, layer_s=(0.02, 0.04), embed_s=(0.005, 0.01), head_s=(0.01, 0.02),
                          update_s_per_mparam=0.02, message_s=0.0003)
SLOW = dataclasses.replace(FAST, layer_s=(0.16, 0.32), embed_s=(0.04, 0.08), head_s=(0.08, 0.16))  # 8x slower
SIMULATED = PlanConfig(objective="simulated", time_budget_s=30.0)


def test_a_layered_plan_is_checked_at_its_own_split_with_measured_speeds():
    peers = sorted(generate_identity().peer_id for _ in range(4))
    net = scenario("worldwide", 4)
    speeds = [FAST, SLOW, FAST, SLOW]
    records = {p: PeerRecord(device_name=f"dev{k}", memory_gb=16.0, tflops=10.0, compute=speeds[k])
               for k, p in enumerate(peers)}
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(float(net.latency_ms[i, j]), float(net.bandwidth_gbps[i, j]))
                                       for j, b in enumerate(peers) if j != i})
            for i, a in enumerate(peers)}
    cluster = build_cluster(peers, records, rows, EmulationSettings())
    assert [d.tflops for d in cluster.devices] == [measured_speed(c) for c in speeds]  # own speeds, not declared

    def workload_for(cluster, trainers, peers=None, train=None):
        return layered_workload([records[p].compute for p in trainers], run_workload(TRAIN, 2, 2), TRAIN, 2)

    plan = make_plan(cluster, workload_for(cluster, peers), 2, SIMULATED)
    assert plan["search"]["method"] == "joint" and plan["layers"] != [[0, 4], [4, 8]]  # 8x apart: uneven
    record = PlanRecord.from_plan_json(0, peers, plan)
    check = cost_check(record, records, rows, TRAIN, SIMULATED, EmulationSettings(), workload_for, 0.1)
    assert check.problem is None
    assert check.theirs_s == pytest.approx(plan["cost_s"]) and check.ours_s == pytest.approx(plan["cost_s"])
    # the same assignment claimed at the even split is priced at the even split, and is slower
    even = dataclasses.replace(record, layers=(4, 4))
    evenly = cost_check(even, records, rows, TRAIN, SIMULATED, EmulationSettings(), workload_for, 0.1)
    assert evenly.theirs_s > check.theirs_s
    objective = make_objective("simulated", cluster, workload_for(cluster, peers).at(((0, 4), (4, 8))), 2)
    assert evenly.theirs_s == pytest.approx(objective.evaluate(np.array(plan["pipelines"])).cost_s)
