"""``[train] compile``: each transformer block compiled with ``torch.compile``, and a check that torch can.

``compile_blocks`` compiles a stage's blocks in place (``nn.Module.compile``), so parameter names stay the
model's: an ``OptimizedModule`` wrapper would rename them ``blocks.3._orig_mod.…`` and no checkpoint, stage
slice or initial weights would load. The embedding lookup and the head stay eager. Blocks of one shape share
their compiled graphs: a stage compiles once, not once per block.

torch drops a module's compiled forward when the module is copied (``copy.deepcopy``); ``GPT`` compiles its
copies again, so a copy computes as its original does (the recompute check's shadow, DiLoCo's replicas).

Compiled kernels fuse and reorder the blocks' floating-point work: fp32 losses agree with the eager run's to
about 1e-7 relative (``tiny`` and ``small``, 4 steps: at most 2.4e-7), not bit for bit. This is why compile
is a run setting (``training_digest``): replicas that compile and replicas that do not would drift apart.

On a CPU compilation needs a C++ compiler (inductor's CPU backend) and buys little: ``small`` on 2 shared CPU
cores (4 sequences a step) took 10.7 s for its first step with a cold inductor cache (0.6 s warm), plus about
20 s (5 s warm) for ``check_compile``, then 0.29 to 0.41 s a step against eager's 0.25. Hence off by default.
"""

from __future__ import annotations

import torch
from torch import nn

from p2ptrain.errors import ConfigError


def compile_blocks(blocks: nn.ModuleDict) -> None:
    """Compile every block of ``blocks`` in place (see the module); compilation itself waits for the first call."""
    for block in blocks.values():
        block.compile()


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs compiled (``nn.Module.compile``)."""
    return module._compiled_call_impl is not None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 2.0 + 1.0


def check_compile(device: torch.device | str) -> None:
    """Compile and run a small function on ``device``: a ``ConfigError`` in one line if torch cannot compile
    there (no C++ compiler for the CPU backend, no Triton for a GPU, a Python torch.compile does not support),
    before any training starts. Most of its cost is torch's first-compile start-up, which the blocks' first
    compile would pay otherwise."""
    try:
        torch.compile(_probe)(torch.ones(4, device=device)).cpu()
    except Exception as e:  # torch's compile errors have no common base class
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"[train] compile is on but torch.compile fails on {torch.device(device)}: {first} "
                          "(set compile = false, or pass --no-compile)") from None
