"""The simulated objective: hand-computed steps, the brute-force event simulation, monotonicity, the planner."""

import numpy as np
import pytest

from p2ptrain.planning import Cluster, Device, make_objective, megatron_assignment, scenario, schedule
from p2ptrain.planning.cost import check_assignment
from p2ptrain.planning.simulated import StepProfile, StepWorkload

from .event_sim import event_simulation


def _cluster(latency_ms, bandwidth_gbps, tflops=None):
    latency, bandwidth = np.array(latency_ms, dtype=float), np.array(bandwidth_gbps, dtype=float)
    n = len(latency)
    devices = tuple(Device(f"d{i}", tflops=None if tflops is None else tflops[i]) for i in range(n))
    return Cluster(devices, latency, bandwidth)


def _uniform(n, latency_ms, bandwidth_gbps, tflops=None):
    off = 1 - np.eye(n)
    return _cluster(latency_ms * off, bandwidth_gbps * off + np.eye(n), tflops)


def _objective(cluster, stages, activation_gb=0.0, gradient_gb=0.0, **profile):
    workload = StepWorkload(activation_gb, gradient_gb, step=StepProfile(**profile))
    return make_objective("simulated", cluster, workload, stages)


# -- hand-computed steps (α = 10 ms; 8 Gbit/s: 0.1 GB takes 0.1 s) -------------------------------------------


def test_one_pipeline_one_micro_batch_is_there_and_back():
    obj = _objective(_uniform(2, 10.0, 8.0), stages=2, activation_gb=0.1)
    assert obj.evaluate(np.array([[0, 1]])).cost_s == pytest.approx(2 * (0.01 + 0.1))


def test_micro_batches_pipeline_through_compute_and_links():
    # forward: F0 0.01 | link 0.05 + α 0.01 | F1 0.02, two micro-batches: 0.08 + 0.01 + 1 × 0.05 = 0.14;
    # backward: B1 0.04 | link 0.05 + α | B0 0.03: 0.12 + 0.01 + 0.05 = 0.18; the step: 0.32 (flow shop)
    obj = _objective(_uniform(2, 10.0, 8.0), stages=2, activation_gb=0.1, micro_batches=2,
                     forward_s=(0.01, 0.02), backward_s=(0.03, 0.04))
    assert obj.evaluate(np.array([[0, 1]])).cost_s == pytest.approx(0.32)


def test_shards_travel_in_parallel_unlike_the_papers_sum():
    # one stage, 3 replicas, 0.3 GB of gradients: each shard 0.1 GB; reduce-scatter then all-gather, each
    # one α + shard/β, whatever the group size; the paper sums over the D − 1 peers
    cluster = _uniform(3, 10.0, 8.0)
    simulated = _objective(cluster, stages=1, gradient_gb=0.3).evaluate(np.array([[0], [1], [2]])).cost_s
    assert simulated == pytest.approx(2 * (0.01 + 0.1))
    dtfm = make_objective("dtfm", cluster, StepWorkload(0.0, 0.3), 1).evaluate(np.array([[0], [1], [2]])).cost_s
    assert dtfm == pytest.approx(2 * simulated)


def test_the_gather_queues_behind_the_reduce_shard_on_the_same_link():
    # device 1 computes twice as long (half the TFLOP/s): backward done at 0.5 and 1.0. Reduce 0→1 arrives
    # 0.61, 1→0 at 1.11; gather 1→0 waits for its link (busy until 1.1) and arrives 1.21; gather 0→1 leaves
    # at 1.11 and arrives 1.22: both end at 1.22, and every step repeats it
    obj = _objective(_uniform(2, 10.0, 8.0, tflops=[2.0, 1.0]), stages=1, gradient_gb=0.2,
                     forward_s=(0.5,), reference_tflops=2.0)
    sim = obj.simulate(np.array([[0], [1]]), steps=3)
    assert sim.step_s == pytest.approx((1.22, 1.22, 1.22))


def test_update_and_boundary_add_to_the_step():
    obj = _objective(_uniform(2, 10.0, 8.0), stages=2, activation_gb=0.1, update_s=(0.05, 0.02), boundary_s=0.03)
    # stage 0 ends at 0.22 + 0.05 and starts the next step 0.03 later
    assert obj.evaluate(np.array([[0, 1]])).cost_s == pytest.approx(0.22 + 0.05 + 0.03)


def test_clipping_norms_reach_the_later_stages_one_latency_after_stage_0_is_done():
    # 3 stages: there and back is 4 × 0.11 s; stage 0 is done last (0.44) and has the others' norms by then
    # (stage 1's left at 0.33); its norm reaches stages 1 and 2 at 0.45: the first step ends 10 ms later.
    # In steady state stage 0 starts again at 0.44 and the others wait for its activations anyway: same period.
    cluster, sigma = _uniform(3, 10.0, 8.0), np.array([[0, 1, 2]])
    plain = _objective(cluster, stages=3, activation_gb=0.1)
    clipped = _objective(cluster, stages=3, activation_gb=0.1, clip=True)
    assert plain.simulate(sigma, steps=3).step_s == pytest.approx((0.44, 0.44, 0.44))
    assert clipped.simulate(sigma, steps=3).step_s == pytest.approx((0.45, 0.44, 0.44))
    # the closed form adds the longest delay of the cluster, whatever the plan
    groups, hops = [np.array([0]), np.array([1]), np.array([2])], [0.22, 0.22]
    values = [float(plain.group_terms(g).max()) for g in groups]
    assert clipped.combine(values, hops).cost_s == pytest.approx(plain.combine(values, hops).cost_s + 0.01)


def test_diloco_spreads_one_all_reduce_over_its_round():
    # one stage, 3 replicas, 0.3 GB: the all-reduce adds 2 × 0.11 s to a step of 0.5 s of compute; with rounds
    # of 4 steps, a quarter of it per step; the closed form divides the groups' term alike
    cluster, sigma = _uniform(3, 10.0, 8.0), np.array([[0], [1], [2]])
    every = _objective(cluster, stages=1, gradient_gb=0.3, forward_s=(0.5,))
    diloco = _objective(cluster, stages=1, gradient_gb=0.3, forward_s=(0.5,), sync_every=4)
    assert every.evaluate(sigma).cost_s == pytest.approx(0.5 + 0.22)
    assert diloco.evaluate(sigma).cost_s == pytest.approx(0.5 + 0.22 / 4)
    values = [float(every.group_terms(np.array([0, 1, 2])).max())]
    assert diloco.combine(values, []).data_parallel_s == pytest.approx(every.combine(values, []).data_parallel_s / 4)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        StepProfile(sync_every=0)


# -- against the brute-force event simulation ------------------------------------------------------------------


def _random_instance(rng, symmetric):
    stages, replicas = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    n = stages * replicas
    latency, bandwidth = rng.uniform(0, 50, (n, n)), rng.uniform(0.5, 10, (n, n))
    if symmetric:
        latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    cluster = _cluster(latency, bandwidth, tflops=list(rng.choice([1.0, 2.0], n)))
    profile = StepProfile(
        micro_batches=int(rng.integers(1, 4)), forward_s=tuple(rng.uniform(0, 0.3, stages)),
        backward_s=tuple(rng.uniform(0, 0.5, stages)), update_s=tuple(rng.uniform(0, 0.1, stages)),
        gradient_gb=tuple(rng.uniform(0.1, 1, stages)), message_s=float(rng.uniform(0, 0.01)),
        boundary_s=float(rng.uniform(0, 0.1)), reference_tflops=1.5,
    )
    workload = StepWorkload(float(rng.uniform(0.05, 1)), 0.5, step=profile)
    return cluster, workload, stages, rng.permutation(n).reshape(replicas, stages)


def test_simulation_equals_the_brute_force_event_simulation():
    rng = np.random.default_rng(1)
    for trial in range(120):
        cluster, workload, stages, sigma = _random_instance(rng, symmetric=trial % 2 == 0)
        obj = make_objective("simulated", cluster, workload, stages)
        ours = obj.simulate(sigma, steps=5).step_s
        brute = event_simulation(obj, sigma, steps=5)["step_s"]
        assert ours == pytest.approx(brute, rel=1e-12, abs=1e-12), trial


def test_slower_links_or_compute_never_make_a_step_faster():
    rng = np.random.default_rng(3)
    for trial in range(150):
        cluster, workload, stages, sigma = _random_instance(rng, symmetric=False)
        n = cluster.num_devices
        if n < 2:
            continue
        base = make_objective("simulated", cluster, workload, stages)
        latency, bandwidth = cluster.latency_ms.copy(), cluster.bandwidth_gbps.copy()
        a, b = rng.choice(n, size=2, replace=False)
        if trial % 2:
            bandwidth[a, b] *= rng.uniform(0.1, 0.9)
        else:
            latency[a, b] = latency[a, b] * rng.uniform(1.1, 5) + 1.0
        slower = make_objective("simulated", Cluster(cluster.devices, latency, bandwidth), workload, stages)
        assert slower.evaluate(sigma).cost_s >= base.evaluate(sigma).cost_s * (1 - 1e-12), trial
        groups = [base.group_terms(sigma[:, j]).max() for j in range(stages)]
        hops = [base.hop_link_s[sigma[:, h], sigma[:, h + 1]].max() for h in range(stages - 1)]
        slow_groups = [slower.group_terms(sigma[:, j]).max() for j in range(stages)]
        slow_hops = [slower.hop_link_s[sigma[:, h], sigma[:, h + 1]].max() for h in range(stages - 1)]
        assert slower.combine(slow_groups, slow_hops).cost_s >= base.combine(groups, hops).cost_s - 1e-12
        heavier = StepProfile(**{**workload.step.__dict__, "backward_s": tuple(2 * x for x in workload.step.backward_s)})
        more = make_objective("simulated", cluster, StepWorkload(workload.activation_gb, 0.5, step=heavier), stages)
        assert more.evaluate(sigma).cost_s >= base.evaluate(sigma).cost_s * (1 - 1e-12), trial


def test_without_a_step_profile_it_is_communication_only():
    cluster = scenario("worldwide", 8)
    obj = make_objective("simulated", cluster, StepWorkload(0.47, 0.65), 4)
    assert obj.micro_batches == 1 and not obj.forward_s.any() and obj.evaluate(megatron_assignment(8, 4)).cost_s > 0


def test_bad_profiles_are_refused():
    with pytest.raises(ValueError, match="micro_batches"):
        StepProfile(micro_batches=0)
    with pytest.raises(ValueError, match="forward_s"):
        StepProfile(forward_s=(-1.0,))
    with pytest.raises(ValueError, match="3 entries for 2 stages"):
        _objective(_uniform(4, 1.0, 1.0), stages=2, forward_s=(0.1, 0.1, 0.1))


# -- the planner ---------------------------------------------------------------------------------------------


def test_the_planner_puts_slow_all_reduce_groups_late_in_the_pipeline():
    # spot at 8 devices: one 4-GPU instance (0-3) and four single GPUs. Megatron's order has the slow groups
    # (singles) at stages 2 and 3, where their all-reduce overlaps the backward pass of stages 1 and 0; the
    # same groups at stages 0 and 1 cost the same in the paper's model but are much slower in the simulation
    cluster = scenario("spot", 8)
    workload = StepWorkload(0.47, 0.65, step=StepProfile(micro_batches=2))
    obj = make_objective("simulated", cluster, workload, 4)
    megatron = megatron_assignment(8, 4)
    mirrored = megatron[:, ::-1]
    assert obj.evaluate(mirrored).cost_s > 1.2 * obj.evaluate(megatron).cost_s
    dtfm = make_objective("dtfm", cluster, workload, 4)
    assert dtfm.evaluate(mirrored).cost_s == pytest.approx(dtfm.evaluate(megatron).cost_s)
    plan = schedule(cluster, workload, 4, objective="simulated")
    assert plan.objective == "simulated"
    assert plan.cost.cost_s <= obj.evaluate(megatron).cost_s * (1 + 1e-9)
    assert obj.refine(mirrored).tolist() != mirrored.tolist()
    assert obj.evaluate(obj.refine(mirrored)).cost_s == pytest.approx(obj.evaluate(megatron).cost_s)


def test_planned_worldwide_beats_the_baselines_and_is_a_valid_assignment():
    cluster = scenario("worldwide", 16)
    workload = StepWorkload(0.47, 0.65, step=StepProfile(micro_batches=4, forward_s=(0.1,) * 4,
                                                          backward_s=(0.2,) * 4))
    plan = schedule(cluster, workload, 4, objective="simulated", seed=0)
    check_assignment(np.array(plan.pipelines), 4, 4, 16)
    assert plan.cost.cost_s < plan.baselines["megatron"].cost_s
    assert plan.cost.cost_s < plan.baselines["random"].cost_s


def test_a_diloco_round_reduces_after_the_clip_and_the_update():
    # 2 stages × 2 replicas, per-link FIFOs (α 10 ms, 8 Gbit/s), one micro-batch, no activation bytes; stage 1
    # holds 0.4 GB of gradients (0.2 GB shards: 0.21 s a phase, 0.42 s its all-reduce), stage 0 0.02 GB. Without
    # an all-reduce the period is 0.82 (forward 0.1, hop 0.01, stage 1's 0.2, back 0.01, stage 0's backward 0.5).
    # At a round's end stage 1 reduces after its clip, which waits for stage 0's norm: the cycle "stage 1's
    # all-reduce, its forward and backward, the gradient back, stage 0's backward, its norm" is 0.42 + 0.2 +
    # 0.01 + 0.5 + 0.01 = 1.14, 0.32 more, a quarter of it a step with rounds of 4. (Reduced during stage 0's
    # backward, as every-step sync does, stage 1's all-reduce would add 0.04.)
    cluster, sigma = _uniform(4, 10.0, 8.0), np.array([[0, 1], [2, 3]])
    profile = dict(forward_s=(0.1, 0.1), backward_s=(0.5, 0.1), gradient_gb=(0.02, 0.4), clip=True)
    every = make_objective("simulated", cluster, StepWorkload(0.0, 0.4, step=StepProfile(**profile)), 2)
    diloco = make_objective("simulated", cluster, StepWorkload(0.0, 0.4, step=StepProfile(**profile, sync_every=4)),
                            2)
    assert diloco.simulate(sigma).sync_extra_s == pytest.approx(0.32)
    assert diloco.evaluate(sigma).cost_s == pytest.approx(0.82 + 0.32 / 4)
    assert every.evaluate(sigma).cost_s == pytest.approx(0.86)  # stage 0's all-reduce (0.02 + 0.02) and norm
