"""The sketch check applied to one shard of the sharded all-reduce (``p2ptrain.runtime.allreduce``).

Who holds what, for shard ``k`` of bucket ``b`` in a group of ``n`` replicas (owner ``k``):

* contributor ``r ≠ k`` sent ``REDUCE`` message ``M_r``; the owner summed ``decode(M_r)``, which ``r`` computes
  too (``message_contribution``); the owner's own contribution is its raw shard (``contribution``);
* every member received the owner's ``GATHER`` message ``R_t`` (the owner included: it decodes its own), and kept
  ``R_{t−1}``, the same shard's message of the step before in the same epoch (``None`` at an epoch's first step:
  error-feedback residuals start at zero with each epoch's executor);
* the seed is ``derive_seed(challenge_seed(...), "reduce", b, k)``.

``check_reduced_shard`` then checks ``decode(R_t)`` against the published contributions, with slack
``error_bound(R_t) + error_bound(R_{t−1})``: the codec's error on this sum and the owner's residual of the last
(``sketch`` derives the tolerance). A reduced message that does not decode, decodes to non-finite values, or
holds a block no honest encoder makes raises ValueError (one line): the owner sent it, and that is the evidence.
"""

from __future__ import annotations

import torch

from p2ptrain.runtime.wire import Codec
from p2ptrain.verify.bounds import error_bound
from p2ptrain.verify.sketch import SKETCH_ROWS, Contribution, SumCheck, check_sum, contribution


def message_contribution(codec: Codec, message: torch.Tensor, numel: int, seed: int,
                         rows: int = SKETCH_ROWS) -> Contribution:
    """What a contributor publishes for the ``REDUCE`` message it sent: the sketch of what the owner decodes."""
    try:
        decoded = codec.decode(message, (numel,))
    except ValueError as error:
        raise ValueError(f"message does not decode: {error}") from None
    return contribution(decoded, seed, rows)


def reduced_slack(codec: Codec, message: torch.Tensor, numel: int, previous: torch.Tensor | None = None) -> torch.Tensor:
    """The element-wise bound on ``decode(message) − Σ contributions`` of an honest owner (float rounding apart)."""
    slack = error_bound(codec, message, (numel,))
    if previous is not None and not codec.exact:
        slack = slack + error_bound(codec, previous, (numel,))
    return slack


def check_reduced_shard(codec: Codec, message: torch.Tensor, numel: int, contributions: list[Contribution],
                        seed: int, previous: torch.Tensor | None = None) -> SumCheck:
    """Check the owner's reduced ``message`` of a shard of ``numel`` elements (see the module)."""
    slack = reduced_slack(codec, message, numel, previous)
    return check_sum(codec.decode(message, (numel,)), slack, contributions, seed)
