"""The wire codecs' CPU time in the calibration (issue 31): what an agent times for its run's wire, how it
travels in its peer record (an older agent's record without it still accepted, a garbled one refused), and
how the leader turns it into the step profile's seconds per GB."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.net.dht.records import ComputeMeasurement, PeerRecord, RecordError
from p2ptrain.planning.workload import GB, Workload
from p2ptrain.runtime.calibration import calibrate, codec_costs, layered_workload, step_profile
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import torch_settings

TRAIN = TrainConfig(model="tiny", global_batch_size=40, micro_batches=2, stages=4, replicas=2, wire="int2")
CODECS = ((0.02, 0.004), (0.004, 0.003), (0.017, 0.002))  # seconds per million elements: int2's kinds
MEASURED = ComputeMeasurement(rows=10, seq_len=64, layer_s=(0.002, 0.004), embed_s=(0.001, 0.003),
                              head_s=(0.0005, 0.001), update_s_per_mparam=0.02, message_s=0.0003,
                              codec_s_per_melement=CODECS)


def test_calibration_times_the_run_wire_codecs_and_fp32_is_free():
    with torch_settings(1, True):
        int2 = calibrate(TRAIN, rows=2, device=torch.device("cpu"), repeats=2)
        fp32 = calibrate(dataclasses.replace(TRAIN, wire="fp32"), rows=2, device=torch.device("cpu"), repeats=2)
    assert all(encode > 0 and decode > 0 for encode, decode in int2.codec_s_per_melement)
    # (which codec is dearer is a timing, measured in benchmarks/, never asserted here: CI's load reorders them)
    assert fp32.codec_s_per_melement == ((0.0, 0.0),) * 3  # its cost is the message cost's already


def test_the_codec_times_travel_in_the_peer_record():
    record = PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, compute=MEASURED)
    assert PeerRecord.decode(record.encode()).compute == MEASURED
    assert MEASURED.to_wire()["codec_s_per_melement"] == [list(pair) for pair in CODECS]


def test_an_older_agents_record_without_codec_times_counts_them_as_zero():
    older = {k: v for k, v in MEASURED.to_wire().items() if k != "codec_s_per_melement"}
    decoded = ComputeMeasurement.from_wire(older)
    assert decoded.codec_s_per_melement == ((0.0, 0.0),) * 3
    assert dataclasses.replace(decoded, codec_s_per_melement=CODECS) == MEASURED


@pytest.mark.parametrize("garbled", [
    [[0.1, 0.2], [0.1, 0.2]],  # a kind missing
    [[0.1, 0.2], [0.1, 0.2], [0.1, 0.2], [0.1, 0.2]],  # one too many
    [[0.1], [0.1, 0.2], [0.1, 0.2]],  # not a pair
    [[0.1, -0.2], [0.1, 0.2], [0.1, 0.2]],  # negative
    [[0.1, float("nan")], [0.1, 0.2], [0.1, 0.2]],
    [[0.1, True], [0.1, 0.2], [0.1, 0.2]],  # a bool is no number
    [["0.1", 0.2], [0.1, 0.2], [0.1, 0.2]],
    "fast",
    {"activation": [0.1, 0.2]},
    [[0.1, 1e9], [0.1, 0.2], [0.1, 0.2]],  # past any sane device
])
def test_garbled_codec_times_are_refused(garbled):
    with pytest.raises(RecordError, match="codec_s_per_melement"):
        ComputeMeasurement.from_wire({**MEASURED.to_wire(), "codec_s_per_melement": garbled})


def test_the_step_profile_prices_the_codecs_per_gb_of_the_workload_in_network_seconds():
    """Median over the members (an older agent's zeros count), seconds per million elements to seconds per GB
    of the workload (GB · size_factor / 4 float32 elements), real seconds to the network's (÷ time_scale)."""
    older = ComputeMeasurement.from_wire({k: v for k, v in MEASURED.to_wire().items() if k != "codec_s_per_melement"})
    twice = dataclasses.replace(MEASURED, codec_s_per_melement=tuple((2 * e, 2 * d) for e, d in CODECS))
    size_factor, time_scale = 0.01, 0.1
    profile = step_profile([MEASURED, twice, older], TRAIN, 4, 2, time_scale=time_scale, size_factor=size_factor)
    per_gb = GB * size_factor / 4 * 1e-6 / time_scale  # (s per million elements) → network s per workload GB
    assert profile.encode_s_per_gb == pytest.approx(tuple(e * per_gb for e, _ in CODECS))
    assert profile.decode_s_per_gb == pytest.approx(tuple(d * per_gb for _, d in CODECS))
    assert codec_costs([], size_factor) == {"encode_s_per_gb": (0.0,) * 3, "decode_s_per_gb": (0.0,) * 3}
    assert step_profile([], TRAIN, 4, 2).encode_s_per_gb == (0.0,) * 3


def test_the_layered_workload_carries_the_codecs_too():
    slow = dataclasses.replace(MEASURED, layer_s=(0.004, 0.008))
    layered = layered_workload([MEASURED, slow], Workload(0.1, 0.2), TRAIN, 2, time_scale=0.5, size_factor=2.0)
    per_gb = GB * 2.0 / 4 * 1e-6 / 0.5
    assert layered.step.encode_s_per_gb == pytest.approx(tuple(e * per_gb for e, _ in CODECS))
    assert layered.at(((0, 2), (2, 4), (4, 6), (6, 8))).step.decode_s_per_gb == pytest.approx(tuple(d * per_gb for _, d in CODECS))
