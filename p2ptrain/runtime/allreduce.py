"""The sharded all-reduce the paper's cost model assumes: reduce-scatter, then all-gather.

A group of ``n`` replicas each holds a flat gradient vector ``g_r``. The vector is cut into ``n`` shards;
member ``k`` owns shard ``k``:

1. reduce-scatter: every member sends shard ``k`` of its vector to member ``k``; member ``k`` adds the
   ``n`` copies of its shard *in replica order* (0, 1, …, n−1), whoever arrived first;
2. all-gather: member ``k`` sends the reduced shard to every other member, and assembles the full sum.

Each member sends ``(n−1)/n`` of the vector twice and receives as much: the ``2 · c_DP / D_dp`` per peer
pair of the cost model. Because every shard is added up by exactly one member in a fixed order and then
copied, all replicas end with bit-identical sums, hence identical parameters after the optimizer step.

With a lossy wire (``p2ptrain.runtime.wire``) every shard travels encoded: a member encodes its vector with
error feedback (what the encoding dropped is added to its next step's vector), the owner decodes the ``n − 1``
copies it receives and adds them and its own in replica order in float32, then encodes
the sum (with its own error feedback) and every member, the owner included, decodes that same message. So
replicas still hold bit-identical sums. With ``fp32`` the messages are the tensors themselves: exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from p2ptrain.futures import wait_all
from p2ptrain.net.transport.messages import MessageKind
from p2ptrain.runtime.wire import Codec, ErrorFeedback

REDUCE, GATHER = MessageKind.REDUCE_SHARD, MessageKind.GATHER_SHARD


class GroupExchange(Protocol):
    """Point-to-point messages inside one data-parallel group, addressed by replica rank."""

    def send(self, to_rank: int, kind: str, part: int, tensor: torch.Tensor) -> Future: ...

    def recv(self, from_rank: int, kind: str, part: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class ReduceRecord:
    """What one member's all-reduce of one vector sent and added up, for the checks of ``p2ptrain.verify.sum_check``
    (the all-reduce only fills it): nothing here is changed after it is recorded."""

    sent: dict[int, torch.Tensor] = field(default_factory=dict)  # owner k -> the reduce message we sent it
    added: dict[int, torch.Tensor] = field(default_factory=dict)  # (as owner) replica r -> what we added for it
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # owner k -> its reduced message (ours too)
    sizes: list[int] = field(default_factory=list)  # the shards' element counts, by owner
    received: dict[int, torch.Tensor] = field(default_factory=dict)  # (as owner) replica r -> its reduce message


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges covering ``numel`` elements; sizes differ by at most one."""
    base, extra = divmod(numel, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def sharded_all_reduce(
    flat: torch.Tensor,
    rank: int,
    group_size: int,
    exchange: GroupExchange,
    feedback: ErrorFeedback | None = None,
    key: object = 0,
    record: ReduceRecord | None = None,
) -> torch.Tensor:
    """Sum ``flat`` (1-D, contiguous, float32) over the group; returns a new tensor, identical on every member.

    ``feedback`` (default: exact fp32) encodes the messages; ``key`` names this vector's residuals in it (the
    same vector of the next step must pass the same key). ``record`` (optional) is filled with the messages
    sent and received and the contributions added (``ReduceRecord``).
    """
    if group_size == 1:
        return flat.clone()
    assert flat.dim() == 1 and 0 <= rank < group_size
    feedback = feedback or ErrorFeedback(Codec("fp32"))
    codec = feedback.codec
    bounds = shard_bounds(flat.numel(), group_size)
    if record is not None:
        record.sizes = [end - start for start, end in bounds]
    sends: list[Future] = []
    for k, (start, end) in enumerate(bounds):
        if k != rank:
            message, _ = feedback.encode((key, REDUCE, k), flat[start:end].contiguous())
            sends.append(exchange.send(k, REDUCE, k, message))
            if record is not None:
                record.sent[k] = message
    my_start, my_end = bounds[rank]
    my_shape = (my_end - my_start,)
    wire_shape, wire_dtype = codec.wire_spec(my_shape)
    reduced = torch.zeros(my_shape, dtype=torch.float32)
    for r in range(group_size):  # fixed order: the same additions on every member
        if r == rank:
            added = flat[my_start:my_end]  # our own copy needs no encoding
        else:
            message = exchange.recv(r, REDUCE, rank, wire_shape, wire_dtype)
            added = codec.decode(message, my_shape)
            if record is not None:
                record.received[r] = message
        reduced += added
        if record is not None:
            record.added[r] = added.clone() if r == rank else added
    message, decoded = feedback.encode((key, GATHER), reduced)
    if record is not None:
        record.gathered[rank] = message
    for k in range(group_size):
        if k != rank:
            sends.append(exchange.send(k, GATHER, rank, message))
    out = torch.empty_like(flat)
    out[my_start:my_end] = decoded
    for r, (start, end) in enumerate(bounds):
        if r != rank:
            wire_shape, wire_dtype = codec.wire_spec((end - start,))
            gathered = exchange.recv(r, GATHER, r, wire_shape, wire_dtype)
            out[start:end] = codec.decode(gathered, (end - start,))
            if record is not None:
                record.gathered[r] = gathered
    wait_all(sends)
    return out


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
