"""The loss convention every trainer follows, single-process and distributed alike.

A global batch of B sequences of T predicted tokens is cut into shards (one per replica) and micro-batches.
Each micro-batch's loss is the *sum* of its token cross-entropies divided by the number of tokens in the
*whole global batch* (B · T). Then:

- backward on each micro-batch accumulates, in each parameter's ``.grad``, that micro-batch's share of the
  gradient of the global mean loss; summing over micro-batches (gradient accumulation) and over replicas
  (all-reduce SUM, no division) gives exactly the gradient of the global mean cross-entropy, whatever the
  split;
- the step's reported loss, the global mean cross-entropy, is the sum of all micro-batches' losses over all
  replicas.

So a plan changes only the order of float32 additions, never what is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor, global_batch_tokens: int) -> torch.Tensor:
    """Sum of the cross-entropies of ``logits [b, T, V]`` against ``targets [b, T]``, over B·T.

    ``global_batch_tokens`` is the number of predicted tokens in the whole global batch, not in this
    micro-batch (see the module docstring). Returns a float32 scalar to call ``backward`` on.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    if not 0 < targets.numel() <= global_batch_tokens:
        raise ValueError(
            f"micro-batch of {targets.numel()} tokens in a global batch of {global_batch_tokens}"
        )
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum"
    )
    return total / global_batch_tokens
