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
