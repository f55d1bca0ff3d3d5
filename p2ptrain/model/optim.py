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

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.config import option
from p2ptrain.model.hyperparams import SHORT_RUN_WARMUP, recipe
from p2ptrain.model.lr_schedule import SCHEDULE_KINDS, lr_at
from p2ptrain.model.precision import ScaledAdamW


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters (TOML table ``[optimizer]``). A key left out (None) is the model preset's recipe
    (``model.hyperparams``), filled in when the run's ``TrainConfig`` is made (``for_model``)."""

    lr: float | None = option(None, "Peak AdamW learning rate.", min=0, min_open=True,
                              default_text="the preset's")  # the peak learning rate
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None  # on matrices and embeddings; biases and norm gains never decay
    lr_schedule: str | None = option(  # constant, cosine, linear or wsd (``p2ptrain.model.lr_schedule``)
        None, "Learning-rate schedule after the warm-up (p2ptrain.model.lr_schedule).", choices=SCHEDULE_KINDS,
        default_text="the preset's, cosine")
    # linear warm-up over this many first updates (None: warmup_fraction of the run)
    warmup_steps: int | None = option(None, "Linear warm-up updates.", min=0,
                                      default_text="the preset's share of the run")
    warmup_fraction: float | None = None  # the warm-up as a share of the run's steps, when warmup_steps is None
    warmup_floor_steps: int | None = None  # ... and at least this many updates, or SHORT_RUN_WARMUP of a shorter run
    # the floor the decaying schedules reach at the run's end (None: min_lr_ratio · lr)
    min_lr: float | None = option(None, "The floor cosine, linear and wsd decay to.", min=0,
                                  default_text="a tenth of the peak")
    min_lr_ratio: float | None = None  # the floor as a share of lr, when min_lr is None
    decay_fraction: float | None = None  # wsd: the share of the run's steps over which it decays
    # clip the gradients to this global 2-norm before each update (0: no clipping)
    clip: float | None = option(None, "Clip the gradients' global norm over all stages to this (0: off).", min=0,
                                default_text="1.0")

    def __post_init__(self) -> None:
        if self.lr_schedule is not None and self.lr_schedule not in SCHEDULE_KINDS:
            raise ValueError(f"optimizer.lr_schedule={self.lr_schedule!r} is not one of {', '.join(SCHEDULE_KINDS)}")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or not isinstance(
                self.warmup_steps, int) or self.warmup_steps < 0):
            raise ValueError(f"optimizer.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if self.warmup_floor_steps is not None and (isinstance(self.warmup_floor_steps, bool) or not isinstance(
                self.warmup_floor_steps, int) or self.warmup_floor_steps < 0):
            raise ValueError(f"optimizer.warmup_floor_steps must be a non-negative integer, got {self.warmup_floor_steps!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"optimizer.lr must be positive, got {self.lr}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else math.inf):
            raise ValueError(f"optimizer.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        for name, lo, hi in (("decay_fraction", 0, 1), ("warmup_fraction", 0, 1), ("min_lr_ratio", 0, 1)):
            value = getattr(self, name)
            if value is not None and not (lo < value <= hi if name == "decay_fraction" else lo <= value <= hi):
                span = "(0, 1]" if name == "decay_fraction" else "[0, 1]"
                raise ValueError(f"optimizer.{name}={value} must be in {span}")
        for name in ("beta1", "beta2"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps is not None and not self.eps > 0:
            raise ValueError(f"optimizer.eps must be positive, got {self.eps}")
        if self.clip is not None and not (self.clip >= 0 and math.isfinite(self.clip)):
            raise ValueError(f"optimizer.clip must be a non-negative number (0: no clipping), got {self.clip}")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"optimizer.weight_decay must be non-negative, got {self.weight_decay}")

    def for_model(self, model: str) -> OptimizerConfig:
        """These settings, every key left out taken from preset ``model``'s recipe (``warmup_steps`` and
        ``min_lr`` stay None: the shares say them)."""
        filled = {name: value for name, value in recipe(model).fields().items() if getattr(self, name) is None}
        return dataclasses.replace(self, **filled) if filled else self

    @property
    def resolved(self) -> bool:
        return all(getattr(self, f.name) is not None for f in dataclasses.fields(self)
                   if f.name not in ("warmup_steps", "min_lr"))

    def warmup_for(self, total_steps: int) -> int:
        """The warm-up's updates in a run of ``total_steps``."""
        self._check_resolved()
        if self.warmup_steps is not None:
            return self.warmup_steps
        floor = min(self.warmup_floor_steps, math.ceil(SHORT_RUN_WARMUP * total_steps))
        return min(total_steps, max(round(self.warmup_fraction * total_steps), floor))

    @property
    def floor(self) -> float:
        """The rate the decaying schedules end at."""
        self._check_resolved()
        return self.min_lr if self.min_lr is not None else self.min_lr_ratio * self.lr

    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of update ``step`` (0-based) of a run of ``total_steps``."""
        return lr_at(step, total_steps, self.lr, self.lr_schedule, self.warmup_for(total_steps), self.floor,
                     self.decay_fraction)

    def _check_resolved(self) -> None:
        if not self.resolved:
            raise ValueError("optimizer settings without the model's recipe: use OptimizerConfig.for_model(model)")


def build_optimizer(module: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over ``module``'s parameters; tensors of two or more dimensions get weight decay. ``cfg`` is a
    run's (``TrainConfig.optimizer``: the model's recipe filled in). On CUDA the fused implementation (one
    kernel for every parameter; its rounding is CUDA's own, as the rest of a CUDA step's is)."""
    cfg._check_resolved()
    params = list(module.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if params and all(p.is_cuda for p in params):  # one fused kernel per step: CUDA replicas all run it alike
        kwargs["fused"] = True
    scaler = getattr(module, "loss_scaler", None)
    if scaler is not None:  # fp16: gradients arrive loss-scaled (``p2ptrain.model.precision``)
        return ScaledAdamW([g for g in groups if g["params"]], scaler, **kwargs)
    return torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)
