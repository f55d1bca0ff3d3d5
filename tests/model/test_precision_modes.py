"""Precision: bf16 and fp16 autocast with fp32 master weights train close to fp32; fp32 and activation
checkpointing stay exact; the CUDA cases need a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.model.optim import OptimizerConfig, build_optimizer
from p2ptrain.model.precision import ScaledAdamW
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU path runs only on a machine with a GPU")


@pytest.fixture(scope="module")
def fp32_run():
    return train_reference(TrainConfig(steps=50, global_batch_size=8, num_threads=1))


@pytest.mark.timeout(400)
def test_bf16_on_cpu_stays_within_two_percent_of_fp32_over_50_steps(fp32_run):
    bf16 = train_reference(TrainConfig(steps=50, global_batch_size=8, num_threads=1, precision="bf16"))
    assert all(abs(b - f) <= 0.02 * f for b, f in zip(bf16.losses, fp32_run.losses, strict=True))
    assert bf16.losses[-1] < bf16.losses[0] - 0.5  # it learns
    assert all(t.dtype == torch.float32 for t in bf16.state.values())  # master weights stay fp32


def test_checkpointing_recomputes_exactly_in_fp32(fp32_run):
    cfg = TrainConfig(steps=50, global_batch_size=8, num_threads=1)  # the first 3 steps of fp32_run's run
    plain = train_reference(cfg, stop_after=3)
    recomputed = train_reference(dataclasses.replace(cfg, activation_checkpointing=True), stop_after=3)
    assert recomputed.losses == plain.losses == fp32_run.losses[:3]
    assert all(torch.equal(recomputed.state[k], plain.state[k]) for k in plain.state)


def test_fp16_loss_scaling_keeps_true_gradients_and_skips_overflowing_steps():
    shape = model_shape("tiny")
    model = GPT(shape, seed=0, precision="fp16")
    optimizer = build_optimizer(model, OptimizerConfig().for_model("tiny"))
    assert isinstance(optimizer, ScaledAdamW) and model.loss_scaler.scale == 2.0**16
    reference = GPT(shape, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).float().logsumexp(-1).mean().backward()
    reference(tokens).logsumexp(-1).mean().backward()
    head, want = model.head.weight.grad / model.loss_scaler.scale, reference.head.weight.grad
    assert (head - want).norm() <= 0.05 * want.norm()  # scaled by S inside the stage, fp16 matmuls
    before = model.head.weight.detach().clone()
    model.head.weight.grad[0, 0] = float("inf")
    optimizer.step()
    assert torch.equal(model.head.weight, before) and model.loss_scaler.scale == 2.0**15  # skipped, halved


def test_a_stage_sends_fp32_whatever_its_precision():
    stage = GPT(model_shape("tiny"), range(0, 4), seed=0, precision="bf16")
    out = stage(torch.zeros(2, 8, dtype=torch.long))
    assert out.dtype == torch.float32 and out.shape == (2, 8, 64)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")


@needs_cuda
def test_cuda_fp32_equals_cpu_and_bf16_is_close():
    cfg = TrainConfig(steps=5, global_batch_size=8)
    cpu = train_reference(dataclasses.replace(cfg, device="cpu"))
    cuda = train_reference(dataclasses.replace(cfg, device="cuda"))
    bf16 = train_reference(dataclasses.replace(cfg, device="cuda", precision="bf16"))
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(cuda.losses, cpu.losses, strict=True))
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(bf16.losses, cpu.losses, strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_adamw_is_fused_on_cuda_only(device):
    model = GPT(model_shape("tiny"), seed=0).to(device)
    optimizer = build_optimizer(model, OptimizerConfig().for_model("tiny"))
    assert bool(optimizer.defaults.get("fused")) == (device == "cuda")
    model(torch.zeros(2, 8, dtype=torch.long, device=device)).sum().backward()
    optimizer.step()  # the fused kernel runs where it is chosen
