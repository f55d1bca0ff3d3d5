"""Mixed precision inside a stage: autocast around the stage's compute, fp32 everywhere else.

- ``fp32``: nothing changes; the exact mode (docs/design.md, "Exactness").
- ``bf16`` / ``fp16``: the stage's forward (and so its backward) runs under ``torch.autocast``: matmuls in
  the low precision, reductions and the loss in fp32. Parameters, gradients, AdamW moments (the master
  weights and optimizer state) stay fp32, and so do the tensors a stage sends: activations leave the
  stage as fp32 and gradients arrive as fp32, so the wire and the executor do not know the precision.
- ``fp16`` adds dynamic loss scaling, per stage: the stage multiplies the gradient arriving at its output
  by its scale S and divides the gradient leaving its input by S (``scale_gradient``), so its parameters'
  gradients are S times the true ones and the gradients on the wire are true ones. ``ScaledAdamW``
  divides by S before the update; when any gradient is not finite it skips the update and halves S, and
  after ``growth_interval`` good steps it doubles S (``torch.amp.GradScaler``'s rule). Replicas of a stage
  see the same all-reduced gradients, so they take the same decisions and stay identical; different stages
  scale independently (a skipped update on one stage is not one on another: fp16 is not an exact mode).
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """The context a stage's forward runs in: autocast to ``precision``, or nothing for fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


class LossScaler:
    """The dynamic loss scale of one stage (fp16)."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` unchanged in the forward pass; its gradient multiplied by ``factor`` in the backward pass."""
    return _ScaleGradient.apply(x, factor) if x.requires_grad else x


class ScaledAdamW(torch.optim.AdamW):
    """AdamW whose gradients arrive multiplied by ``scaler.scale`` (fp16 loss scaling, see the module)."""

    def __init__(self, params, scaler: LossScaler, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.scaler = scaler

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        inverse = 1.0 / self.scaler.scale
        finite = True
        for grad in grads:
            grad.mul_(inverse)
            finite = finite and bool(torch.isfinite(grad).all())
        self.scaler.update(finite)
        if not finite:
            self.zero_grad(set_to_none=False)
            return None
        return super().step(closure)
