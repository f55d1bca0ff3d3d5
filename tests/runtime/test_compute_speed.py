"""Mixed devices in the runtime: emulated compute speed (the pacer), each device's own measured speed,
and the per-layer workload the leader plans with."""

from __future__ import annotations

import pytest

from p2ptrain.net.dht.records import ComputeMeasurement
from p2ptrain.planning import Cluster, Device, Workload, scenario
from p2ptrain.planning.layers import layer_model
from p2ptrain.planning.split import even_layers
from p2ptrain.runtime import compute_speed
from p2ptrain.runtime.calibration import layered_workload, measured_speed, step_profile, with_measured_speeds
from p2ptrain.runtime.compute_speed import ComputePacer, compute_slowdown, fitting_scale, usable_cores
from p2ptrain.runtime.config import TrainConfig

TRAIN = TrainConfig(model="tiny", global_batch_size=40, micro_batches=2, stages=4, replicas=2)
FAST = ComputeMeasurement(rows=10, seq_len=64, layer_s=(0.002, 0.004), embed_s=(0.001, 0.003),
                          head_s=(0.0005, 0.001), update_s_per_mparam=0.02, message_s=0.0003)
SLOW = ComputeMeasurement(rows=10, seq_len=64, layer_s=(0.006, 0.012), embed_s=(0.003, 0.009),
                          head_s=(0.0015, 0.003), update_s_per_mparam=0.06, message_s=0.0005)


class FakeClock:
    def __init__(self):
        self.now, self.cpu, self.sleeps = 0.0, 0.0, []

    def perf_counter(self):
        return self.now

    def thread_time(self):
        return self.cpu

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s


def test_the_pacer_stretches_each_stretch_of_compute_by_its_factor(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(compute_speed, "time", clock)
    pacer = ComputePacer(3.5)
    with pacer.compute():
        clock.now += 0.2  # the compute took 0.2 s
    with pacer.compute():
        clock.now += 0.1
    assert clock.sleeps == pytest.approx([0.5, 0.25])
    assert pacer.slept_s == pytest.approx(0.75)
    with ComputePacer(1.0).compute():
        clock.now += 0.3
    assert len(clock.sleeps) == 2  # as fast as the machine: no sleep
    with pytest.raises(ValueError, match="at least 1"):
        ComputePacer(0.5)


def test_on_a_cpu_the_pacer_stretches_the_threads_own_compute_and_absorbs_its_wait_for_a_core(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(compute_speed, "time", clock)
    pacer = ComputePacer(3.0, cpu_clock=True)
    with pacer.compute():
        clock.now += 0.5  # half a second of wall time, of which the thread computed 0.2 s
        clock.cpu += 0.2
    assert clock.sleeps == pytest.approx([0.1])  # the card of 3x takes 0.6 s: 0.1 s after the wall's 0.5
    with pacer.compute():
        clock.now += 0.8  # waited longer for a core than the card's extra time: that much load shows
        clock.cpu += 0.2
    assert clock.sleeps == pytest.approx([0.1])
    assert pacer.busy_s == pytest.approx(0.6 + 0.8)
    assert pacer.busy_cpu_s == pytest.approx(0.4)  # the thread's own compute: the waits for a core left out
    unpaced = ComputePacer(1.0, cpu_clock=True)
    with unpaced.compute():
        clock.now += 0.3
        clock.cpu += 0.1
    assert (unpaced.busy_s, unpaced.busy_cpu_s) == pytest.approx((0.3, 0.1))


def test_slowdown_is_the_fastest_card_over_ones_own():
    cluster = scenario("volunteers", 8)
    slow = [compute_slowdown(cluster, k) for k in range(8)]
    fastest = max(d.tflops for d in cluster.devices)
    assert slow == pytest.approx([fastest / d.tflops for d in cluster.devices])
    assert min(slow) == 1.0 and max(slow) > 8
    assert compute_slowdown(scenario("worldwide", 8), 3) == 1.0  # no tflops: no emulated compute


def test_a_compute_scale_slows_every_device_alike_and_the_fitting_one_fits_the_cores():
    volunteers, worldwide = scenario("volunteers", 8), scenario("worldwide", 4)
    assert [compute_slowdown(volunteers, k, 2.0) for k in range(8)] == pytest.approx(
        [2 * compute_slowdown(volunteers, k) for k in range(8)])
    assert compute_slowdown(worldwide, 1, 2.0) == 2.0  # no tflops: the core plays the fastest, slowed alike
    assert fitting_scale(worldwide, cores=2) == 2.0  # four agents, each a core's worth, on two cores
    assert fitting_scale(worldwide, cores=8) == 1.0  # room for all: never faster than the machine
    assert fitting_scale(worldwide) == max(1.0, 4 / usable_cores()) and usable_cores() >= 1  # this machine's
    demand = sum(1 / compute_slowdown(volunteers, k) for k in range(8))  # the slow cards sleep most
    assert 1 < demand < 8 and fitting_scale(volunteers, cores=1) == pytest.approx(demand)
    scale = fitting_scale(volunteers, cores=2)
    assert sum(1 / compute_slowdown(volunteers, k, scale) for k in range(8)) == pytest.approx(2.0)


def test_each_devices_own_speed_goes_into_the_cluster():
    assert measured_speed(FAST) == pytest.approx(3 * measured_speed(SLOW))
    base = Cluster((Device("a", tflops=100.0), Device("b")), [[0, 1], [1, 0]], [[0, 1], [1, 0]])
    mixed = with_measured_speeds(base, [FAST, SLOW])
    assert [d.tflops for d in mixed.devices] == [measured_speed(FAST), measured_speed(SLOW)]
    assert with_measured_speeds(base, [FAST, None]) is base  # all or nothing: one unit for every device


def test_the_layered_workload_prices_parts_at_the_fastest_device():
    workload = Workload(0.01, 0.02)
    layered = layered_workload([SLOW, FAST, SLOW, FAST], workload, TRAIN, 2, boundary_s=0.05, time_scale=0.5,
                               size_factor=0.1)
    costs = layered.costs
    # micro-batches of 40 / (2 · 2) = 10 rows, as measured; times over the time scale
    assert costs.forward_s.block == pytest.approx(0.002 / 0.5)
    assert costs.backward_s.head == pytest.approx(0.001 / 0.5)
    assert layered.step.reference_tflops == pytest.approx(measured_speed(FAST))
    assert layered.step.boundary_s == pytest.approx(0.1)
    model = layer_model(TRAIN.shape, micro_batch_tokens=10 * 64, micro_batches=2, activation_bytes=4)
    assert costs.gradient_gb.block == pytest.approx(model.parameters.block * 4e-9 / 0.1)
    # at the even split it is the (fastest device's) step profile of the median path, stage for stage
    even = layered.at(even_layers(8, 4)).step
    median = step_profile([FAST], TRAIN, 4, 2, boundary_s=0.05, time_scale=0.5, size_factor=0.1)
    assert even.forward_s == pytest.approx(median.forward_s)
    assert even.backward_s == pytest.approx(median.backward_s)
    assert even.gradient_gb == pytest.approx(median.gradient_gb, rel=1e-3)  # the loss scalar aside


def test_how_a_step_divides_into_parts_is_the_median_over_devices():
    # the fastest device's head excess came out 0 (a difference of noisy minima); the others agree that the
    # head takes a quarter of a block's forward: the plan prices the head by them, at the fastest's speed
    noisy = ComputeMeasurement(**{**FAST.__dict__, "head_s": (0.0, 0.0), "layer_s": (0.0015, 0.003)})
    layered = layered_workload([noisy, FAST, SLOW], Workload(0.01, 0.02), TRAIN, 2)
    block = 0.0045  # the fastest device's block, forward and backward
    assert layered.costs.forward_s.block + layered.costs.backward_s.block == pytest.approx(block)
    assert layered.costs.forward_s.head == pytest.approx(0.0005 / 0.006 * block)
    assert layered.step.reference_tflops == pytest.approx(measured_speed(noisy))
