"""Whom each peer measures (the probe graph) and the links estimated from what was measured."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.planning import link_clusters, perturbed, scenario
from p2ptrain.planning.estimated import estimate_links, plan_pairs, probe_graph, probe_partners, twin_groups

NETWORKS = ("datacenter", "spot", "multi_dc", "regional", "worldwide")


def names(n: int) -> list[str]:
    return [f"peer-{k:04d}" for k in range(n)]


def mask_of(graph: dict[str, frozenset[str]], order: list[str]) -> np.ndarray:
    index = {p: k for k, p in enumerate(order)}
    mask = np.zeros((len(order), len(order)), dtype=bool)
    for p, partners in graph.items():
        for q in partners:
            mask[index[p], index[q]] = True
    return mask


@pytest.mark.parametrize("n", [9, 64, 256, 1000])
def test_the_probe_graph_is_symmetric_bounded_and_the_same_for_everyone(n):
    peers = names(n)
    graph = probe_graph(peers, 8, "run-a")
    assert all(p in graph[q] for p in peers for q in graph[p])  # both ends measure each pair
    degrees = [len(graph[p]) for p in peers]
    if n <= 9:  # a run of at most partners + 1 peers measures every pair
        assert degrees == [n - 1] * n
    else:
        # as many partners each (two on each of 4 rings, fewer where rings coincide): the link phase lasts as long
        # as the busiest member's measurements
        assert min(degrees) >= 4 and max(degrees) <= 8 and np.mean(degrees) >= 6, (min(degrees), max(degrees))
    assert probe_graph(list(reversed(peers)), 8, "run-a") == graph  # order of the listing does not matter
    assert probe_partners(peers[0], peers[1:], 8, "run-a") == graph[peers[0]]
    if n > 9:
        assert probe_graph(peers, 8, "run-b") != graph  # each run draws its own ring
        # connected: every region and instance is a few measured hops from every other
        seen, frontier = {peers[0]}, [peers[0]]
        while frontier:
            frontier = [q for p in frontier for q in graph[p] if q not in seen and not seen.add(q)]
        assert len(seen) == n


def test_a_join_moves_few_pairs_of_the_probe_graph():
    peers = names(200)
    before = {frozenset((p, q)) for p, qs in probe_graph(peers, 8, "run").items() for q in qs}
    after = {frozenset((p, q)) for p, qs in probe_graph(peers + ["newcomer"], 8, "run").items() for q in qs}
    # the newcomer sits between two neighbours on each of the 4 rings: their pair goes, two of its own come
    assert len(before - after) <= 4 and len(after - before) <= 8, (len(before - after), len(after - before))


def test_peers_sharing_a_place_measure_each_other_when_the_place_is_small():
    peers = names(64)
    labels = {p: (f"host:{k // 8}", "region:eu" if k < 32 else "region:us") for k, p in enumerate(peers)}
    graph = probe_graph(peers, 8, "run", labels, near=8)
    for k, p in enumerate(peers):
        host = {q for j, q in enumerate(peers) if j // 8 == k // 8 and q != p}
        assert host <= graph[p]  # 8 on a host: all of them
        region = {q for q in graph[p] if (peers.index(q) < 32) == (k < 32)} - host
        assert len(region) >= 3  # 32 in a region: some of them, beyond the host


def site_labels(cluster) -> dict[str, tuple[str, ...]]:
    """What the devices of a network would say of themselves: their site (instance or region)."""
    sites = link_clusters(cluster)
    return {d.name: (f"site:{sites[k]}",) for k, d in enumerate(cluster.devices)}


@pytest.mark.parametrize("name", NETWORKS)
def test_the_paper_networks_are_estimated_exactly_from_their_probe_graph(name):
    truth = scenario(name, 64)
    order = [d.name for d in truth.devices]
    measured = mask_of(probe_graph(order, 8, "run", site_labels(truth)), order)
    assert measured.sum() < 0.4 * 64 * 63  # at most 40 % of the pairs (a full matrix is 4,032 measurements)
    estimate = estimate_links(truth.latency_ms, truth.bandwidth_gbps, measured)
    assert np.array_equal(estimate.latency_ms, truth.latency_ms)
    assert np.array_equal(estimate.bandwidth_gbps, truth.bandwidth_gbps)
    assert np.array_equal(link_clusters(dataclasses.replace(truth, groups=estimate.groups)), link_clusters(truth))
    assert estimate.estimated_pairs == int((~measured[np.triu_indices(64, 1)]).sum())
    # the values given for the unmeasured pairs play no part
    garbage = np.where(measured, truth.latency_ms, 1e6)
    assert np.array_equal(estimate_links(garbage, truth.bandwidth_gbps, measured).latency_ms, truth.latency_ms)


def test_noisy_links_are_estimated_within_their_noise_and_measured_ones_kept():
    truth, _ = perturbed(scenario("worldwide", 64), 0.1, np.random.default_rng(3))
    order = [d.name for d in truth.devices]
    measured = mask_of(probe_graph(order, 8, "run", site_labels(truth)), order)
    estimate = estimate_links(truth.latency_ms, truth.bandwidth_gbps, measured)
    assert np.array_equal(estimate.latency_ms[measured], truth.latency_ms[measured])  # measured: as measured
    off = ~np.eye(64, dtype=bool)
    ratio = estimate.bandwidth_gbps[off] / truth.bandwidth_gbps[off]
    assert (ratio > 1 / 1.25).all() and (ratio < 1.25).all()  # ±10 % on both the estimate and the link
    assert len(np.unique(estimate.groups)) == 8


def test_a_peer_that_measured_no_group_mate_is_not_joined_to_a_group_by_its_one_link():
    # two sites of four, 0 ms inside; peer 0 measured only peer 5, across: it stays a group of its own
    lat = np.array([[0.0 if (i < 4) == (j < 4) else 30.0 for j in range(8)] for i in range(8)])
    bw = np.array([[10.0 if (i < 4) == (j < 4) else 1.0 for j in range(8)] for i in range(8)])
    measured = np.ones((8, 8), dtype=bool)
    measured[0, :] = measured[:, 0] = False
    measured[0, 5] = measured[5, 0] = True
    groups = twin_groups(lat, bw, measured)
    assert groups.tolist() == [0, 1, 1, 1, 2, 2, 2, 2]


def test_plan_pairs_are_neighbouring_stages_and_each_stage_s_group():
    pairs = plan_pairs([["a", "b", "c"], ["d", "e", "f"]])
    assert pairs == {frozenset(x) for x in ("ab", "bc", "de", "ef", "ad", "be", "cf")}
