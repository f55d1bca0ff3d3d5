"""Learning-rate schedules (``p2ptrain.model.lr_schedule``): the formula the docs give, the settings
refused in one line, and the rate each update of a run uses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from p2ptrain.model.lr_schedule import lr_at, set_lr
from p2ptrain.model.optim import OptimizerConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference


def test_warmup_then_cosine_linear_and_wsd_follow_the_documented_formula():
    lr, floor, n, w = 1e-3, 1e-4, 20, 5
    warm = [lr_at(s, n, lr, "cosine", w, floor) for s in range(w)]
    assert warm == pytest.approx([lr * (s + 1) / w for s in range(w)])  # the first update already moves
    assert lr_at(w, n, lr, "cosine", w, floor) == pytest.approx(lr)  # the peak right after the warm-up
    mid = w + (n - w) / 2
    assert lr_at(int(mid), n, lr, "cosine", w, floor) == pytest.approx(floor + (lr - floor) * (1 + math.cos(
        math.pi * (int(mid) - w) / (n - w))) / 2)
    assert lr_at(n, n, lr, "cosine", w, floor) == pytest.approx(floor)  # the floor one past the last update
    cosine = [lr_at(s, n, lr, "cosine", w, floor) for s in range(w, n)]
    assert all(a > b for a, b in zip(cosine, cosine[1:], strict=False))
    assert lr_at(w + 3, n, lr, "linear", w, floor) == pytest.approx(floor + (lr - floor) * (1 - 3 / (n - w)))
    # wsd: the peak until the last 20 % of the run, then linear to the floor
    wsd = [lr_at(s, n, lr, "wsd", w, floor, decay_fraction=0.2) for s in range(n)]
    assert wsd[w:16] == pytest.approx([lr] * (16 - w)) and wsd[16] == pytest.approx(lr)
    assert all(a > b for a, b in zip(wsd[16:], wsd[17:], strict=False)) and wsd[-1] > floor
    assert [lr_at(s, n, lr) for s in range(n)] == [lr] * n  # constant, no warm-up: today's behaviour
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    set_lr(optimizer, 5e-4)
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4]


@pytest.mark.parametrize("changes, message", [
    (dict(lr_schedule="step"), "optimizer.lr_schedule='step' is not one of constant, cosine, linear, wsd"),
    (dict(min_lr=1.0, lr=0.002), "optimizer.min_lr=1.0 must be in [0, lr=0.002]"),
    (dict(warmup_steps=-1), "optimizer.warmup_steps must be a non-negative integer"),
    (dict(warmup_floor_steps=-1), "optimizer.warmup_floor_steps must be a non-negative integer"),
    (dict(decay_fraction=0.0), "optimizer.decay_fraction=0.0 must be in (0, 1]"),
])
def test_bad_schedule_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        OptimizerConfig(**changes)
    with pytest.raises(ValueError, match="optimizer.warmup_steps=11 exceeds the run's 10 steps"):
        TrainConfig(steps=10, optimizer=OptimizerConfig(warmup_steps=11))


@pytest.mark.parametrize("model, floor", [("tiny", 0), ("gpt2", 750), ("gpt3-xl", 375), ("llama-1b", 2000)])
def test_a_large_presets_warm_up_has_a_floor_that_a_short_run_scales_down(model, floor):
    """1 % of the run, at least the reference's updates, and a run too short for those warms up over a tenth of
    itself: a 50-update gpt3-xl run warms up over 5 updates (1 % rounds to none: the loss blew up from 11.4 to
    18.1 in benchmarks/large_presets.py). The toy presets keep 10 % and no floor."""
    cfg = OptimizerConfig().for_model(model)
    assert cfg.warmup_floor_steps == floor
    share = 0.1 if model == "tiny" else 0.01
    for steps in (1, 6, 50, 1000, 20_000, 500_000):
        want = max(round(share * steps), min(floor, -(-steps // 10)))
        assert cfg.warmup_for(steps) == min(steps, want), (steps, cfg.warmup_for(steps))
    if floor:
        assert cfg.warmup_for(50) == 5 and cfg.warmup_for(500_000) == 5000 and cfg.warmup_for(20_000) == max(floor, 200)
        assert cfg.lr_at(0, 50) < cfg.lr / 4  # the first update is no full-rate one
    assert OptimizerConfig(warmup_steps=0).for_model(model).warmup_for(50) == 0  # said outright: as said


def test_a_run_steps_with_the_scheduled_rate():
    cfg = TrainConfig(steps=4, optimizer=OptimizerConfig(lr_schedule="cosine", warmup_steps=2), num_threads=1)
    scheduled = train_reference(cfg).losses
    constant = train_reference(dataclasses.replace(cfg, optimizer=OptimizerConfig(
        lr_schedule="constant", warmup_steps=0).for_model(cfg.model))).losses
    assert scheduled[0] == constant[0]  # the first loss is before any update
    assert scheduled[1] != constant[1]  # the first update used lr / 2 (the warm-up), not lr
