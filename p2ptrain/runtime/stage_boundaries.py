"""A pipeline's stage boundaries inside one process: where a run of ``stages`` S cuts the model, the run's wire
codec round-trips each micro-batch's activations forward and their gradients back, as the workers' messages do
(``runtime.wire``: the activation codec one way, the activation-gradient codec the other, no error feedback).

So the single-process reference (``runtime.reference``) of a run with a lossy wire between stages computes what
its workers compute (a test holds the two equal), and a quality benchmark can train long runs with boundary
codecs on one machine. With an exact wire (``fp32``), one stage or ``stages = "auto"`` nothing is inserted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from p2ptrain.planning.split import even_layers
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import Codec, wire_format


class _Boundary(torch.autograd.Function):
    """Identity up to the codecs: forward, ``forward_codec``'s round trip; backward, ``backward_codec``'s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_codec: Codec, backward_codec: Codec) -> torch.Tensor:
        ctx.backward_codec = backward_codec
        return forward_codec.round_trip(x.detach().float()).to(x.device, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.backward_codec.round_trip(grad.float()).to(grad.device, grad.dtype), None, None


def cut_points(cfg: TrainConfig) -> list[int]:
    """The blocks after which ``cfg``'s pipeline sends a message: the last block of every stage but the last
    (none for one stage or ``stages = "auto"``)."""
    if cfg.stages_auto or cfg.stages == 1:
        return []
    split = cfg.layers if cfg.layers is not None else even_layers(cfg.shape.num_layers, cfg.stages)
    return [stop - 1 for _, stop in split[:-1]]


def insert_boundaries(model: nn.Module, cfg: TrainConfig) -> int:
    """Round-trip the outputs of ``model``'s blocks at ``cut_points(cfg)`` through the run's wire codecs (module
    docstring), in place of the boundaries inserted before (a re-plan moves them); returns how many there are now
    (0 with an exact wire)."""
    for block in model.blocks.values():  # found by type: a deep copy of the model holds copies of them
        hooks = block._forward_hooks  # noqa: SLF001 - torch keeps a module's forward hooks here
        for key in [k for k, hook in hooks.items() if isinstance(hook, _BoundaryHook)]:
            del hooks[key]
    wire = wire_format(cfg.wire)
    points = [] if wire.activation.exact and wire.activation_grad.exact else cut_points(cfg)
    for block in points:
        model.blocks[str(block)].register_forward_hook(_BoundaryHook(wire.activation, wire.activation_grad))
    return len(points)


class _BoundaryHook:
    def __init__(self, forward_codec: Codec, backward_codec: Codec) -> None:
        self.forward_codec, self.backward_codec = forward_codec, backward_codec

    def __call__(self, _module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        return _Boundary.apply(out, self.forward_codec, self.backward_codec)
