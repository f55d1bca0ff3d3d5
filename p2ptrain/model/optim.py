"""The optimizer: AdamW, built the same way for the full model and for any stage.

AdamW acts on each parameter alone, and the weight-decay groups are chosen per parameter (matrices and
embeddings decay; biases and LayerNorm gains do not), so a stage's optimizer is exactly the full model's
restricted to the stage's parameters.

The learning rate follows ``lr_schedule`` (``p2ptrain.model.lr_schedule``: constant, or a warm-up then
cosine, linear or warm-up–stable–decay to ``min_lr``), a function of the step's number, so every stage and
replica applies the same rate at the same step. ``clip`` > 0 clips the gradients by their global norm over
all stages before each update (``p2ptrain.model.clip``: the stages of a pipeline exchange one scalar a step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.model.lr_schedule import SCHEDULE_KINDS, lr_at
from p2ptrain.model.precision import ScaledAdamW


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters (TOML table ``[optimizer]``)."""

    lr: float = 2e-3  # suits the tiny and small presets; larger models want less (GPT-3 XL used 2e-4)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    lr_schedule: str = "constant"  # constant, cosine, linear or wsd (``p2ptrain.model.lr_schedule``)
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr over the first steps
    min_lr: float = 0.0  # the floor the decaying schedules reach at the run's last step
    decay_fraction: float = 0.2  # wsd: the share of the run's steps over which it decays
    clip: float = 0.0  # clip the gradients to this global 2-norm before each update (0: no clipping)

    def __post_init__(self) -> None:
        if self.lr_schedule not in SCHEDULE_KINDS:
            raise ValueError(f"optimizer.lr_schedule={self.lr_schedule!r} is not one of {', '.join(SCHEDULE_KINDS)}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optimizer.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be positive, got {self.eps}")
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise ValueError(f"optimizer.clip must be a non-negative number (0: no clipping), got {self.clip}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer.weight_decay must be non-negative, got {self.weight_decay}")


    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of update ``step`` (0-based) of a run of ``total_steps``."""
        return lr_at(step, total_steps, self.lr, self.lr_schedule, self.warmup_steps, self.min_lr,
                     self.decay_fraction)  # fmt: skip


def build_optimizer(module: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over ``module``'s parameters; tensors of two or more dimensions get weight decay."""
    params = list(module.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    scaler = getattr(module, "loss_scaler", None)
    if scaler is not None:  # fp16: gradients arrive loss-scaled (``p2ptrain.model.precision``)
        return ScaledAdamW([g for g in groups if g["params"]], scaler, **kwargs)
    return torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)
