"""Calibration: what an agent times on its device, how it travels in its peer record, and the step profile
the leader builds from it."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.errors import ConfigError
from p2ptrain.model.gpt import GPT
from p2ptrain.net.dht.records import ComputeMeasurement, PeerRecord, RecordError
from p2ptrain.planning import StepProfile
from p2ptrain.runtime.calibration import calibrate, expected_rows, stage_parameters, step_profile
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import torch_settings

TRAIN = TrainConfig(model="tiny", global_batch_size=40, micro_batches=2, stages=4, replicas=2)
MEASURED = ComputeMeasurement(rows=10, seq_len=64, layer_s=(0.002, 0.004), embed_s=(0.001, 0.003),
                              head_s=(0.0005, 0.001), update_s_per_mparam=0.02, message_s=0.0003)


def test_calibrate_times_the_model_on_this_device():
    with torch_settings(1, True):
        measured = calibrate(TRAIN, rows=10, device=torch.device("cpu"), repeats=3)
    assert (measured.rows, measured.seq_len) == (10, 64)
    assert measured.layer_s[0] > 0 and measured.layer_s[1] > 0
    assert min(measured.embed_s + measured.head_s) >= 0
    assert measured.update_s_per_mparam > 0 and measured.message_s > 0


def test_a_measurement_travels_in_the_peer_record_and_bad_ones_are_refused():
    record = PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1, compute=MEASURED)
    assert PeerRecord.decode(record.encode()).compute == MEASURED
    assert PeerRecord.decode(PeerRecord(device_name="cpu", memory_gb=8.0, tflops=0.1).encode()).compute is None
    with pytest.raises(RecordError, match="layer_s"):
        ComputeMeasurement.from_wire({**MEASURED.to_wire(), "layer_s": [0.1, -1.0]})
    with pytest.raises(RecordError, match="missing field"):
        ComputeMeasurement.from_wire({k: v for k, v in MEASURED.to_wire().items() if k != "message_s"})


def test_step_profile_composes_stages_from_blocks_and_ends():
    # tiny: 8 blocks on 4 stages, 2 each; the first adds the embeddings, the last the head and loss; 4 agents
    # measured, one of them twice as slow: the median ignores it
    slow = ComputeMeasurement(**{**MEASURED.__dict__, "layer_s": (0.004, 0.008)})
    profile = step_profile([MEASURED, MEASURED, MEASURED, slow], TRAIN, 4, 2)
    assert profile.micro_batches == 2
    assert profile.forward_s == pytest.approx((2 * 0.002 + 0.001, 0.004, 0.004, 2 * 0.002 + 0.0005))
    assert profile.backward_s == pytest.approx((2 * 0.004 + 0.003, 0.008, 0.008, 2 * 0.004 + 0.001))
    params = stage_parameters(TRAIN.shape, 4)
    assert sum(params) == GPT(TRAIN.shape, device="meta").num_parameters()
    assert profile.update_s == pytest.approx(tuple(p * 0.02e-6 for p in params))
    # gradients: fp32 parameters, plus the loss on the last stage, in GB
    assert profile.gradient_gb == pytest.approx(tuple((p + (j == 3)) * 4e-9 for j, p in enumerate(params)))
    assert profile.message_s == pytest.approx(0.0003)


def test_step_profile_scales_rows_time_and_size():
    # one replica instead of two: micro-batches of 20 rows, twice the measured 10; emulation factors convert
    # real seconds and bytes to the network's
    profile = step_profile([MEASURED], TRAIN, 4, 1, boundary_s=0.05, time_scale=0.1, size_factor=0.01)
    base = step_profile([MEASURED], TRAIN, 4, 2)
    assert profile.forward_s == pytest.approx(tuple(2 * f / 0.1 for f in base.forward_s))
    assert profile.boundary_s == pytest.approx(0.5) and profile.message_s == pytest.approx(0.003)
    assert profile.gradient_gb == pytest.approx(tuple(g / 0.01 for g in base.gradient_gb))
    empty = step_profile([], TRAIN, 4, 2)
    assert empty.forward_s == () and empty.gradient_gb == base.gradient_gb and isinstance(empty, StepProfile)


def test_expected_rows_follow_the_replicas_the_batch_splits_into():
    assert expected_rows(TRAIN, 8) == 10  # 2 replicas × 2 micro-batches
    assert expected_rows(TRAIN, 4) == 20  # 1 replica
    # 8 peers, 2 stages: 4 replicas do not split 12 sequences into 2 micro-batches each; 3 do
    assert expected_rows(TrainConfig(model="tiny", global_batch_size=12, micro_batches=2, stages=2), 8) == 2


def test_the_sum_checks_messages_are_priced_at_their_sizes_on_the_wire():
    """Two stages of tiny hold one bucket each: a group of two sends a 4700-byte commit and a 7772-byte sketch
    statement (64 rows; with the running sums a lossy gradient codec checks; 6236 bytes at 32 rows, as the
    emulated e2e run's transport counted them in session 30), 6204 bytes under fp32 (no running sums: 196
    float64s fewer), in the network's GB; no check, no volume."""
    from p2ptrain.model.outer import DiLoCoConfig
    from p2ptrain.planning.workload import GB
    from p2ptrain.runtime.calibration import verify_volumes
    from p2ptrain.verify.config import VerifyConfig

    train = TrainConfig(model="tiny", stages=2, replicas=2, global_batch_size=16, micro_batches=2, wire="bf16")
    assert verify_volumes(VerifyConfig(), train, 2, 2, size_factor=0.5) == {
        "verify_gb": pytest.approx((4700 / GB / 0.5, 7772 / GB / 0.5)), "recompute_rate": 1 / 8}
    assert step_profile([], train, 2, 2, verify=VerifyConfig()).verify_gb == pytest.approx((4700 / GB, 7772 / GB))
    exact = TrainConfig(model="tiny", stages=2, replicas=2, global_batch_size=16, micro_batches=2, wire="fp32")
    assert verify_volumes(VerifyConfig(), exact, 2, 2)["verify_gb"] == pytest.approx((4700 / GB, 6204 / GB))
    diloco = TrainConfig(model="tiny", stages=2, replicas=2, global_batch_size=16, micro_batches=2, sync="diloco",
                         diloco=DiLoCoConfig(inner_steps=5))
    for args in ((VerifyConfig(enabled=False), train, 2, 2), (VerifyConfig(), train, 2, 1),
                 (VerifyConfig(), diloco, 2, 2), (None, train, 2, 2)):
        assert verify_volumes(*args) == {}


def test_the_recompute_checks_rate_is_priced_where_the_runtime_installs_it():
    """``agent.epoch._install_verifier``: with the sum check, on two stages or more, not fp16; else no rate (the
    profile's 0: no recompute check)."""
    from p2ptrain.model.outer import DiLoCoConfig
    from p2ptrain.runtime.calibration import verify_volumes
    from p2ptrain.verify.config import VerifyConfig

    def train(**settings):
        return TrainConfig(**{"model": "tiny", "stages": 2, "replicas": 2, "global_batch_size": 16,
                              "micro_batches": 2} | settings)

    assert verify_volumes(VerifyConfig(rate=0.5), train(), 2, 2)["recompute_rate"] == 0.5
    assert verify_volumes(VerifyConfig(), train(precision="bf16"), 3, 2)["recompute_rate"] == 1 / 8
    assert step_profile([], train(), 2, 2, verify=VerifyConfig()).recompute_rate == 1 / 8
    # each member recomputed by ``verifiers`` (2) replicas, at most the D − 1 others: twice the work and reveals
    assert verify_volumes(VerifyConfig(), train(replicas=3, global_batch_size=24), 2, 3)["recompute_rate"] == 2 / 8
    assert verify_volumes(VerifyConfig(verifiers=1), train(replicas=3, global_batch_size=24), 2, 3)["recompute_rate"] == 1 / 8
    assert VerifyConfig().identity() == "64_40_0.125_1" and VerifyConfig(verifiers=3).identity() == "64_40_0.125_1_v3"
    for bad in (0, 9, 1.5, True):
        with pytest.raises(ConfigError, match="verify.verifiers"):
            VerifyConfig(verifiers=bad)
    assert "recompute_rate" not in verify_volumes(VerifyConfig(), train(precision="fp16"), 2, 2)
    assert "recompute_rate" not in verify_volumes(VerifyConfig(), train(stages=1, replicas=4), 1, 4)  # no pipeline
    assert "verify_gb" in verify_volumes(VerifyConfig(), train(stages=1, replicas=4), 1, 4)  # the sum check still
    diloco = train(sync="diloco", diloco=DiLoCoConfig(inner_steps=5))
    for args in ((VerifyConfig(enabled=False), train(), 2, 2), (VerifyConfig(), train(), 2, 1),
                 (VerifyConfig(), diloco, 2, 2), (None, train(), 2, 2)):
        assert "recompute_rate" not in verify_volumes(*args)
    assert step_profile([], train(), 2, 2).recompute_rate == 0.0
