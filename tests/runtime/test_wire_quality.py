"""The wire benchmark's accounting: bytes per step per kind follow the codecs' exact message sizes."""

import dataclasses

from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.planning import parameter_count
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import wire_bytes
from p2ptrain.runtime.wire_quality import codec_errors, delta_coding_error, step_wire_bytes


def test_step_wire_bytes_follow_the_codecs():
    cfg = TrainConfig(stages=2, replicas=2, global_batch_size=16, micro_batches=2)
    act = cfg.micro_batch_size * cfg.shape.seq_len * cfg.shape.hidden_size
    fp32 = step_wire_bytes(cfg)
    assert fp32["activation"] == fp32["activation_grad"] == 1 * 2 * 2 * act * 4
    assert abs(fp32["all_reduce"] - 2 * 2 * 1 * parameter_count(cfg.shape) / 2 / 2 * 4 * 2) <= 16
    int4 = step_wire_bytes(dataclasses.replace(cfg, wire="int4"))
    assert int4["activation"] == 4 * wire_bytes("int4", act)
    assert int4["activation_grad"] == 4 * wire_bytes("int8", act)
    assert step_wire_bytes(dataclasses.replace(cfg, replicas=1, global_batch_size=8))["all_reduce"] == 0
    int2 = step_wire_bytes(dataclasses.replace(cfg, wire="int2"))
    assert int2["activation"] == 4 * wire_bytes("int2", act)
    assert int2["activation_grad"] == 4 * wire_bytes("int4", act)
    shard = round(parameter_count(cfg.shape) / 2 / 2)
    assert int2["all_reduce"] == 2 * 2 * 1 * wire_bytes("int2", shard) * 2
    diloco_cfg = dataclasses.replace(cfg, wire="int2", sync="diloco", diloco=DiLoCoConfig(inner_steps=10))
    diloco = step_wire_bytes(diloco_cfg)
    assert diloco["all_reduce"] == int(2 * 2 * 1 * wire_bytes("int2", shard) * 2 / 10)
    assert diloco["activation"] == int2["activation"]


def test_delta_coding_error_is_measured():
    cfg = TrainConfig(stages=2, replicas=1, global_batch_size=4, micro_batches=1, seq_len=16)
    err = delta_coding_error(cfg, "int8", steps=3)
    assert 0 < err["direct"] < 0.05 and 0 < err["delta"] < 0.05


def test_codec_errors_order_the_codecs_by_their_bits():
    cfg = TrainConfig(stages=2, replicas=1, global_batch_size=4, micro_batches=1, seq_len=16)
    err = codec_errors(cfg, ["int8", "int4", "int2"], steps=2)
    for kind in ("activation", "activation_grad"):
        assert 0 < err["int8"][kind] < err["int4"][kind] < err["int2"][kind] < 0.5
