"""The leader's pure parts: who trains, the cluster from records, the workload, plans by strategy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.agent.config import EmulationSettings, MembershipConfig, PlanConfig
from p2ptrain.agent.leadership.membership import Membership, MembershipTracker, plan_trigger
from p2ptrain.agent.leadership.plan_maker import (
    LINKS_ALL_UP_TO,
    build_cluster,
    cluster_order,
    link_gaps,
    links_enough,
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
    # only the pairs of the probe graph are waited for (``probe_set``): the other links are estimated
    partners = {PEERS[0]: {PEERS[2]}, PEERS[3]: {PEERS[0]}}
    assert link_gaps(PEERS, rows, partners) == [(PEERS[3], PEERS[0])]


def test_a_large_runs_first_plan_goes_without_its_last_tenth_of_partner_links():
    trainers = [f"peer{i:02d}" for i in range(LINKS_ALL_UP_TO + 1)]
    ring = {a: {trainers[(i + d) % len(trainers)] for d in (1, 2, -1, -2)} for i, a in enumerate(trainers)}
    wanted = [(a, b) for a in trainers for b in sorted(ring[a])]  # 68 directed partner links
    assert links_enough([], trainers, ring, 0.1) and not links_enough(wanted[:1], trainers[:-1], ring, 0.1)
    assert links_enough(wanted[:6], trainers, ring, 0.1) and not links_enough(wanted[:7], trainers, ring, 0.1)
    assert not links_enough(wanted[:1], trainers, ring, 0.0)  # 0: every link, as a small run


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


def two_sites(peers, liar=None, claim=(4.1, 4.9)):
    """Two sites of len(peers) // 2: 1 ms and 10 Gbit/s inside, 40 ms and 0.5 Gbit/s across; ``liar``'s own
    row claims ``claim`` (ms, Gbit/s) to everyone."""
    half = len(peers) // 2
    lat = [[0.0 if i == j else 1.0 if (i < half) == (j < half) else 40.0 for j in range(len(peers))]
           for i in range(len(peers))]
    bw = [[0.0 if i == j else 10.0 if (i < half) == (j < half) else 0.5 for j in range(len(peers))]
          for i in range(len(peers))]
    if liar is not None:
        lat[liar] = [0.0 if j == liar else claim[0] for j in range(len(peers))]
        bw[liar] = [claim[1]] * len(peers)
    return lat, bw


def test_a_link_nobody_measured_is_estimated_from_its_groups_and_never_taken_for_a_measured_one():
    peers = sorted(generate_identity().peer_id for _ in range(8))
    records = {p: record() for p in peers}
    unmeasured = [(0, 5), (1, 2), (6, 2)]  # across, inside, across
    skip = {(peers[i], peers[j]) for a, b in unmeasured for i, j in ((a, b), (b, a))}
    lat, bw = two_sites(peers)
    cluster = build_cluster(peers, records, rows_from(lat, bw, peers, skip), EmulationSettings())
    assert cluster.groups.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # the sites, found from the links measured
    assert np.array_equal(cluster.latency_ms, np.array(lat)) and np.array_equal(cluster.bandwidth_gbps, np.array(bw))
    full = build_cluster(peers, records, rows_from(lat, bw, peers), EmulationSettings())
    assert full.groups is None  # nothing estimated: the search finds the structure itself
    # a liar claiming fast links to everyone (under the 10x at which a link is disputed) moves the links its
    # own row names (the mean of both ends'), not the estimate of the links nobody measured, not the sites
    lat, bw = two_sites(peers, liar=7)
    lied = build_cluster(peers, records, rows_from(lat, bw, peers, skip), EmulationSettings())
    assert lied.groups.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]  # its claims set it apart (the worse of both ends)
    for a, b in unmeasured:
        assert lied.latency_ms[a, b] == cluster.latency_ms[a, b] and lied.bandwidth_gbps[a, b] == cluster.bandwidth_gbps[a, b]
    assert lied.latency_ms[7, 0] == pytest.approx((40.0 + 4.1) / 2)  # measured by both: the mean, as before
    # a link one end measured is never better than the best both ends measured; estimated ones are not
    # "measured by both" for that rule (the rule would otherwise let an estimate clamp a measured link)
    one_sided = rows_from(*two_sites(peers), peers, skip | {(peers[3], peers[4])})
    clamp = build_cluster(peers, records, one_sided, EmulationSettings())
    assert clamp.latency_ms[3, 4] == 40.0 and clamp.bandwidth_gbps[3, 4] == 0.5


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


def test_a_peers_labels_are_its_region_and_host_and_an_emulated_device_s_site(tmp_path):
    from p2ptrain.agent.leadership import probe_set

    on = lambda *maddrs, **kw: dataclasses.replace(record(**kw), maddrs=maddrs)  # noqa: E731
    peers = {"a": on("/ip4/10.0.0.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001", region="eu"),
             "b": on("/ip4/10.0.0.5/tcp/4002"),
             "c": on("/ip4/127.0.0.1/tcp/4003", f"/ip4/1.2.3.4/tcp/1/p2p/{PEERS[0]}/p2p-circuit")}
    assert probe_set.labels(peers, EmulationSettings()) == {
        "a": ("region:eu", "host:10.0.0.5"), "b": ("host:10.0.0.5",), "c": ()}  # loopback and circuits: no host
    network = scenario("datacenter", 16)  # two instances of eight
    path = tmp_path / "dc.json"
    path.write_text(__import__("json").dumps(network.to_dict()))
    emulated = EmulationSettings(cluster_file=str(path), device_index=0)
    sites = probe_set.labels({f"p{k}": record(k, network.devices[k].region) for k in (0, 7, 8)}, emulated)
    assert sites["p0"][-1] == sites["p7"][-1] != sites["p8"][-1]  # the same instance, another one
