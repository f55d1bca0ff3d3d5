"""The per-layer workload model and the memory check, computed by hand for a small model."""

import pytest

from p2ptrain.planning import Cluster, Device, Infeasible, ModelShape, parameter_count, schedule
from p2ptrain.planning.layers import LayerCosts, LayeredWorkload, compute_parts, layer_model
from p2ptrain.planning.simulated import StepProfile

# 4 blocks, h = 8, 2 heads, T = 4, V = 16; micro-batches of 8 tokens (2 sequences), M = 2, fp32 activations
SHAPE = ModelShape(num_layers=4, hidden_size=8, num_heads=2, seq_len=4, vocab_size=16)


def model(recompute=False):
    return layer_model(SHAPE, micro_batch_tokens=8, micro_batches=2, activation_bytes=4, recompute=recompute)


def test_parameters_and_flops_by_hand():
    m = model()
    assert m.parameters.block == 12 * 64 + 13 * 8 == 872
    assert m.parameters.embeddings == 16 * 8 + 4 * 8 == 160
    assert m.parameters.head == 2 * 8 + 8 * 16 == 144
    assert 4 * 872 + 160 + 144 == parameter_count(SHAPE)  # the parts add up to the whole model
    assert m.forward_flops.block == 2 * 8 * (12 * 64 + 2 * 4 * 8) == 13312
    assert m.forward_flops.head == 2 * 8 * 8 * 16 == 2048
    forward, backward = compute_parts(m, reference_tflops=1e-9, utilisation=0.5)  # 500 FLOP/s
    assert forward.block == pytest.approx(13312 / 500)
    assert backward.head == pytest.approx(2 * 2048 / 500)


def test_llama_parts_by_hand():
    """No biases, RMSNorm gains only, no position embeddings, SwiGLU's three matrices, GQA's narrower k, v."""
    shape = ModelShape(num_layers=4, hidden_size=8, num_heads=2, seq_len=4, vocab_size=16, family="llama",
                       num_kv_heads=1, ffn_hidden_size=16)
    m = layer_model(shape, micro_batch_tokens=8, micro_batches=2, activation_bytes=4)
    # a block: q, k, v 8·(8 + 2·4) = 128, out 64, gate/up/down 3·8·16 = 384, two gains 16 -> 592
    assert (m.parameters.block, m.parameters.embeddings, m.parameters.head) == (592, 16 * 8, 8 + 8 * 16)
    assert 4 * 592 + 128 + 136 == parameter_count(shape)
    assert m.forward_flops.block == 2 * 8 * ((128 + 64 + 384) + 2 * 4 * 8) == 10240
    # activations per token 17h + 8f + 5aT = 136 + 128 + 40 = 304 values at 2 bytes, here 4: ×2; 8 tokens, M = 2
    assert m.memory_bytes.block == 16 * 592 + 2 * 8 * 304 * 4 / 2
    gpt = layer_model(ModelShape(num_layers=4, hidden_size=8, num_heads=2, seq_len=4, vocab_size=16,
                                 ffn_hidden_size=48), micro_batch_tokens=8, micro_batches=2, activation_bytes=4)
    assert gpt.parameters.block == 4 * 64 + 2 * 8 * 48 + 48 + 9 * 8  # a gpt MLP of another width
    assert gpt.memory_bytes.block == 16 * gpt.parameters.block + 2 * 8 * (18 * 8 + 4 * 48 + 40) * 4 / 2


def test_stage_memory_by_hand():
    # a block: 16 bytes a parameter (weights, gradients, two AdamW moments) = 13952, and per micro-batch
    # 8 tokens × (34·8 + 5·2·4) values × 4 bytes / 2 = 4992, kept for both micro-batches: 9984 → 23936.
    # embeddings: 16 × 160 = 2560. head: 16 × 144 = 2304 + 2 × 8 × (2·8·4 + 8·16) = 3072 → 5376.
    m = model()
    assert (m.memory_bytes.block, m.memory_bytes.embeddings, m.memory_bytes.head) == (23936, 2560, 5376)
    assert m.stage_memory_gb(((0, 1), (1, 4))) == pytest.approx((26496e-9, 77184e-9))
    assert m.stage_memory_gb(((0, 3), (3, 4))) == pytest.approx((74368e-9, 29312e-9))
    # recomputation keeps each block's input (8 tokens × 8 values × 4 bytes a micro-batch) and one
    # micro-batch's full working set on every stage; the head its input twice and its logits once
    r = model(recompute=True)
    assert r.memory_bytes.block == 13952 + 2 * 256
    assert r.memory_bytes.head == 2304 + 2 * 256 + 8 * (2 * 8 * 4 + 8 * 16)
    assert r.stage_extra_bytes == 4992
    assert r.stage_memory_gb(((0, 4),)) == pytest.approx(((4 * (13952 + 512) + 2560 + 2304 + 512 + 1536 + 4992) * 1e-9,))


def two_devices(cap_a_gb: float, cap_b_gb: float) -> tuple[Cluster, LayeredWorkload]:
    m = model()
    costs = LayerCosts(num_layers=4, forward_s=m.forward_flops.scaled(1e-6), backward_s=m.forward_flops.scaled(2e-6),
                       update_s=m.parameters.scaled(0.0), gradient_gb=m.parameters.scaled(4e-9),
                       memory_gb=m.memory_bytes.scaled(1e-9))
    devices = (Device("a", tflops=10.0, memory_gb=cap_a_gb), Device("b", tflops=10.0, memory_gb=cap_b_gb))
    cluster = Cluster(devices, [[0, 10.0], [10.0, 0]], [[0, 1.0], [1.0, 0]])
    return cluster, LayeredWorkload(1e-6, 0.0, step=StepProfile(micro_batches=2, reference_tflops=10.0), costs=costs)


def test_the_memory_check_accepts_the_only_split_that_fits():
    # a: 28 KB fits one block and the embeddings (26.5 KB) but not the last block and the head (29.3 KB);
    # b: 80 KB fits three blocks and the head (77.2 KB). So: a holds stage 0 = block 0, b the rest.
    cluster, workload = two_devices(28e-6, 80e-6)
    plan = schedule(cluster, workload, 2, objective="simulated")
    assert plan.layers == ((0, 1), (1, 4))
    assert plan.pipelines == ((0, 1),)
    assert plan.stage_memory_gb == pytest.approx((26496e-9, 77184e-9))
    doc = plan.to_json()
    assert doc["layers"] == [[0, 1], [1, 4]] and doc["schedule"] == "gpipe"


def test_the_memory_check_refuses_what_does_not_fit_naming_stage_and_shortfall():
    cluster, workload = two_devices(28e-6, 77e-6)  # b is 184 bytes short of stage 1 (77184 B)
    plan = schedule(cluster, workload, 2, objective="simulated")
    assert isinstance(plan, Infeasible)
    assert "\n" not in plan.reason
    assert "stage 1 (blocks 1-3) needs 7.72e-05 GB" in plan.reason
    assert "b has 7.7e-05 GB (1.84e-07 GB short)" in plan.reason


def test_without_memory_limits_any_split_fits():
    cluster, workload = two_devices(28e-6, 80e-6)
    free = Cluster(tuple(Device(d.name, tflops=d.tflops) for d in cluster.devices), cluster.latency_ms,
                   cluster.bandwidth_gbps)
    plan = schedule(free, workload, 2, objective="simulated")
    assert plan.layers is not None and not isinstance(plan, Infeasible)
