"""The simulated objective under the runtime's settings: wire formats, schedules, overlapped all-reduce."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.planning import make_objective
from p2ptrain.planning.simulated import StepProfile, StepWorkload
from p2ptrain.planning.wire_model import WIRE_BYTES, schedule_ops, step_order

from .event_sim import event_simulation
from .test_simulated import _random_instance, _uniform


def test_wire_bytes_are_the_runtime_codecs_sizes():
    from p2ptrain.runtime import wire

    n = 64 * 1000
    for name in wire.WIRE_FORMATS:
        formats = wire.wire_format(name)
        codecs = (formats.activation, formats.activation_grad, formats.gradient)
        assert tuple(wire.wire_bytes(c.name, n) / n for c in codecs) == pytest.approx(WIRE_BYTES[name]), name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_are_the_runtimes_and_the_step_order_respects_every_dependency(schedule):
    from p2ptrain.runtime.schedule import schedule_ops as runtime_ops

    for stages in range(1, 6):
        for micro_batches in range(1, 7):
            for stage in range(stages):
                assert schedule_ops(schedule, stages, stage, micro_batches) == \
                    runtime_ops(schedule, stages, stage, micro_batches)
            order = step_order(schedule, stages, micro_batches)
            position = {op: k for k, op in enumerate(order)}
            assert len(position) == len(order) == 2 * stages * micro_batches
            for kind, j, m in order:
                if kind == "F" and j > 0:
                    assert position[("F", j - 1, m)] < position[(kind, j, m)]
                if kind == "B" and j < stages - 1:
                    assert position[("B", j + 1, m)] < position[(kind, j, m)]
            for j in range(stages):
                assert [(k, m) for k, jj, m in order if jj == j] == schedule_ops(schedule, stages, j, micro_batches)


def _with(workload: StepWorkload, **settings) -> StepWorkload:
    return dataclasses.replace(workload, step=dataclasses.replace(workload.step, **settings))


def test_every_schedule_and_wire_equals_the_brute_force_event_simulation():
    rng = np.random.default_rng(7)
    for trial in range(80):
        cluster, workload, stages, sigma = _random_instance(rng, symmetric=trial % 2 == 0)
        schedule, wire = ["gpipe", "1f1b"][trial % 2], ["fp32", "bf16", "int8", "int4"][trial % 4]
        obj = make_objective("simulated", cluster, _with(workload, schedule=schedule, wire=wire), stages)
        ours = obj.simulate(sigma, steps=5).step_s
        assert ours == pytest.approx(event_simulation(obj, sigma, steps=5)["step_s"], rel=1e-12, abs=1e-12), trial


def test_fp32_on_fp32_volumes_is_the_volumes_as_given_and_bf16_halves_the_traffic():
    cluster = _uniform(2, 0.0, 8.0)  # no latency: a step is all serialisation
    workload = StepWorkload(0.4, 0.6, step=StepProfile(micro_batches=2))
    sigma = np.array([[0, 1]])
    given = make_objective("simulated", cluster, workload, 2).evaluate(sigma).cost_s
    assert make_objective("simulated", cluster, _with(workload, wire="fp32"), 2).evaluate(sigma).cost_s == given
    half = make_objective("simulated", cluster, _with(workload, wire="bf16"), 2).evaluate(sigma).cost_s
    assert half == pytest.approx(given / 2)
    int8 = make_objective("simulated", cluster, _with(workload, wire="int8"), 2).evaluate(sigma).cost_s
    assert int8 == pytest.approx(given * 1.0625 / 4)


def test_schedules_have_the_same_bubble_without_communication():
    for stages, micro_batches in [(2, 3), (4, 4), (3, 8)]:
        profile = StepProfile(micro_batches=micro_batches, forward_s=(0.1,) * stages, backward_s=(0.2,) * stages)
        workload = StepWorkload(0.0, 0.0, step=profile)
        cluster = _uniform(stages, 0.0, 8.0)
        sigma = np.arange(stages).reshape(1, stages)
        costs = [make_objective("simulated", cluster, _with(workload, schedule=s), stages).evaluate(sigma).cost_s
                 for s in ("gpipe", "1f1b")]
        assert costs[0] == pytest.approx(costs[1]) == pytest.approx((micro_batches + stages - 1) * 0.3)


def test_an_overlapped_all_reduce_is_never_slower_and_hides_behind_the_last_backward():
    rng = np.random.default_rng(11)
    for trial in range(60):
        cluster, workload, stages, sigma = _random_instance(rng, symmetric=True)
        after = make_objective("simulated", cluster, workload, stages).evaluate(sigma).cost_s
        bucket_gb = float(max(workload.step.gradient_gb)) / int(rng.integers(1, 12))
        during = make_objective("simulated", cluster, _with(workload, bucket_gb=bucket_gb), stages)
        assert during.evaluate(sigma).cost_s <= after * (1 + 1e-12), trial
    # one replica: nothing to reduce, nothing changes
    cluster, workload = _uniform(2, 5.0, 1.0), StepWorkload(0.1, 0.5, step=StepProfile(backward_s=(1.0, 1.0)))
    sigma = np.array([[0, 1]])
    assert make_objective("simulated", cluster, _with(workload, bucket_gb=0.1), 2).evaluate(sigma).cost_s == \
        make_objective("simulated", cluster, workload, 2).evaluate(sigma).cost_s


def test_overlap_hides_an_all_reduce_shorter_than_the_last_backward():
    cluster = _uniform(2, 0.0, 8.0)  # 1 GB/s
    profile = StepProfile(micro_batches=1, forward_s=(0.1,), backward_s=(2.0,), gradient_gb=(0.2,))
    workload = StepWorkload(0.0, 0.2, step=profile)
    sigma = np.array([[0], [1]])  # one stage, two replicas: 0.1 GB shards, 0.1 s each way
    after = make_objective("simulated", cluster, workload, 1).evaluate(sigma).cost_s
    assert after == pytest.approx(2.1 + 0.2)
    during = make_objective("simulated", cluster, _with(workload, bucket_gb=0.025), 1).evaluate(sigma).cost_s
    assert during == pytest.approx(2.1 + 0.2 / 8)  # 8 buckets: only the last one's exchange is left after the pass


@pytest.mark.parametrize(("settings", "problem"), [
    ({"wire": "int3"}, "unknown wire format"), ({"schedule": "zb"}, "unknown schedule"),
    ({"bucket_gb": -1.0}, "bucket_gb"), ({"volume_bytes": (4.0, 0.0, 4.0)}, "volume_bytes")])
def test_bad_settings_are_refused(settings, problem):
    with pytest.raises(ValueError, match=problem):
        StepProfile(**settings)


def test_each_stage_all_reduces_in_the_runtimes_buckets_full_ones_first():
    from p2ptrain.planning.simulated import MAX_SIMULATED_BUCKETS, bucket_shares

    shares = bucket_shares(np.array([1.1, 0.2, 0.4]), 0.4)
    assert shares == pytest.approx(np.array([[0.4 / 1.1, 0.4 / 1.1, 0.3 / 1.1], [1.0, 0, 0], [1.0, 0, 0]]))
    assert bucket_shares(np.array([1.1, 0.2]), 0.0) == pytest.approx(np.ones((2, 1)))  # no overlap: one exchange
    many = bucket_shares(np.array([100.0, 1.0]), 1.0)  # 100 buckets are simulated as the most it merges them into
    assert many.shape == (2, MAX_SIMULATED_BUCKETS)
    assert many[0] == pytest.approx([1 / MAX_SIMULATED_BUCKETS] * MAX_SIMULATED_BUCKETS)
    assert many[1] == pytest.approx([1.0] + [0.0] * (MAX_SIMULATED_BUCKETS - 1))


def test_a_smaller_last_bucket_leaves_less_after_the_backward_pass():
    """0.3 GB of gradients in buckets of 0.2 GB: 0.2 GB ready 2/3 through the pass, the last 0.1 GB at its end.
    1 s latency, 1 GB/s. Bucket 0's shard (0.1 s) goes at 1.433 s and arrives at 2.533 s; bucket 1's (0.05 s) at
    2.1 s, arriving 3.15 s; bucket 0's reduced shard waits for nothing (2.533 → 3.633 s), bucket 1's leaves at
    3.15 s and arrives at 4.2 s. Two equal buckets would end at 4.25 s."""
    cluster = _uniform(2, 1000.0, 8.0)
    profile = StepProfile(micro_batches=1, forward_s=(0.1,), backward_s=(2.0,), gradient_gb=(0.3,), bucket_gb=0.2)
    sim = make_objective("simulated", cluster, StepWorkload(0.0, 0.3, step=profile), 1).simulate(np.array([[0], [1]]))
    assert sim.step_s == pytest.approx((4.2,) * len(sim.step_s))


def test_steps_that_alternate_long_and_short_are_predicted_at_their_period():
    """The emulated world-wide network, four agents, int8 (a plan of the e2e benchmark): the stages end their
    steps in turn, 2.48 and 2.12 s (network seconds × 0.59). The prediction is their mean, as the benchmark
    measures it (``step_period``); the median of single steps would say 2.12 s."""
    from p2ptrain.planning.cluster import Cluster, Device
    from p2ptrain.planning.simulated import SimulatedSteps, step_period

    assert SimulatedSteps((9.0, 2.0, 3.0, 2.0), 0.0, 0.0).predicted_s == pytest.approx(2.5)
    assert step_period([1.0]) == 1.0
    latency = [[0, 67, 49, 96], [67, 0, 11, 143], [49, 11, 0, 130], [96, 143, 130, 0]]
    bandwidth = [[0.0, 0.79, 1.1, 0.523], [0.79, 0.0, 1.12, 0.524], [1.1, 1.12, 0.0, 0.694], [0.523, 0.524, 0.694, 0.0]]
    tflops = [1.709e-07, 1.483e-07, 1.641e-07, 1.591e-07]
    cluster = Cluster(tuple(Device(f"d{k}", tflops=t) for k, t in enumerate(tflops)), np.array(latency, float),
                      np.array(bandwidth))
    profile = StepProfile(micro_batches=2, forward_s=(0.01286, 0.0221), backward_s=(0.02385, 0.04183),
                          update_s=(0.004616, 0.007216), gradient_gb=(0.516, 0.8067), message_s=0.0004238,
                          reference_tflops=1.709e-07, steps=8, wire="int8", schedule="1f1b", bucket_gb=0.7937)
    objective = make_objective("simulated", cluster, StepWorkload(0.4712, 0.8067, step=profile), 2)
    sim = objective.simulate(np.array([[1, 0], [2, 3]]))
    long, short = max(sim.step_s[1:]), min(sim.step_s[1:])
    assert long > 1.1 * short
    assert all(t == pytest.approx(long if k % 2 else short) for k, t in enumerate(sim.step_s[1:]))
    assert sim.predicted_s == pytest.approx((long + short) / 2)
    assert objective.evaluate(np.array([[1, 0], [2, 3]])).cost_s == pytest.approx((long + short) / 2)
