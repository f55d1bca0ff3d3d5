import numpy as np
import pytest

from p2ptrain.planning import (
    PAPER_REFERENCE,
    PAPER_WORKLOAD,
    SCENARIOS,
    Cluster,
    Device,
    DtfmObjective,
    Workload,
    megatron_assignment,
    scenario,
)


@pytest.mark.parametrize("name", SCENARIOS)
def test_megatron_order_reproduces_the_paper(name):
    obj = DtfmObjective(scenario(name), PAPER_WORKLOAD, 8)
    assert round(obj.evaluate(megatron_assignment(64, 8)).cost_s, 3) == PAPER_REFERENCE[name]["megatron_s"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_gcma_layout_reproduces_the_paper(name):
    # GCMA's layout: pipeline p = devices 8p … 8p+7 (in spot, every layout it tried costs the same)
    obj = DtfmObjective(scenario(name), PAPER_WORKLOAD, 8)
    assert round(obj.evaluate(np.arange(64).reshape(8, 8)).cost_s, 3) == PAPER_REFERENCE[name]["gcma_s"]


def _cluster(latency_ms, bandwidth_gbps):
    lat, bw = np.array(latency_ms, float), np.array(bandwidth_gbps, float)
    return Cluster(tuple(Device(f"d{i}") for i in range(len(lat))), lat, bw)


def test_two_stages_by_hand():
    # 2 devices, 2 stages, 1 replica: no all-reduce; one hop of 2·(α + 8·c_PP/β) = 2·(0.010 + 8·0.5/2) = 4.02
    c = _cluster([[0, 10], [10, 0]], [[0, 2], [2, 0]])
    cost = DtfmObjective(c, Workload(activation_gb=0.5, gradient_gb=1.0), 2).evaluate([[0, 1]])
    assert (cost.cost_s, cost.data_parallel_s, cost.pipeline_s) == pytest.approx((4.02, 0.0, 4.02))


def test_four_devices_by_hand():
    # devices 0,1 in region A, 2,3 in region B. A–A, B–B: 1 ms, 10 Gbit/s; A–B: 20 ms, 1 Gbit/s.
    same = [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    lat = [[20.0 if s else 1.0 for s in row] for row in same]
    bw = [[1.0 if s else 10.0 for s in row] for row in same]
    obj = DtfmObjective(_cluster(lat, bw), Workload(activation_gb=0.25, gradient_gb=1.0), 2)
    # pipelines inside regions: [[0, 1], [2, 3]]. Hops: 2·(0.001 + 8·0.25/10) = 0.402.
    # groups {0, 2}, {1, 3}: each device exchanges one 1/2 shard across: 2·(0.020 + 8·1.0/2/1) = 8.04
    cost = obj.evaluate([[0, 1], [2, 3]])
    assert (cost.data_parallel_s, cost.pipeline_s) == pytest.approx((8.04, 0.402))
    # groups inside regions: [[0, 2], [1, 3]]: DP 2·(0.001 + 0.4) = 0.802; hop 2·(0.020 + 2.0) = 4.04
    cost = obj.evaluate([[0, 2], [1, 3]])
    assert (cost.data_parallel_s, cost.pipeline_s) == pytest.approx((0.802, 4.04))


def test_data_parallel_sums_over_peers_and_takes_the_slowest_device():
    # one stage, 3 replicas: device 0 talks to 1 (1 ms, 8 Gbit/s) and 2 (1 ms, 1 Gbit/s); 1–2 fast.
    lat = [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    bw = [[0, 8, 1], [8, 0, 8], [1, 8, 0]]
    cost = DtfmObjective(_cluster(lat, bw), Workload(0.0, 0.3), 1).evaluate([[0], [1], [2]])
    # shard 0.1 GB = 0.8 Gbit. device 0: 2·(0.001 + 0.1) + 2·(0.001 + 0.8) = 1.804 (the slowest)
    assert cost.data_parallel_s == pytest.approx(1.804)


def test_asymmetric_links_are_charged_both_ways():
    c = _cluster([[0, 10], [30, 0]], [[0, 4], [1, 0]])
    cost = DtfmObjective(c, Workload(activation_gb=0.5, gradient_gb=0.0), 2).evaluate([[0, 1]])
    assert cost.pipeline_s == pytest.approx((0.010 + 4 / 4) + (0.030 + 4 / 1))


def test_assignments_are_checked():
    obj = DtfmObjective(scenario("worldwide", 8), PAPER_WORKLOAD, 4)
    with pytest.raises(ValueError, match="shape"):
        obj.evaluate(np.arange(8).reshape(4, 2))
    with pytest.raises(ValueError, match="exactly once"):
        obj.evaluate(np.zeros((2, 4), dtype=int))
    with pytest.raises(ValueError, match="cannot be split"):
        DtfmObjective(scenario("worldwide", 8), PAPER_WORKLOAD, 3)
