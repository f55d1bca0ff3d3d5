"""Access links in the simulated objective: hand-computed queues, the time-ordered event simulation, the
closed form, Streaming DiLoCo and compute utilisation."""

import numpy as np
import pytest

from p2ptrain.planning import Cluster, Device, make_objective, schedule
from p2ptrain.planning.scenarios import homes
from p2ptrain.planning.simulated import StepProfile, StepWorkload

from .access_sim import access_event_simulation


def _uniform(n, latency_ms, bandwidth_gbps, uplink=None, downlink=None, tflops=None):
    off = 1 - np.eye(n)
    devices = tuple(Device(f"d{i}", tflops=None if tflops is None else tflops[i]) for i in range(n))
    return Cluster(devices, latency_ms * off, bandwidth_gbps * off + np.eye(n), uplink, downlink)


def _objective(cluster, stages, activation_gb=0.0, gradient_gb=0.0, **profile):
    workload = StepWorkload(activation_gb, gradient_gb, step=StepProfile(**profile))
    return make_objective("simulated", cluster, workload, stages)


# -- hand-computed (α = 10 ms; 8 Gbit/s: 0.1 GB takes 0.1 s) -------------------------------------------------


def test_a_devices_shards_share_its_uplink():
    # one stage, 3 replicas, 0.3 GB: shards of 0.1 GB. Per-link FIFOs: 2 × (0.01 + 0.1) = 0.22 s. Each uplink
    # at 8 Gbit/s sends its two reduce-scatter shards one after the other (to members 0, 1, 2 in order):
    # member 0 → 1 arrives 0.11, → 2 at 0.21; 1 → 0 at 0.11, → 2 at 0.21; 2 → 0 at 0.11, → 1 at 0.21.
    # Owner 0 has its shards at 0.11 and sends the all-gather once its uplink is free (0.2): to 1 at 0.31, to 2 at
    # 0.41; owners 1 and 2 at 0.21: to the first other member at 0.32, the second at 0.42. Last: 0.42.
    sigma = np.array([[0], [1], [2]])
    per_link = _objective(_uniform(3, 10.0, 8.0), stages=1, gradient_gb=0.3)
    assert per_link.simulate(sigma, steps=2).step_s[0] == pytest.approx(0.22)
    shared = _objective(_uniform(3, 10.0, 8.0, uplink=[8.0] * 3), stages=1, gradient_gb=0.3)
    assert shared.simulate(sigma, steps=2).step_s[0] == pytest.approx(0.42)


def test_the_sum_checks_two_rounds_follow_the_all_reduce():
    # as above, with the sum check's commit and sketch (0.1 GB each, to every other member in rank order) after
    # the all-reduce. Per link each round is one message: 0.22 + 2 × 0.11. Behind the uplinks: member 0 is
    # done at 0.41 (its uplink free at 0.4), 1 and 2 at 0.42 (theirs at 0.41). Commits: 0 → 1 at 0.52, → 2
    # at 0.62; 1 → 0 at 0.53, → 2 at 0.63; 2 → 0 at 0.53, → 1 at 0.63: 0 has them at 0.53, 1 and 2 at 0.63.
    # Sketches: 0 (uplink free at 0.61) → 1 at 0.72, → 2 at 0.82; 1 and 2 → 0 at 0.74, to the other at 0.84
    sigma = np.array([[0], [1], [2]])
    check = {"verify_gb": (0.1, 0.1)}
    per_link = _objective(_uniform(3, 10.0, 8.0), stages=1, gradient_gb=0.3, **check)
    assert per_link.simulate(sigma, steps=2).step_s[0] == pytest.approx(0.44)
    shared = _objective(_uniform(3, 10.0, 8.0, uplink=[8.0] * 3), stages=1, gradient_gb=0.3, **check)
    assert shared.simulate(sigma, steps=2).step_s[0] == pytest.approx(0.84)
    assert shared.evaluate(sigma).cost_s <= shared.combine([shared.group_terms(np.arange(3)).max()], []).cost_s


def test_a_receivers_downlink_is_shared_by_its_senders():
    # device 0 alone has a downlink (8 Gbit/s). Reduce-scatter: 1 → 0 and 2 → 0 both come in from 0.01 on;
    # the downlink takes 1's by 0.11, then 2's by 0.21 (0 has its shard then; 1 and 2 theirs at 0.11).
    # All-gather: 1 and 2 send to 0 at 0.11 (their pair links are free at 0.1): both come in from 0.12, the
    # downlink is free at 0.21: 1's through at 0.31, 2's at 0.41. 0 sends at 0.21, delivered 0.32. Last: 0.41.
    obj = _objective(_uniform(3, 10.0, 8.0, downlink=[8.0, None, None]), stages=1, gradient_gb=0.3)
    assert obj.simulate(np.array([[0], [1], [2]]), steps=2).step_s[0] == pytest.approx(0.41)


def test_a_line_slower_than_the_path_paces_the_pipeline():
    # two stages, one micro-batch of 0.1 GB: there and back 2 × (0.01 + 0.1) s; a 4 Gbit/s uplink on the
    # first device doubles the way forward, a 4 Gbit/s downlink on it the way back
    sigma = np.array([[0, 1]])
    assert _objective(_uniform(2, 10.0, 8.0), 2, 0.1).evaluate(sigma).cost_s == pytest.approx(0.22)
    up = _objective(_uniform(2, 10.0, 8.0, uplink=[4.0, None]), 2, 0.1)
    assert up.evaluate(sigma).cost_s == pytest.approx(0.21 + 0.11)
    down = _objective(_uniform(2, 10.0, 8.0, downlink=[4.0, None]), 2, 0.1)
    assert down.evaluate(sigma).cost_s == pytest.approx(0.11 + 0.21)


def test_with_overlap_the_last_gradient_leaves_before_the_buckets_on_the_uplink():
    # 2 stages × 2 replicas behind 8 Gbit/s uplinks; each stage's 4 GB all-reduced in 4 buckets (0.5 GB shards,
    # 0.5 s each) made during its last backward pass (1 s). Stage 1 holds its buckets until that pass's
    # gradient to stage 0 is handed over (``runtime.buckets``), so the gradient is first on its uplink: stage 0
    # gets it as if stage 1 had nothing to reduce, and the step is stage 0's, the same either way
    lines = _uniform(4, 10.0, 8.0, uplink=[8.0] * 4)
    profile = dict(forward_s=(0.1, 0.1), backward_s=(1.0, 1.0), bucket_gb=1.0)
    sigma = np.array([[0, 1], [2, 3]])
    shared = _objective(lines, 2, activation_gb=0.1, gradient_gb=4.0, **profile)
    workload = StepWorkload(0.1, 4.0, step=StepProfile(**profile | {"gradient_gb": (4.0, 1e-9)}))
    quiet = make_objective("simulated", lines, workload, 2)  # stage 1 has (almost) nothing to reduce
    assert shared.simulate(sigma).predicted_s == pytest.approx(quiet.simulate(sigma).predicted_s, rel=1e-9)
    steps = shared.simulate(sigma, steps=3).step_s
    assert steps == pytest.approx(access_event_simulation(shared, sigma, 3)["step_s"], rel=1e-12)


# -- against the brute-force event simulation in time order -----------------------------------------------------


def _random_instance(rng, *, uplinks, downlinks, stages=None, replicas=None, schedule=None, overlap=None,
                     forward_s=0.3):
    stages = stages or int(rng.integers(1, 4))
    replicas = replicas or int(rng.integers(1, 4))
    n = stages * replicas

    def capacities():  # most devices behind a line, some not
        return [float(x) if rng.random() < 0.8 else None for x in rng.uniform(0.5, 10, n)]

    devices = tuple(Device(f"d{i}", tflops=float(rng.choice([1.0, 2.0]))) for i in range(n))
    cluster = Cluster(devices, rng.uniform(0, 50, (n, n)), rng.uniform(0.5, 10, (n, n)),
                      capacities() if uplinks else None, capacities() if downlinks else None)
    profile = StepProfile(
        micro_batches=int(rng.integers(1, 4)), forward_s=tuple(rng.uniform(0, forward_s, stages)),
        backward_s=tuple(rng.uniform(0, 0.5, stages)), update_s=tuple(rng.uniform(0, 0.1, stages)),
        gradient_gb=tuple(rng.uniform(0.1, 1, stages)), message_s=float(rng.uniform(0, 0.01)),
        boundary_s=float(rng.uniform(0, 0.1)), reference_tflops=1.5,
        schedule=schedule or str(rng.choice(["gpipe", "1f1b"])),
        bucket_gb=float(rng.choice([0.0, 0.05, 0.2])) if overlap is None else overlap, clip=bool(rng.integers(0, 2)),
    )
    objective = make_objective("simulated", cluster, StepWorkload(float(rng.uniform(0.05, 1)), 0.5, step=profile),
                               stages)
    return objective, rng.permutation(n).reshape(replicas, stages)


@pytest.mark.parametrize(
    "case, trials, kwargs",
    [
        # every uplink is exact: a device's sends in its own order, the all-reduce's by hand-over time; pairs
        # slower than their uplinks hold the uplink's next messages
        ("uplinks", 25, dict(uplinks=True, downlinks=False)),
        # downlinks where their messages cannot interleave: one pipeline under GPipe; one stage whose steps
        # are apart (long compute)
        ("downlinks, one pipeline", 20, dict(uplinks=True, downlinks=True, replicas=1, schedule="gpipe")),
        ("downlinks, one stage", 20, dict(uplinks=True, downlinks=True, stages=1, forward_s=20.0)),
    ],
)
def test_simulation_equals_the_time_ordered_event_simulation(case, trials, kwargs):
    rng = np.random.default_rng(11)
    for trial in range(trials):
        obj, sigma = _random_instance(rng, **kwargs)
        ours = obj.simulate(sigma, steps=4).step_s
        assert ours == pytest.approx(access_event_simulation(obj, sigma, 4)["step_s"], rel=1e-12), (case, trial)


def test_simulation_beside_the_event_simulation_on_home_links():
    # where a downlink's messages can interleave (1F1B, pipelines at different paces), the simulation serves
    # them in its own order (module docstring); on 64-home-like networks the period stays close
    rng = np.random.default_rng(3)
    for trial in range(6):
        s, d = 3, 2
        profile = StepProfile(micro_batches=3, forward_s=(0.1,) * s, backward_s=(0.2,) * s, gradient_gb=(0.05,) * s,
                              schedule="1f1b")
        obj = make_objective("simulated", homes(s * d, 0.1, seed=trial), StepWorkload(0.02, 0.05, step=profile), s)
        sigma = rng.permutation(s * d).reshape(d, s)
        ours = obj.simulate(sigma, steps=4).predicted_s
        theirs = access_event_simulation(obj, sigma, 4)["step_s"]
        period = float(np.median([(a + b) / 2 for a, b in zip(theirs[1:], theirs[2:], strict=False)]))
        assert ours == pytest.approx(period, rel=0.15), trial


# -- the closed form, the search, Streaming DiLoCo, compute ----------------------------------------------------


def test_the_closed_form_charges_the_access_links():
    # a hop moves at the slowest of pair, uplink and downlink; a group's shard queues behind its phase's
    # D − 2 others at both ends: 0.1 GB shards, 4 members, 8 Gbit/s everywhere: α + 0.1 + 2 × (0.1 + 0.1) s
    plain = _objective(_uniform(4, 10.0, 8.0), stages=1, gradient_gb=0.4)
    lines = _objective(_uniform(4, 10.0, 8.0, uplink=[8.0] * 4, downlink=[8.0] * 4), stages=1, gradient_gb=0.4)
    members = np.arange(4)
    assert plain.group_terms(members).max() == pytest.approx(2 * (0.01 + 0.1))
    assert lines.group_terms(members).max() == pytest.approx(2 * (0.01 + 0.1 + 2 * 0.2))
    slow = _objective(_uniform(2, 10.0, 8.0, downlink=[None, 2.0]), stages=2, activation_gb=0.1)
    assert slow.hop_link_s[0, 1] == pytest.approx((0.01 + 0.4) + (0.01 + 0.1))  # there at 2 Gbit/s, back at 8


def test_the_planner_plans_homes_behind_their_lines():
    cluster = homes(8, 0.1, seed=1)
    workload = StepWorkload(0.05, 0.2, step=StepProfile(micro_batches=2, forward_s=(0.2,) * 2, backward_s=(0.4,) * 2))
    plan = schedule(cluster, workload, 2, objective="simulated", seed=0)
    obj = make_objective("simulated", cluster, workload, 2)
    assert plan.cost.cost_s == pytest.approx(obj.evaluate(np.array(plan.pipelines)).cost_s)
    assert plan.cost.cost_s <= plan.baselines["megatron"].cost_s
    separate = make_objective("simulated", homes(8, 0.1, seed=1, access=False), workload, 2)
    assert obj.evaluate(np.array(plan.pipelines)).cost_s > separate.evaluate(np.array(plan.pipelines)).cost_s


def test_streaming_diloco_is_paced_by_the_busiest_queue():
    # one stage, 3 replicas, 0.3 GB, H = 4, 0.05 s of compute a step. Streamed, each member's uplink moves
    # 4 shards of 0.1 GB a round: 0.1 GB a step, 0.1 s at 8 Gbit/s, longer than the step without sync; each
    # pair link 0.05 GB (0.05 s): on per-link FIFOs the step is the compute. Not streamed, the round's
    # all-reduce (0.42 s with the uplinks, test above) adds a quarter of itself to each step.
    sigma = np.array([[0], [1], [2]])
    lines = _uniform(3, 10.0, 8.0, uplink=[8.0] * 3)
    streamed = _objective(lines, 1, gradient_gb=0.3, forward_s=(0.05,), sync_every=4, sync_overlap=True)
    assert streamed.streamed_floor_s(sigma) == pytest.approx(0.1)
    assert streamed.evaluate(sigma).cost_s == pytest.approx(0.1)
    blocking = _objective(lines, 1, gradient_gb=0.3, forward_s=(0.05,), sync_every=4)
    assert blocking.evaluate(sigma).cost_s == pytest.approx(0.05 + 0.42 / 4)
    free = _objective(_uniform(3, 10.0, 8.0), 1, gradient_gb=0.3, forward_s=(0.05,), sync_every=4, sync_overlap=True)
    assert free.evaluate(sigma).cost_s == pytest.approx(0.05)
    values = [float(streamed.group_terms(np.arange(3)).max())]
    assert streamed.combine(values, []).cost_s == pytest.approx(max(0.05, values[0] / 4))
    with pytest.raises(ValueError, match="sync_overlap .* needs sync_every > 1"):
        StepProfile(sync_overlap=True)
    # streamed over τ = 1 step, the round's 0.4 GB a member sends take that step 0.4 s; in 4 fragments, each
    # streamed over its own step, a quarter of it each: the round's bytes over 4 steps again
    tau_one = _objective(lines, 1, gradient_gb=0.3, forward_s=(0.05,), sync_every=4, sync_overlap=True, overlap_steps=1)
    assert tau_one.streamed_floor_s(sigma) == pytest.approx(0.4)
    fragmented = _objective(lines, 1, gradient_gb=0.3, forward_s=(0.05,), sync_every=4, sync_overlap=True,
                            overlap_steps=1, fragments=4)
    assert fragmented.streamed_floor_s(sigma) == pytest.approx(0.1)
    assert StepProfile(sync_every=4, sync_overlap=True, overlap_steps=2, fragments=4).streamed_steps == 4


def test_compute_is_the_busiest_devices_forwards_backwards_and_update():
    # stage 0: 2 × (0.1 + 0.3) + 0.05 = 0.85 s; stage 1 on a device at half the speed: 2 × 2 × (0.2 + 0.4) = 2.4 s
    cluster = _uniform(2, 10.0, 8.0, tflops=[2.0, 1.0])
    obj = _objective(cluster, 2, micro_batches=2, forward_s=(0.1, 0.2), backward_s=(0.3, 0.4), update_s=(0.05, 0.0),
                     reference_tflops=2.0)
    assert obj.compute_s(np.array([[0, 1]])) == pytest.approx(2.4)
    assert obj.compute_s(np.array([[1, 0]])) == pytest.approx(2 * 0.85)
