"""The sharded all-reduce the paper's cost model assumes: reduce-scatter, then all-gather.

A group of ``n`` replicas each holds a flat gradient vector ``g_r``. The vector is cut into ``n`` shards;
member ``k`` owns shard ``k``:

1. reduce-scatter: every member sends shard ``k`` of its vector to member ``k``; member ``k`` adds the
   ``n`` copies of its shard *in replica order* (0, 1, …, n−1), whoever arrived first;
2. all-gather: member ``k`` sends the reduced shard to every other member, and assembles the full sum.

Each member sends ``(n−1)/n`` of the vector twice and receives as much: the ``2 · c_DP / D_dp`` per peer
pair of the cost model. Because every shard is added up by exactly one member in a fixed order and then
copied, all replicas end with bit-identical sums, hence identical parameters after the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

REDUCE = "reduce_shard"
GATHER = "gather_shard"


class GroupExchange(Protocol):
    """Point-to-point messages inside one data-parallel group, addressed by replica rank."""

    def send(self, to_rank: int, kind: str, part: int, tensor: torch.Tensor) -> Future: ...

    def recv(self, from_rank: int, kind: str, part: int, numel: int, dtype: torch.dtype) -> torch.Tensor: ...


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges covering ``numel`` elements; sizes differ by at most one."""
    base, extra = divmod(numel, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sharded_all_reduce(flat: torch.Tensor, rank: int, group_size: int, exchange: GroupExchange) -> torch.Tensor:
    """Sum ``flat`` (1-D, contiguous) over the group; returns a new tensor, identical on every member."""
    if group_size == 1:
        return flat.clone()
    assert flat.dim() == 1 and 0 <= rank < group_size
    bounds = shard_bounds(flat.numel(), group_size)
    sends: list[Future] = []
    for k, (start, end) in enumerate(bounds):
        if k != rank:
            sends.append(exchange.send(k, REDUCE, k, flat[start:end].contiguous()))
    my_start, my_end = bounds[rank]
    my_numel = my_end - my_start
    reduced = torch.zeros(my_numel, dtype=flat.dtype)
    for r in range(group_size):  # fixed order: the same additions on every member
        part = flat[my_start:my_end] if r == rank else exchange.recv(r, REDUCE, rank, my_numel, flat.dtype)
        reduced += part
    for k in range(group_size):
        if k != rank:
            sends.append(exchange.send(k, GATHER, rank, reduced))
    out = torch.empty_like(flat)
    out[my_start:my_end] = reduced
    for r, (start, end) in enumerate(bounds):
        if r != rank:
            out[start:end] = exchange.recv(r, GATHER, r, end - start, flat.dtype)
    _wait_all(sends)
    return out


def _wait_all(futures: Sequence[Future]) -> None:
    for future in futures:
        future.result()


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 vector holding ``tensors`` in order."""
    return torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (inverse of ``flatten``)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    assert offset == flat.numel(), "flat vector and tensors disagree in size"
