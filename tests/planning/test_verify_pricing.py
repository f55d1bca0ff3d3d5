"""The recompute check (``verify.recompute_check``) in the simulated objective: its share of each device's compute
and its reveals' bytes (``StepProfile.recompute_rate``), hand-computed on toy networks; where the runtime does
not install it, nothing changes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.planning import Cluster, Device, make_objective
from p2ptrain.planning.simulated import StepProfile, StepWorkload

from .test_simulated import _random_instance

RATE = 1 / 8  # ``verify.commit.DEFAULT_RATE``
SIGMA = np.array([[0, 1], [2, 3]])  # 2 stages × 2 replicas: groups {0, 2} and {1, 3}


def _cluster(n, latency_ms, bandwidth_gbps, uplink_gbps=None):
    off = 1 - np.eye(n)
    bandwidth = bandwidth_gbps * off + np.eye(n) if np.isscalar(bandwidth_gbps) else bandwidth_gbps
    uplink = None if uplink_gbps is None else [uplink_gbps] * n
    return Cluster(tuple(Device(f"d{i}") for i in range(n)), latency_ms * off, bandwidth, uplink)


def _objective(cluster, activation_gb=0.0, stages=2, **profile):
    return make_objective("simulated", cluster, StepWorkload(activation_gb, 0.0, step=StepProfile(**profile)), stages)


def test_on_fast_links_the_check_costs_its_share_of_the_compute():
    # no bytes, no latency: a step is compute alone, every forward and backward 1 + 1/8 times as long, so is
    # the step, in the simulation and in the closed form
    cluster = _cluster(4, 0.0, 1000.0)
    profile = dict(micro_batches=8, forward_s=(0.1, 0.15), backward_s=(0.2, 0.3))
    plain, checked = _objective(cluster, **profile), _objective(cluster, **profile, recompute_rate=RATE)
    assert checked.simulate(SIGMA).predicted_s == pytest.approx(plain.simulate(SIGMA).predicted_s * 9 / 8, rel=1e-9)
    # stage 0's first forward, stage 1's 8 forwards and 8 backwards, stage 0's last backward
    assert plain.simulate(SIGMA).predicted_s == pytest.approx(0.1 + 8 * (0.15 + 0.3) + 0.2, rel=1e-9)
    groups, hops = [checked.group_terms(SIGMA[:, j]).max() for j in range(2)], [0.0]
    bare = [plain.group_terms(SIGMA[:, j]).max() for j in range(2)]
    assert checked.combine(groups, hops).cost_s == pytest.approx(plain.combine(bare, hops).cost_s * 9 / 8, rel=1e-9)
    # utilisation counts the training compute only
    assert checked.compute_s(SIGMA) == plain.compute_s(SIGMA)


def test_behind_uplinks_the_reveal_goes_ahead_of_the_steps_sends():
    # α = 10 ms, 8 Gbit/s uplinks (1 s a GB) on fast pair links, one micro-batch of 0.1 GB each way, no compute,
    # nothing to reduce. Without the check: activation 0 → 0.11, gradient back 0.11 → 0.22, the 0-GB shards
    # of stage 1 behind it on its uplink (all-gather in at 0.23), stage 0's at 0.24: a step of 0.24.
    # With rate 1/8 every member first reveals ⌈1/8 × 1⌉ = 1 micro-batch's (0.1 + 0.1) GB, 0.2 s on its uplink (a
    # step waits for its slowest pipeline: priced as if each member were challenged): the activation leaves at
    # 0.2, every later time moves by as much: 0.44, each step alike
    cluster = _cluster(4, 10.0, 80.0, uplink_gbps=8.0)
    plain = _objective(cluster, 0.1)
    checked = _objective(cluster, 0.1, recompute_rate=RATE)
    assert plain.simulate(SIGMA).step_s == pytest.approx((0.24,) * 4, rel=1e-9)
    assert checked.simulate(SIGMA).step_s == pytest.approx((0.44,) * 4, rel=1e-9)
    assert checked.simulate(SIGMA).predicted_s - plain.simulate(SIGMA).predicted_s == pytest.approx(0.2, rel=1e-9)
    # the closed form charges each member's reveal sent and received, alone on their paths: 2 × 0.2 more
    hops = [float(plain.hop_link_s[0, 1])]
    bare = plain.combine([plain.group_terms(SIGMA[:, j]).max() for j in range(2)], hops).cost_s
    priced = checked.combine([checked.group_terms(SIGMA[:, j]).max() for j in range(2)], hops).cost_s
    assert priced - bare == pytest.approx(0.4, rel=1e-9)
    assert priced >= checked.simulate(SIGMA).predicted_s


def test_a_reveal_on_the_pair_delays_the_all_reduce_only_while_in_flight():
    # no access links: a reveal of ⌈1/8⌉ × 0.2 GB at 8 Gbit/s is off the pair 0 ↔ 2 at 0.2, before the
    # all-reduce (0.22): the step is the same. At rate 1 over a 0.8 Gbit/s pair (10 s a GB), the 0.2 GB reveal
    # holds it to 2.0: stage 0's shards arrive at 2.01, the sums at 2.02, the next step starts there
    plain = _objective(_cluster(4, 10.0, 8.0), 0.1)
    quick = _objective(_cluster(4, 10.0, 8.0), 0.1, recompute_rate=RATE)
    assert quick.simulate(SIGMA).step_s == plain.simulate(SIGMA).step_s
    assert plain.simulate(SIGMA).predicted_s == pytest.approx(0.24, rel=1e-9)
    bandwidth = 8.0 * (1 - np.eye(4)) + np.eye(4)
    bandwidth[0, 2] = bandwidth[2, 0] = 0.8
    slow = _objective(_cluster(4, 10.0, bandwidth), 0.1, recompute_rate=1.0)
    assert slow.simulate(SIGMA).step_s == pytest.approx((2.02,) * 4, rel=1e-9)


def test_a_middle_stage_reveals_the_messages_of_both_sides():
    # 3 stages × 3 replicas, 2 micro-batches of 0.1 GB each way: at rate 1/8 a member reveals ⌈1/8 × 2⌉ = 1
    # micro-batch's (0.1 + 0.1) GB per neighbour, a middle stage twice that. Behind 8 Gbit/s uplinks stage 0's
    # 0.2 s reveal goes ahead of its first activation, so the first step is at least that much longer
    cluster = _cluster(9, 10.0, 80.0, uplink_gbps=8.0)
    sigma = np.arange(9).reshape(3, 3)
    plain = _objective(cluster, 0.2, stages=3, micro_batches=2)
    checked = _objective(cluster, 0.2, stages=3, micro_batches=2, recompute_rate=RATE)
    assert checked.reveal_gb == pytest.approx((0.2, 0.4, 0.2), rel=1e-12)
    assert checked.simulate(sigma).step_s[0] - plain.simulate(sigma).step_s[0] >= 0.2 - 1e-9
    assert checked.simulate(sigma).predicted_s > plain.simulate(sigma).predicted_s


def test_where_the_runtime_installs_no_check_nothing_changes():
    # bitwise: one stage, one replica, DiLoCo, or a rate of 0 price as the profile without the field
    rng = np.random.default_rng(7)
    for trial in range(30):
        cluster, workload, stages, sigma = _random_instance(rng, symmetric=trial % 2 == 0)
        base = make_objective("simulated", cluster, workload, stages)
        zero = dataclasses.replace(workload, step=dataclasses.replace(workload.step, recompute_rate=0.0))
        assert make_objective("simulated", cluster, zero, stages).simulate(sigma).step_s == base.simulate(sigma).step_s
        if stages == 1 or len(sigma) == 1:
            rated = dataclasses.replace(workload, step=dataclasses.replace(workload.step, recompute_rate=0.5))
            assert make_objective("simulated", cluster, rated, stages).simulate(sigma).step_s == \
                base.simulate(sigma).step_s, trial
    cluster = _cluster(4, 10.0, 8.0)
    diloco = dict(micro_batches=2, forward_s=(0.1, 0.1), backward_s=(0.2, 0.2), sync_every=4)
    assert _objective(cluster, 0.1, **diloco, recompute_rate=0.5).simulate(SIGMA) == \
        _objective(cluster, 0.1, **diloco).simulate(SIGMA)


@pytest.mark.parametrize("rate", [-0.1, float("nan"), 1.5, float("inf"), True, "0.1"])
def test_the_profile_refuses_a_rate_outside_0_to_1(rate):
    with pytest.raises(ValueError, match="recompute_rate"):
        StepProfile(recompute_rate=rate)
