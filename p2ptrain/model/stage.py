"""Pipeline stages: which layers a stage holds, and the stage module itself.

Partition rule: ``num_layers`` blocks are cut into ``num_stages`` contiguous ranges whose sizes differ by at
most one; the first ``num_layers % num_stages`` stages hold the extra layer. Stage 0 also holds the
embeddings (cheap: a lookup) and the last stage the final LayerNorm and LM head (a large matmul), so extra
blocks go to the front. 24 layers on 8 stages: 3 each; 8 layers on 3 stages: 3, 3, 2.

A plan for mixed devices may cut unevenly: ``layers`` (the plan's ``layers`` field, stage j holding
blocks [a_j, b_j), ``p2ptrain.planning.split``) replaces the rule wherever a function takes it; None means
the even split.

A stage is a ``GPT`` holding its range: its parameter names and initial values are the full model's.
Chaining stages 0 … S−1 computes what the full model computes, whatever the split.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p2ptrain.model.gpt import GPT
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.split import Layers, check_layers, even_layers


def stage_layer_range(num_layers: int, stage_index: int, num_stages: int, layers: Layers | None = None) -> range:
    """The block indices stage ``stage_index`` of ``num_stages`` holds: ``layers[stage_index]``, or by the
    module's partition rule when ``layers`` is None."""
    split = even_layers(num_layers, num_stages) if layers is None else check_layers(layers, num_layers, num_stages)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage index {stage_index} is out of range for {num_stages} stages")
    return range(*split[stage_index])


def build_stage(
    shape: ModelShape,
    stage_index: int,
    num_stages: int,
    seed: int,
    device: torch.device | str = "cpu",
    layers: Layers | None = None,
    precision: str = "fp32",
    checkpointing: bool = False,
    compile: bool = False,
) -> GPT:
    """Stage ``stage_index`` of ``num_stages`` (blocks ``layers[stage_index]``, or the even split),
    initialised from ``seed`` exactly like the full model's slice.

    Forward: stage 0 takes token ids ``[B, T]``; later stages take hidden ``[B, T, hidden_size]``; the last
    returns logits ``[B, T, vocab_size]``, the others hidden. With ``num_stages == 1`` it is the full model.
    ``compile``: its blocks run compiled (``p2ptrain.model.compiled``).
    """
    blocks = stage_layer_range(shape.num_layers, stage_index, num_stages, layers)
    return GPT(shape, blocks, seed=seed, device=device, precision=precision, checkpointing=checkpointing,
               compile=compile)


def stage_state_dict(
    full_state: Mapping[str, torch.Tensor], shape: ModelShape, stage_index: int, num_stages: int,
    layers: Layers | None = None,
) -> dict[str, torch.Tensor]:
    """The entries of a full model's state dict that stage ``stage_index`` of ``num_stages`` holds."""
    names = build_stage(shape, stage_index, num_stages, seed=0, device="meta", layers=layers).state_dict().keys()
    missing = [name for name in names if name not in full_state]
    if missing:
        raise KeyError(f"full state dict lacks {len(missing)} entries of the stage, e.g. {missing[0]}")
    return {name: full_state[name] for name in names}
