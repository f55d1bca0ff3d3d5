"""The sum check's own work in the calibration and the plan's price (issue 46, item 6): what an agent times
(a sketch with its norm, a message's digest), how it travels in its peer record (an older agent's record
without it still accepted, a garbled one refused), how the leader turns it into each stage's seconds per step,
and what the simulated objective adds for it: between the check's two rounds, in the simulation and in the
closed form alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_calibration_codecs import MEASURED as CODECS_MEASURED

from p2ptrain.net.dht.records import ComputeMeasurement, PeerRecord, RecordError
from p2ptrain.planning import Cluster, Device, make_objective
from p2ptrain.planning.simulated import StepProfile, StepWorkload
from p2ptrain.runtime.calibration import calibrate, check_seconds, stage_parameters, step_profile
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import torch_settings
from p2ptrain.verify.config import VerifyConfig

TRAIN = TrainConfig(model="tiny", global_batch_size=40, micro_batches=2, stages=2, replicas=2, wire="fp32")
CHECKS = (0.008, 0.001)  # seconds per million elements: a sketch with its norm, a digest
MEASURED = dataclasses.replace(CODECS_MEASURED, codec_s_per_melement=((0.0, 0.0),) * 3, check_s_per_melement=CHECKS)


def test_calibration_times_the_sum_checks_work():
    with torch_settings(1, True):
        measured = calibrate(TRAIN, rows=2, device=torch.device("cpu"), repeats=2)
    sketch_s, digest_s = measured.check_s_per_melement
    assert sketch_s > 0 and digest_s > 0


def test_the_check_times_travel_in_the_peer_record_and_an_older_record_counts_them_as_zero():
    record = PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, compute=MEASURED)
    assert PeerRecord.decode(record.encode()).compute == MEASURED
    older = {k: v for k, v in MEASURED.to_wire().items() if k != "check_s_per_melement"}
    assert ComputeMeasurement.from_wire(older).check_s_per_melement == (0.0, 0.0)


@pytest.mark.parametrize("garbled", [[0.1], [0.1, 0.2, 0.3], [0.1, -0.2], [0.1, float("nan")], [True, 0.1],
                                     ["0.1", 0.2], "fast", [0.1, 1e9]])
def test_garbled_check_times_are_refused(garbled):
    with pytest.raises(RecordError, match="check_s_per_melement"):
        ComputeMeasurement.from_wire(MEASURED.to_wire() | {"check_s_per_melement": garbled})


def test_the_leader_prices_each_stages_check_from_its_parameters_and_the_group():
    params = stage_parameters(TRAIN.shape, 2)
    # a group of D sketches 2 vectors of a stage's size (its shard's sum and the D contributions, (D + 1)/D, and a
    # difference per other owner, (D − 1)/D), digests (3·2 − 2)/2 = 2; fp32 keeps no running sums; 64 rows as
    # calibrated
    want = tuple((0.008 * 2 + 0.001 * 2) * p / 1e6 for p in params)
    assert check_seconds([MEASURED], VerifyConfig(), TRAIN, params, 2) == pytest.approx(want)
    # a lossy codec's running sums double the sketches; 32 rows halve them; a group of 4 digests 10/4
    lossy = dataclasses.replace(TRAIN, wire="bf16")
    assert check_seconds([MEASURED], VerifyConfig(), lossy, params, 2) == pytest.approx(
        tuple((0.008 * 4 + 0.001 * 2) * p / 1e6 for p in params))
    assert check_seconds([MEASURED], VerifyConfig(sketch_rows=32), TRAIN, params, 4) == pytest.approx(
        tuple((0.004 * 2 + 0.001 * 10 / 4) * p / 1e6 for p in params))
    # in the step profile, in the network's seconds; nothing where no sum check runs
    profile = step_profile([MEASURED], TRAIN, 2, 2, time_scale=0.5, verify=VerifyConfig())
    assert profile.verify_compute_s == pytest.approx(tuple(2 * v for v in want))
    for verify, replicas in ((VerifyConfig(enabled=False), 2), (VerifyConfig(), 1), (None, 2)):
        assert step_profile([MEASURED], TRAIN, 2, replicas, verify=verify).verify_compute_s == ()


def _objective(verify_compute_s=(), verify_gb=(0.0, 0.0), recompute_rate=0.0, latency_ms=0.0):
    n = 4
    off = 1 - np.eye(n)
    cluster = Cluster(tuple(Device(f"d{i}") for i in range(n)), latency_ms * off, 1000.0 * off + np.eye(n))
    profile = StepProfile(micro_batches=4, forward_s=(0.1, 0.15), backward_s=(0.2, 0.3), verify_gb=verify_gb,
                          verify_compute_s=verify_compute_s, recompute_rate=recompute_rate)
    return make_objective("simulated", cluster, StepWorkload(0.0, 0.0, step=profile), 2)


def test_the_objective_adds_each_stages_check_before_its_update():
    sigma = np.array([[0, 1], [2, 3]])
    plain, checked = _objective(), _objective(verify_compute_s=(0.05, 0.07))
    # each stage checks between its all-reduce and its update: stage 0's check lies on the step's chain (its last
    # backward, its check, the next step's first forward: 0.2 + 0.05 + 0.1 s after stage 1's all-reduce), so its
    # 0.05 s lengthen the period; stage 1's 0.07 s fit in those 0.35
    assert checked.simulate(sigma).predicted_s == pytest.approx(plain.simulate(sigma).predicted_s + 0.05, rel=1e-9)
    slow = _objective(verify_compute_s=(0.05, 0.5))  # 0.5 s do not: the next step's stage 1 starts 0.15 s later
    assert slow.simulate(sigma).predicted_s == pytest.approx(plain.simulate(sigma).predicted_s + 0.2, rel=1e-9)
    # the closed form (the search's bound) adds the slowest stage's, whatever the order
    groups, hops = [plain.group_terms(sigma[:, j]).max() for j in range(2)], [0.0]
    assert checked.combine(groups, hops).cost_s == pytest.approx(plain.combine(groups, hops).cost_s + 0.07, rel=1e-9)
    # with one replica no check runs, and none is priced
    one = make_objective("simulated", Cluster((Device("a"), Device("b")), np.zeros((2, 2)), np.ones((2, 2))),
                         StepWorkload(0.0, 0.0, step=StepProfile(forward_s=(0.1, 0.1), verify_compute_s=(0.05, 0.07))), 2)
    bare = make_objective("simulated", Cluster((Device("a"), Device("b")), np.zeros((2, 2)), np.ones((2, 2))),
                          StepWorkload(0.0, 0.0, step=StepProfile(forward_s=(0.1, 0.1))), 2)
    assert one.simulate(np.array([[0, 1]])).predicted_s == pytest.approx(bare.simulate(np.array([[0, 1]])).predicted_s)


def test_where_the_recompute_check_runs_the_sum_check_is_priced_in_the_next_steps_shadow():
    """``verify.sum_shadow``: where the recompute check runs (its rate priced), each step's sum check runs from the
    next step's start and that step's update waits for it: off the period while it fits in the step, and what it
    outlasts the step by on it; the closed form leaves it out."""
    sigma = np.array([[0, 1], [2, 3]])
    rate, rounds = 1 / 8, {"verify_gb": (1e-4, 1e-4), "latency_ms": 20.0}  # 20 ms a link: two rounds, 40 ms
    plain = _objective(recompute_rate=rate, latency_ms=20.0)
    shadowed = _objective(verify_compute_s=(0.05, 0.07), recompute_rate=rate, **rounds)
    assert shadowed.sum_shadow and not _objective(verify_compute_s=(0.05, 0.07), **rounds).sum_shadow
    assert shadowed.simulate(sigma).predicted_s == pytest.approx(plain.simulate(sigma).predicted_s, rel=1e-9)
    # in the hook (no recompute check), the same check lengthens the step by its rounds and stage 0's work
    hooked, bare = _objective(verify_compute_s=(0.05, 0.07), **rounds), _objective(latency_ms=20.0)
    assert hooked.simulate(sigma).predicted_s > bare.simulate(sigma).predicted_s + 0.04 + 0.05 - 1e-9
    # a check longer than the step: the step waits for what is left of it
    long = _objective(verify_compute_s=(5.0, 5.0), recompute_rate=rate, **rounds)
    assert long.simulate(sigma).predicted_s == pytest.approx(5.0 + 0.04 + 0.02 * 0, abs=0.1)
    groups, hops = [plain.group_terms(sigma[:, j]).max() for j in range(2)], [0.0]
    assert shadowed.combine(groups, hops).cost_s == pytest.approx(plain.combine(groups, hops).cost_s, rel=1e-9)


def test_the_layered_workload_prices_each_stages_check_at_its_split():
    """With every trainer's calibration (the leader's usual case) the workload is priced per layer: each stage's
    check from the parameters its split holds, as ``step_profile``'s at an even split."""
    from p2ptrain.planning import Workload
    from p2ptrain.planning.layers import even_layers
    from p2ptrain.runtime.calibration import layered_workload

    layered = layered_workload([MEASURED] * 4, Workload(0.001, 0.01), TRAIN, 2, verify=VerifyConfig())
    even = layered.costs.profile(layered.step, even_layers(TRAIN.shape.num_layers, 2))
    params = stage_parameters(TRAIN.shape, 2)
    assert even.verify_compute_s == pytest.approx(check_seconds([MEASURED], VerifyConfig(), TRAIN, params, 2))
    unchecked = layered_workload([MEASURED] * 4, Workload(0.001, 0.01), TRAIN, 2, verify=VerifyConfig(enabled=False))
    assert unchecked.costs.profile(unchecked.step, even_layers(TRAIN.shape.num_layers, 2)).verify_compute_s == ()
