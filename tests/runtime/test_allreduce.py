"""The all-reduce algorithm, run by threads over an in-memory exchange (the real transport is tested in
the integration tests of the runtime)."""

import queue
import threading
from concurrent.futures import Future

import pytest
import torch

from p2ptrain.runtime.allreduce import flatten, shard_bounds, sharded_all_reduce, unflatten_into


class QueueExchange:
    def __init__(self, boxes, rank):
        self.boxes, self.rank = boxes, rank

    def send(self, to_rank, kind, part, tensor):
        self.boxes[(self.rank, to_rank, kind, part)].put(tensor.clone())
        done = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank, kind, part, numel, dtype):
        t = self.boxes[(from_rank, self.rank, kind, part)].get(timeout=10)
        assert t.numel() == numel and t.dtype == dtype
        return t


@pytest.mark.parametrize("n,numel", [(1, 5), (2, 7), (3, 10), (4, 3), (5, 101)])
def test_all_members_get_the_same_sum(n, numel):
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
    boxes = {
        (a, b, kind, p): queue.Queue()
        for a in range(n)
        for b in range(n)
        for kind in ("reduce_shard", "gather_shard")
        for p in range(n)
    }
    results = [None] * n

    def member(r):
        results[r] = sharded_all_reduce(vectors[r], r, n, QueueExchange(boxes, r))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    expected = torch.stack(vectors).sum(0)
    for r in range(n):
        assert torch.equal(results[r], results[0])  # bit-identical on every member
        torch.testing.assert_close(results[r], expected)


def test_shard_bounds_cover_everything_once():
    for numel in range(0, 30):
        for k in range(1, 7):
            bounds = shard_bounds(numel, k)
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_flatten_round_trip():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    flat = flatten(tensors)
    targets = [torch.zeros_like(t) for t in tensors]
    unflatten_into(flat, targets)
    for a, b in zip(tensors, targets, strict=False):
        assert torch.equal(a, b)
