import pytest

from p2ptrain.planning import (
    PAPER_WORKLOAD,
    ModelShape,
    Workload,
    model_shape,
    parameter_count,
    workload_from_model,
)


def test_paper_preset_is_the_public_constants():
    assert (PAPER_WORKLOAD.activation_gb, PAPER_WORKLOAD.gradient_gb) == (0.471249, 0.65)


def test_volumes_by_hand():
    shape = ModelShape(num_layers=4, hidden_size=8, num_heads=2, seq_len=16, vocab_size=32)
    # per block 12·64 + 13·8 = 872; embeddings 32·8 + 16·8 = 384; final LayerNorm 16; head 256
    assert parameter_count(shape) == 4 * 872 + 384 + 16 + 256
    w = workload_from_model(shape, num_stages=2, num_replicas=4, batch_tokens=1000)
    assert w.activation_gb == pytest.approx(250 * 8 * 2 / 1e9)  # 250 tokens a shard × hidden × fp16
    assert w.gradient_gb == pytest.approx(parameter_count(shape) / 2 * 4 / 1e9)


def test_gpt3_xl_is_close_to_the_paper():
    w = workload_from_model(model_shape("gpt3-xl"), num_stages=8, num_replicas=8)
    assert 1.3e9 < parameter_count(model_shape("gpt3-xl")) < 1.45e9
    assert w.activation_gb == pytest.approx(0.512)  # 125,000 tokens × 2048 × 2 bytes
    assert w.gradient_gb == pytest.approx(0.65, rel=0.1)


def test_overrides_and_refusals():
    w = PAPER_WORKLOAD.with_overrides(gradient_gb=2.0)
    assert (w.activation_gb, w.gradient_gb) == (0.471249, 2.0)
    assert PAPER_WORKLOAD.with_overrides() is PAPER_WORKLOAD
    with pytest.raises(ValueError, match="activation_gb"):
        Workload(activation_gb=-1.0, gradient_gb=1.0)
    with pytest.raises(ValueError, match="only 8 layers"):
        workload_from_model(model_shape("tiny"), num_stages=16, num_replicas=1)
    with pytest.raises(ValueError, match="num_replicas"):
        workload_from_model(model_shape("tiny"), num_stages=2, num_replicas=0)
