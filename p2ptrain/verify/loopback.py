"""The sharded all-reduce of a whole group run in one process, every message recorded: what the checks see.

For tests and ``benchmarks/verify_noise.py``: ``all_reduce_group`` runs the real
``allreduce.sharded_all_reduce`` for every member of a group, one thread each, over in-process queues, and
returns each member's result and every message sent, keyed ``(sender, receiver, kind, part)``.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from p2ptrain.runtime.allreduce import sharded_all_reduce
from p2ptrain.runtime.wire import ErrorFeedback

MessageKey = tuple[int, int, str, int]  # (sender rank, receiver rank, kind, part)
_RECV_TIMEOUT_S = 60.0


class _Exchange:
    """One member's view of the group: sends go into the receiver's queue and the record."""

    def __init__(self, rank: int, queues: dict[MessageKey, queue.Queue], record: dict[MessageKey, torch.Tensor]):
        self.rank, self.queues, self.record = rank, queues, record

    def send(self, to_rank: int, kind: str, part: int, tensor: torch.Tensor) -> Future:
        key = (self.rank, to_rank, kind, part)
        self.record[key] = tensor
        self.queues[key].put(tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank: int, kind: str, part: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.queues[(from_rank, self.rank, kind, part)].get(timeout=_RECV_TIMEOUT_S)


def all_reduce_group(flats: Sequence[torch.Tensor], feedbacks: Sequence[ErrorFeedback],
                     key: object = 0) -> tuple[list[torch.Tensor], dict[MessageKey, torch.Tensor]]:
    """Every member's ``sharded_all_reduce`` of ``flats[r]`` with its own ``feedbacks[r]``; returns the results
    and the messages sent."""
    n = len(flats)
    queues: dict[MessageKey, queue.Queue] = {}
    record: dict[MessageKey, torch.Tensor] = {}
    for sender in range(n):
        for receiver in range(n):
            for kind in ("reduce_shard", "gather_shard"):
                for part in range(n):
                    queues[(sender, receiver, kind, part)] = queue.Queue()
    with ThreadPoolExecutor(max_workers=max(n, 1)) as pool:
        futures = [pool.submit(sharded_all_reduce, flats[r], r, n, _Exchange(r, queues, record), feedbacks[r], key)
                   for r in range(n)]
        results = [f.result() for f in futures]
    return results, record
