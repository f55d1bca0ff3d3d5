"""Gradient clipping by the global norm, the same on one process and on a pipeline of stages.

With ``g`` every gradient of the model (all stages; the data-parallel sum, so every replica holds it) and
``c`` the threshold (``[optimizer] clip``), every gradient is multiplied by

    min(1, c / (‖g‖₂ + 1e-6))

before the update: PyTorch's ``clip_grad_norm_`` (and so Megatron's, nanoGPT's, transformers' Trainer's).
``‖g‖₂² = Σ_stages Σ_tensors ‖g_t‖²``: each stage computes its own squared norm (``squared_norm``) and the
stages of a pipeline exchange them, one scalar each (``runtime.executor``); every peer adds the S scalars in
stage order, so every stage and replica multiplies by the same bits. A single process computes the same sum
over all its parameters at once; the two differ only in the order of float32 additions.

fp16 training holds gradients multiplied by the loss scale (``model.precision``): ``squared_norm`` takes the
scale and returns the true gradient's squared norm, and ``clip_coefficient`` of a non-finite norm is 1 (an
overflowed step is skipped by the optimizer, not clipped to zero).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

CLIP_EPS = 1e-6  # added to the norm before dividing (PyTorch's clip_grad_norm_)


def squared_norm(params: Iterable[torch.nn.Parameter], scale: float = 1.0) -> float:
    """The squared 2-norm of the gradients of ``params`` (divided by ``scale``²), a float32 sum on the CPU."""
    norms = [torch.linalg.vector_norm(p.grad.detach().float()).cpu() for p in params if p.grad is not None]
    if not norms:
        return 0.0
    total = torch.stack(norms).square().sum()
    return float(total) / (scale * scale)


def total_norm(squared: Sequence[float]) -> float:
    """The global norm from the stages' squared norms, added in the order given (stage order)."""
    acc = torch.zeros((), dtype=torch.float32)
    for value in squared:
        acc += torch.tensor(value, dtype=torch.float32)
    return math.sqrt(float(acc))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What every gradient is multiplied by: ``min(1, max_norm / (norm + 1e-6))``; 1 for a non-finite norm."""
    if not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


@torch.no_grad()
def scale_gradients(params: Iterable[torch.nn.Parameter], coefficient: float) -> None:
    """Multiply every gradient of ``params`` by ``coefficient`` (nothing to do for 1)."""
    if coefficient == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coefficient)


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float, scale: float = 1.0) -> float:
    """Clip ``params``' gradients (all of the model's) to ``max_norm``; returns the norm before clipping."""
    norm = total_norm([squared_norm(params, scale)])
    scale_gradients(params, clip_coefficient(norm, max_norm))
    return norm
