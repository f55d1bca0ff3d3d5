"""The all-reduce algorithm, run by threads over an in-memory exchange (the real transport is tested in
the integration tests of the runtime)."""

import queue
import threading
from concurrent.futures import Future

import pytest
import torch

from p2ptrain.runtime.allreduce import flatten, shard_bounds, sharded_all_reduce, unflatten_into
from p2ptrain.runtime.wire import Codec, ErrorFeedback


class QueueExchange:
    def __init__(self, boxes, rank):
        self.boxes, self.rank = boxes, rank

    def send(self, to_rank, kind, part, tensor):
        self.boxes[(self.rank, to_rank, kind, part)].put(tensor.clone())
        done = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank, kind, part, shape, dtype):
        t = self.boxes[(from_rank, self.rank, kind, part)].get(timeout=10)
        assert tuple(t.shape) == tuple(shape) and t.dtype == dtype
        return t


def all_reduce_in_threads(vectors, feedbacks=None):
    n = len(vectors)
    boxes = {
        (a, b, kind, p): queue.Queue()
        for a in range(n)
        for b in range(n)
        for kind in ("reduce_shard", "gather_shard")
        for p in range(n)
    }
    results = [None] * n

    def member(r):
        results[r] = sharded_all_reduce(vectors[r], r, n, QueueExchange(boxes, r),
                                        feedbacks[r] if feedbacks else None)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return results


@pytest.mark.parametrize("n,numel", [(1, 5), (2, 7), (3, 10), (4, 3), (5, 101)])
def test_all_members_get_the_same_sum(n, numel):
    gen = torch.Generator().manual_seed(n * 1000 + numel)
    vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
    results = all_reduce_in_threads(vectors)
    expected = torch.stack(vectors).sum(0)
    for r in range(n):
        assert torch.equal(results[r], results[0])  # bit-identical on every member
        torch.testing.assert_close(results[r], expected)


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4", "int2"])
def test_compressed_sums_are_bit_identical_and_error_feedback_keeps_them_unbiased(wire):
    """Replicas decode the same messages: identical sums. Over steps, error feedback makes the running
    total of the sums track the running total of the exact sums within one step's quantisation error."""
    n, numel, steps = 3, 1000, 20
    gen = torch.Generator().manual_seed(7)
    feedbacks = [ErrorFeedback(Codec(wire)) for _ in range(n)]
    exact_total = torch.zeros(numel)
    got_total = torch.zeros(numel)
    for _ in range(steps):
        vectors = [torch.randn(numel, generator=gen) + 0.1 for _ in range(n)]
        results = all_reduce_in_threads(vectors, feedbacks)
        for r in range(n):
            assert torch.equal(results[r], results[0])
        exact_total += torch.stack(vectors).sum(0)
        got_total += results[0]
    # without feedback: 0.065, 0.20, 4.0, 11.7
    one_step_error = {"bf16": 0.04, "int8": 0.1, "int4": 1.5, "int2": 6.0}[wire]
    assert (got_total - exact_total).abs().max() < one_step_error


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
