"""Single-process reference training: determinism, learning, split invariance, config, final state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.config import config_from_dict
from p2ptrain.errors import ConfigError
from p2ptrain.model.gpt import GPT
from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import StepReport, reference_state, resolve_device, train_reference

# Small enough for milliseconds per step on a shared CPU.
FAST = TrainConfig(steps=4, global_batch_size=8, micro_batches=2, seq_len=32, device="cpu", num_threads=1)


def test_two_runs_give_the_same_losses_and_parameters_bit_for_bit():
    a, b = train_reference(FAST), train_reference(FAST)
    assert a.losses == b.losses
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert len(a.step_time_s) == FAST.steps and all(t > 0 for t in a.step_time_s)


def test_tiny_learns_the_builtin_corpus_in_twenty_steps():
    losses = train_reference(dataclasses.replace(FAST, steps=20)).losses
    assert losses[0] == pytest.approx(5.55, abs=0.15)  # ln 256: uniform over bytes at the start
    assert max(losses[-3:]) < 0.8 * losses[0]


@pytest.mark.parametrize("replicas, micro", [(1, 1), (2, 2), (4, 1), (1, 8)])
def test_losses_do_not_depend_on_how_the_batch_is_split(replicas, micro):
    """The exactness contract at the reference level: a split reorders float32 sums, nothing more."""
    base = dataclasses.replace(FAST, steps=10, micro_batches=1)
    expected = train_reference(base)
    got = train_reference(dataclasses.replace(base, replicas=replicas, micro_batches=micro))
    for step, (x, y) in enumerate(zip(got.losses, expected.losses, strict=True)):
        assert x == pytest.approx(y, rel=1e-4), f"step {step}"
    # Adam divides by sqrt(v): where a gradient is almost 0, float noise can move an element by up to lr
    # per step, so parameters are compared by the whole model's norm, single elements bounded by lr.
    diff = torch.cat([(got.state[k] - v).flatten() for k, v in expected.state.items()])
    reference = torch.cat([v.flatten() for v in expected.state.values()])
    assert diff.norm() <= 1e-4 * reference.norm()
    assert diff.abs().max() <= base.optimizer.lr


def test_on_step_sees_every_step_as_reported():
    reports: list[StepReport] = []
    result = train_reference(FAST, on_step=reports.append)
    assert [r.step for r in reports] == list(range(FAST.steps))
    assert [r.loss for r in reports] == result.losses
    assert [r.step_time_s for r in reports] == result.step_time_s


def test_reference_state_after_k_steps():
    initial = GPT(FAST.shape, seed=FAST.seed).state_dict()
    at_zero = reference_state(FAST, 0)
    assert all(torch.equal(at_zero[k], initial[k]) for k in initial)
    at_two = reference_state(FAST, 2)
    trained = train_reference(FAST, stop_after=2).state
    assert all(torch.equal(at_two[k], trained[k]) for k in initial)
    assert not torch.equal(at_two["head.weight"], initial["head.weight"])


def test_torch_settings_are_restored_after_training():
    threads, mode = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    train_reference(dataclasses.replace(FAST, steps=1, num_threads=threads + 1, deterministic=not mode))
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == mode


def test_config_round_trips_through_plain_data():
    cfg = dataclasses.replace(FAST, data="corpus/", optimizer=OptimizerConfig(lr=1e-3))
    assert config_from_dict(TrainConfig, cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config key optimizer.momentum"):
        config_from_dict(TrainConfig, {"optimizer": {"momentum": 0.9}})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model": "huge"}, "unknown model preset"),
        ({"steps": 0}, "steps must be at least 1"),
        ({"global_batch_size": 6, "micro_batches": 4}, "does not split"),
        ({"replicas": 3}, "does not split"),
        ({"stages": 9}, "cannot cut 8 layers into 9 stages"),
        ({"seed": -1}, "seed must be non-negative"),
        ({"device": "tpu"}, "'tpu' is not one of"),
        ({"optimizer": {"lr": 0.0}}, "lr must be positive"),
    ],
)
def test_bad_configs_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        config_from_dict(TrainConfig, {**FAST.to_dict(), **changes})
    assert "\n" not in str(error.value)


def test_the_config_knows_the_shape_and_micro_batch_size():
    cfg = TrainConfig(global_batch_size=24, replicas=2, micro_batches=3, stages=4, seq_len=40)
    assert cfg.shape.seq_len == 40 and cfg.shape.num_layers == 8
    assert cfg.micro_batch_size == 4 and cfg.is_distributed
    assert not TrainConfig().is_distributed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is absent")
def test_asking_for_cuda_without_cuda_is_a_one_line_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
