"""A device's compute claims: refused beyond any device, bounded by its calibration, and replaced by the
speed it shows in training, in the leader's plan and in its followers' checks alike (``agent.claims``)."""

from __future__ import annotations

import dataclasses

import pytest
from test_plan_check_mixed import FAST, SIMULATED, TRAIN

from p2ptrain.agent.config import ClaimsConfig, ConfigError, EmulationSettings
from p2ptrain.agent.leadership.claims import (
    ComputeWatch,
    bounded,
    calibrated_tflops,
    plan_slowdowns,
    predicted_compute_s,
    record_problem,
    with_slowdowns,
)
from p2ptrain.agent.leadership.plan_check import cost_check
from p2ptrain.agent.leadership.plan_maker import build_cluster, make_plan, run_workload
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, ProgressRecord
from p2ptrain.net.identity import generate_identity
from p2ptrain.planning.layers import layer_model
from p2ptrain.runtime.calibration import layered_workload

PEERS = sorted(generate_identity().peer_id for _ in range(4))
SHAPE = TRAIN.shape


def record(tflops: float = 10.0, compute=FAST) -> PeerRecord:
    return PeerRecord(device_name="dev", memory_gb=16.0, tflops=tflops, compute=compute)


def test_claims_beyond_any_device_are_refused_and_peaks_bounded_by_the_calibration():
    shown = calibrated_tflops(FAST, SHAPE)
    tokens = FAST.rows * FAST.seq_len
    assert shown == pytest.approx(3 * layer_model(SHAPE, micro_batch_tokens=tokens, micro_batches=1)
                                  .forward_flops.block / 0.06 / 1e12)
    assert record_problem(record(), SHAPE) is None
    absurd = dataclasses.replace(FAST, layer_s=(1e-15, 1e-15))
    assert "beyond any device" in record_problem(record(compute=absurd), SHAPE)
    assert bounded(record(tflops=9000.0), SHAPE, 100.0).tflops == pytest.approx(100 * shown)
    assert bounded(record(tflops=100 * shown / 2), SHAPE, 100.0).tflops == pytest.approx(100 * shown / 2)
    assert bounded(record(compute=None, tflops=9000.0), SHAPE, 100.0).tflops == 9000.0  # nothing shown: the bound
    with pytest.raises(ConfigError, match="speed_tolerance"):  # of the record
        ClaimsConfig(speed_tolerance=0.5)


def plan(**extra) -> PlanRecord:
    return PlanRecord(epoch=2, membership=tuple(PEERS), stages=2, replicas=2, pipelines=((0, 1), (2, 3)), cost_s=1.0,
                      **extra)


def test_the_predicted_compute_of_a_stage_follows_its_blocks_and_the_plan_split():
    even, uneven = plan(), plan(layers=(3, 5))
    rows = TRAIN.global_batch_size // (2 * TRAIN.micro_batches)
    grow = rows * SHAPE.seq_len / (FAST.rows * FAST.seq_len)
    params = layer_model(SHAPE, micro_batch_tokens=1, micro_batches=1).parameters
    want = (TRAIN.micro_batches * (4 * 0.06 + 0.015) * grow
            + FAST.update_s_per_mparam * params.stage(4, True, False) / 1e6)
    assert predicted_compute_s(FAST, TRAIN, even, 0) == pytest.approx(want)
    assert predicted_compute_s(FAST, TRAIN, uneven, 1) > predicted_compute_s(FAST, TRAIN, even, 1)


def progress(epoch: int, step: int, compute_s: float, halted: bool = False) -> ProgressRecord:
    return ProgressRecord(epoch, step, None, compute_s * 2, halted=halted, compute_s=compute_s)


def test_a_peer_far_slower_than_its_claim_is_planned_at_the_speed_it_showed_and_gets_its_claim_back():
    p = plan()
    records = {peer: record() for peer in PEERS}
    predicted = predicted_compute_s(FAST, TRAIN, p, 1)
    watch = ComputeWatch(tolerance=4.0, min_steps=3)
    slow, noisy, brief = PEERS[1], PEERS[3], PEERS[0]  # 10x, 3x (tolerated), and one step seen only
    for step in (1, 2, 3, 4):
        watch.observe(p, {slow: progress(2, step, 10 * predicted), noisy: progress(2, step, 3 * predicted),
                          PEERS[2]: progress(2, step, 0.0)})
    watch.observe(p, {brief: progress(2, 5, 50.0), slow: progress(2, 5, 0.0, halted=True)})
    [judged] = watch.judge(p, records, TRAIN)
    assert (judged.peer, judged.epoch) == (slow, 2) and judged.factor == pytest.approx(10.0)
    assert judged.observed_s == pytest.approx(10 * predicted) and judged.predicted_s == pytest.approx(predicted)
    assert watch.judge(p, records, TRAIN) == []  # once per epoch
    assert watch.slowdowns_of(PEERS) == {slow: pytest.approx(10.0)}
    slowed = with_slowdowns(records, watch.slowdowns_of(PEERS))[slow]
    assert slowed.compute.layer_s == pytest.approx((0.2, 0.4)) and slowed.tflops == pytest.approx(1.0)
    # the next epoch it computes as it claimed (its card was shared for a while): its claim counts again
    later = dataclasses.replace(p, epoch=3)
    for step in (5, 6, 7):
        watch.observe(later, {slow: progress(3, step, predicted)})
    [back] = watch.judge(later, records, TRAIN)
    assert back.peer == slow and back.factor == 1.0 and watch.slowdowns_of(PEERS) == {}


def test_a_plan_made_with_slowdowns_passes_its_followers_check():
    # PEERS[1] claims FAST but showed 8x slower: the leader plans it so, and says so in the plan record
    records = {peer: record() for peer in PEERS}
    rows = {a: LinksRecord.from_peers({b: LinkMeasurement(5.0, 1.0) for b in PEERS if b != a}) for a in PEERS}

    def workload_for(cluster, trainers, peers, train=None):
        return layered_workload([peers[p].compute for p in trainers], run_workload(TRAIN, 2, 2), TRAIN, 2)

    leader_view = with_slowdowns(records, {PEERS[1]: 8.0})
    cluster = build_cluster(PEERS, leader_view, rows, EmulationSettings())
    planned = make_plan(cluster, workload_for(cluster, PEERS, leader_view), 2, SIMULATED)
    published = dataclasses.replace(PlanRecord.from_plan_json(0, PEERS, planned), slowdowns=((1, 8.0),))
    published = PlanRecord.decode(published.encode())
    assert plan_slowdowns(published) == {PEERS[1]: 8.0}
    follower_view = with_slowdowns(records, plan_slowdowns(published))
    check = cost_check(published, follower_view, rows, TRAIN, SIMULATED, EmulationSettings(), workload_for, 0.1)
    assert check.problem is None and check.theirs_s == pytest.approx(planned["cost_s"])
