"""Learning-rate schedules: the learning rate of each step, a pure function of the step's number.

With ``lr`` the peak, ``w`` the warm-up steps, ``N`` the run's steps and ``f = min_lr`` the floor, the
update of step ``s`` (0-based: the first update is step 0) uses:

* warm-up, every schedule but ``constant``: ``lr · (s + 1) / w`` for ``s < w`` (the first update already
  moves; step ``w - 1`` reaches the peak);
* ``constant``: ``lr`` (warm-up included if ``w`` > 0);
* ``cosine``: after the warm-up, ``f + (lr − f) · (1 + cos(π · t)) / 2`` with ``t = (s − w) / (N − w)``:
  the peak at step ``w``, falling to reach the floor at step ``N`` (one past the last update);
* ``linear``: ``f + (lr − f) · (1 − t)``, the same ``t``;
* ``wsd`` (warm-up–stable–decay): the peak until the last ``decay_fraction · N`` steps, then linear to
  the floor over them.

Because the rate is a function of the step's number alone, the schedule's counter is the step every
stage state carries already: checkpoints, warm copies, hand-overs and resumed runs continue it exactly.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

ScheduleKind = Literal["constant", "cosine", "linear", "wsd"]
SCHEDULE_KINDS: tuple[str, ...] = ("constant", "cosine", "linear", "wsd")


def lr_at(step: int, total_steps: int, lr: float, kind: str = "constant", warmup_steps: int = 0,
          min_lr: float = 0.0, decay_fraction: float = 0.2) -> float:
    """The learning rate of update ``step`` (0-based) of a run of ``total_steps`` updates."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if kind == "constant":
        return lr
    if kind == "wsd":
        decay_start = total_steps - max(1, round(decay_fraction * total_steps))
        if step < max(decay_start, warmup_steps):
            return lr
        start = max(decay_start, warmup_steps)
    elif kind in ("cosine", "linear"):
        start = warmup_steps
    else:
        raise ValueError(f"unknown learning-rate schedule {kind!r} (one of {', '.join(SCHEDULE_KINDS)})")
    t = min(1.0, (step - start) / max(1, total_steps - start))
    if kind == "cosine":
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * t)) / 2.0
    return min_lr + (lr - min_lr) * (1.0 - t)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` steps with ``lr`` from now on."""
    for group in optimizer.param_groups:
        group["lr"] = lr
