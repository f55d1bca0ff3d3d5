"""Model FLOPs and MFU: PaLM's count (6·N over the multiplying parameters + attention), the peak's source."""

from __future__ import annotations

import pytest

from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.planning.workload import parameter_count
from p2ptrain.runtime.throughput import flops_per_token, peak_tflops, throughput


def test_flops_per_token_counts_matmul_parameters_and_attention():
    shape = model_shape("gpt3-xl")
    n = parameter_count(shape) - (shape.vocab_size + shape.seq_len) * shape.hidden_size
    assert flops_per_token(shape) == 6 * n + 12 * 24 * 2048 * 2048
    assert 6 * 1.2e9 < flops_per_token(shape) < 6 * 1.6e9  # ~1.3e9 parameters: the paper's model


def test_peak_prefers_the_data_sheet_of_a_known_gpu_at_the_run_precision():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 50.0) == (989.0, "datasheet")
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp32", None) == (19.5, "datasheet")
    assert peak_tflops("cpu: AMD EPYC", "fp32", 0.3) == (0.3, "measured")
    assert peak_tflops("cpu: AMD EPYC", "fp32", None) == (None, "unknown")


def test_mfu_is_achieved_over_peak_times_devices():
    shape = model_shape("tiny")
    tokens = 1_000_000
    speed = throughput(shape, tokens, 10.0, (1.0, "measured"), num_devices=2)
    assert speed.tokens_per_s == pytest.approx(100_000)
    assert speed.mfu == pytest.approx(100_000 * flops_per_token(shape) / 1e12 / 2)
    assert throughput(shape, tokens, 10.0, (None, "unknown")).mfu is None
    assert "MFU n/a" in throughput(shape, tokens, 10.0, (None, "unknown")).line()
