"""Initial parameters drawn per name, so a stage starts exactly where the full model's slice starts.

Each parameter has its own ``torch.Generator`` seeded from ``(seed, fully-qualified name)``; nothing reads
the global RNG, and the order in which modules are built or visited does not matter. Values are drawn on
the CPU and copied to the parameter's device, so CPU and CUDA runs start from the same numbers.

The scheme is GPT-2's, for both block families (``p2ptrain.model.gpt``): weights ~ N(0, 0.02), the two
projections that write into the residual stream (``attn.proj``, ``mlp.proj``) ~ N(0, 0.02 / sqrt(2 ·
num_layers)), biases 0, norm gains (LayerNorm's and RMSNorm's, ``ln1``, ``ln2``, ``ln_f``) 1. The llama
family's ``mlp.gate`` and ``mlp.up`` are plain weights (0.02); it has no biases.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

_STD = 0.02
_LAYER_NORMS = ("ln1", "ln2", "ln_f")


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run's seed and a parameter's fully-qualified name."""
    digest = hashlib.sha256(f"p2ptrain.init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def initial_value(name: str, size: tuple[int, ...], seed: int, num_layers: int) -> torch.Tensor:
    """The float32 CPU tensor parameter ``name`` of a model with ``num_layers`` blocks starts from."""
    parts = name.split(".")
    if parts[-1] == "bias":
        return torch.zeros(size)
    if len(parts) >= 2 and parts[-2] in _LAYER_NORMS:
        return torch.ones(size)
    std = _STD / math.sqrt(2 * num_layers) if name.endswith(".proj.weight") else _STD
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(size).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, num_layers: int) -> None:
    """Overwrite every parameter of ``module`` (on any real device) with its ``initial_value``."""
    for name, param in module.named_parameters():
        param.copy_(initial_value(name, tuple(param.shape), seed, num_layers))
