"""The leader's pure parts: who trains, the cluster from records, the workload, plans by strategy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.agent.config import EmulationSettings, MembershipConfig, PlanConfig
from p2ptrain.agent.leadership.membership import Membership, MembershipTracker, plan_trigger
from p2ptrain.agent.leadership.plan_maker import (
    build_cluster,
    cluster_order,
    link_gaps,
    make_plan,
    replicas_for,
    run_workload,
    trainers_and_spares,
)
from p2ptrain.net.dht.records import LinkMeasurement, LinksRecord, PeerRecord, PlanRecord, RecordError
from p2ptrain.net.identity import generate_identity
from p2ptrain.planning import PAPER_WORKLOAD, make_objective, scenario, schedule
from p2ptrain.runtime.config import TrainConfig

PEERS = sorted(generate_identity().peer_id for _ in range(4))


def record(device: int | None = None, region: str = "") -> PeerRecord:
    return PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, region=region, emulated_device=device)


def rows_from(latency_ms, bandwidth_gbps, peers=PEERS, skip=()) -> dict[str, LinksRecord]:
    return {
        a: LinksRecord.from_peers({b: LinkMeasurement(latency_ms[i][j], bandwidth_gbps[i][j])
                                   for j, b in enumerate(peers) if b != a and (a, b) not in skip})
        for i, a in enumerate(peers)
    }


def test_cluster_order_follows_emulated_devices_when_every_peer_plays_one():
    peers = {p: record(device=3 - k) for k, p in enumerate(PEERS)}
    assert cluster_order(peers) == PEERS[::-1]
    peers[PEERS[0]] = record()
    assert cluster_order(peers) == PEERS


def test_replicas_and_spares_follow_stages_and_the_batch_split():
    train = TrainConfig(stages=2, global_batch_size=16, micro_batches=2)
    assert replicas_for(4, train) == 2 and replicas_for(5, train) == 2 and replicas_for(1, train) == 0
    assert replicas_for(7, TrainConfig(stages=2, global_batch_size=12, micro_batches=2)) == 3
    assert replicas_for(8, TrainConfig(stages=2, global_batch_size=12, micro_batches=2)) == 3  # 4 x 2 does not split 12
    assert trainers_and_spares(["a", "b", "c", "d", "e"], train) == (["a", "b", "c", "d"], ["e"])
    with pytest.raises(ValueError, match="cannot train 2 stages"):
        trainers_and_spares(["a"], train)


def test_link_gaps_name_the_directed_links_not_yet_measured():
    lat = [[0, 1, 1, 1]] * 4
    bw = [[1, 1, 1, 1]] * 4
    rows = rows_from(lat, bw, skip={(PEERS[0], PEERS[1])})
    del rows[PEERS[3]]
    gaps = link_gaps(PEERS, rows)
    assert (PEERS[0], PEERS[1]) in gaps and {(PEERS[3], b) for b in PEERS[:3]} <= set(gaps) and len(gaps) == 4


def test_cluster_symmetrises_and_converts_emulated_measurements_back():
    lat = np.array([[0, 10, 20, 30], [12, 0, 5, 5], [20, 5, 0, 5], [30, 5, 5, 0]], dtype=float)
    bw = np.array([[1, 2, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=float) * 0.5
    peers = {p: record(k, f"r{k}") for k, p in enumerate(PEERS)}
    cluster = build_cluster(PEERS, peers, rows_from(lat, bw), EmulationSettings())
    assert cluster.latency_ms[0, 1] == cluster.latency_ms[1, 0] == pytest.approx(11.0)  # mean of both ways
    assert cluster.bandwidth_gbps[0, 1] == pytest.approx(2 / (1 / 1.0 + 1 / 0.5), rel=1e-6)  # harmonic mean
    assert [d.name for d in cluster.devices] == PEERS and cluster.devices[2].region == "r2"
    emulated = EmulationSettings(cluster_file="x.json", device_index=0, time_scale=0.1, size_factor=0.01)
    scaled = build_cluster(PEERS, peers, rows_from(lat, bw), emulated)
    assert scaled.latency_ms[0, 2] == pytest.approx(200.0)  # α = α' / time scale
    assert scaled.bandwidth_gbps[0, 2] == pytest.approx(0.5 * 0.1 / 0.01, rel=1e-6)  # β = β' · scale / size


def test_the_access_links_peers_publish_are_the_clusters_in_the_networks_units():
    lat = [[0, 10, 20, 30], [10, 0, 5, 5], [20, 5, 0, 5], [30, 5, 5, 0]]
    bw = [[1] * 4] * 4
    peers = {p: dataclasses.replace(record(k), uplink_gbps=0.05 if k < 2 else None, downlink_gbps=0.1 if k else None)
             for k, p in enumerate(PEERS)}
    assert all(PeerRecord.decode(r.encode()) == r for r in peers.values())  # the fields travel, absent or not
    cluster = build_cluster(PEERS, peers, rows_from(lat, bw), EmulationSettings())
    assert cluster.uplink_gbps.tolist() == [0.05, 0.05, float("inf"), float("inf")]
    assert cluster.downlink_gbps.tolist() == [float("inf"), 0.1, 0.1, 0.1]
    emulated = EmulationSettings(cluster_file="x.json", device_index=0, time_scale=0.1, size_factor=0.01)
    scaled = build_cluster(PEERS, peers, rows_from(lat, bw), emulated)
    assert scaled.uplink_gbps[0] == pytest.approx(0.05 * 0.1 / 0.01)  # as β: U = U' · scale / size
    assert not build_cluster(PEERS, {p: record() for p in PEERS}, rows_from(lat, bw), emulated).has_access_links
    # probes cross the same shared lines: a path measured below both ends' lines is taken at the slower line
    slow = build_cluster(PEERS, peers, rows_from(lat, [[0.01] * 4] * 4), EmulationSettings()).bandwidth_gbps
    assert slow[0, 1] == pytest.approx(0.05) and slow[1, 2] == pytest.approx(0.05)
    assert slow[2, 1] == pytest.approx(0.01) and slow[1, 0] == pytest.approx(0.01)  # no uplink of 2, downlink of 0
    # a forged record claiming an absurd or negative line is refused before anybody plans with it
    for bad in (-1.0, float("nan"), 1e12):
        with pytest.raises(RecordError, match="uplink_gbps"):
            dataclasses.replace(record(0), uplink_gbps=bad)


def test_a_link_nobody_measured_gets_the_worst_measured_one():
    lat = [[0, 10, 20, 30], [10, 0, 5, 5], [20, 5, 0, 5], [30, 5, 5, 0]]
    bw = [[1, 2, 0.5, 1], [2, 1, 1, 1], [0.5, 1, 1, 1], [1, 1, 1, 1]]
    skip = {(PEERS[0], PEERS[3]), (PEERS[3], PEERS[0])}
    cluster = build_cluster(PEERS, {p: record() for p in PEERS}, rows_from(lat, bw, skip=skip), EmulationSettings())
    assert cluster.latency_ms[0, 3] == pytest.approx(20.0) and cluster.bandwidth_gbps[0, 3] == pytest.approx(0.5)


def test_run_workload_is_this_runs_bytes_over_the_size_factor():
    train = TrainConfig(global_batch_size=16, stages=2)
    own = run_workload(train, 2, 2)
    assert own.activation_gb == pytest.approx(8 * 64 * 64 * 4 / 1e9)  # (B/D) sequences × T × h × fp32
    assert run_workload(train, 2, 2, size_factor=0.5).gradient_gb == pytest.approx(2 * own.gradient_gb)


def test_plans_by_strategy_are_full_assignments_with_their_costs():
    cluster = scenario("worldwide", 8)
    scheduled = make_plan(cluster, PAPER_WORKLOAD, 2, PlanConfig())
    assert scheduled["cost_s"] == pytest.approx(schedule(cluster, PAPER_WORKLOAD, 2).cost.cost_s)
    megatron = make_plan(cluster, PAPER_WORKLOAD, 2, PlanConfig(strategy="megatron"))
    assert megatron["pipelines"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert megatron["cost_s"] == pytest.approx(megatron["baselines"]["megatron"]["cost_s"])
    random = make_plan(cluster, PAPER_WORKLOAD, 2, PlanConfig(strategy="random", seed=3))
    objective = make_objective("dtfm", cluster, PAPER_WORKLOAD, 2)
    for plan in (scheduled, megatron, random):
        assert sorted(d for row in plan["pipelines"] for d in row) == list(range(8))
        assert plan["cost_s"] == pytest.approx(objective.evaluate(np.array(plan["pipelines"])).cost_s)
    assert scheduled["cost_s"] < megatron["cost_s"]
    devices = [generate_identity().peer_id for _ in range(8)]  # device i of the plan is peer devices[i]
    plan_record = PlanRecord.from_plan_json(0, devices, scheduled)
    assert [[plan_record.peer_at(i, j) for j in range(2)] for i in range(4)] == [
        [devices[d] for d in row] for row in scheduled["pipelines"]
    ]


def test_plan_trigger_waits_for_the_expected_peers_or_the_deadline():
    view = Membership({p: record() for p in PEERS[:3]})
    assert plan_trigger(view, MembershipConfig(expect=4), 999.0) is None
    assert "3 of 3 expected" in plan_trigger(view, MembershipConfig(expect=3), 0.0)
    deadline = MembershipConfig(join_deadline_s=60.0, min_peers=3)
    assert plan_trigger(view, deadline, 59.0) is None
    assert "join deadline" in plan_trigger(view, deadline, 61.0)
    assert plan_trigger(view, MembershipConfig(join_deadline_s=60.0, min_peers=4), 61.0) is None


def test_membership_tracks_joins_leaves_and_incompatible_peers():
    now = [0.0]
    tracker = MembershipTracker(PEERS[0], clock=lambda: now[0])
    view = tracker.update({p: record() for p in PEERS[:2]})
    assert view.ids == tuple(PEERS[:2]) and view.leader == PEERS[0]
    now[0] = 5.0
    old = PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, protocol_version=99)
    view = tracker.update({PEERS[1]: record(), PEERS[2]: record(), PEERS[3]: old})
    assert view.ids == (PEERS[1], PEERS[2]) and view.leader == PEERS[1]  # the old leader left, 3 speaks another protocol
    assert tracker.known_for_s(PEERS[1]) == 5.0 and tracker.known_for_s(PEERS[2]) == 0.0
