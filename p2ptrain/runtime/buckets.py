"""A stage's data-parallel all-reduce in buckets, overlapped with the backward pass that produces them.

The stage's parameters are cut into buckets of about ``bucket_elements`` elements, in reverse parameter
order (the order backward reaches them). During the step's last backward (the one after which no gradient
changes), each parameter's ``register_post_accumulate_grad_hook`` marks it done; when a bucket's parameters
are all done, the bucket is handed to a pool of communication threads, which flatten its gradients and run
the sharded all-reduce (``allreduce``) while backward goes on in the compute thread. Up to
``MAX_BUCKETS_IN_FLIGHT`` buckets are reduced at once, so on a long link their round trips overlap instead of
adding up. Buckets start in bucket order on every replica (a bucket ready early waits for the ones before
it) and the pool takes them first in, first out, so the oldest unfinished bucket is running on every replica
and the reductions never wait on each other crosswise. A stage that sends its input's gradient back holds
them (``arm(hold=True)``) until that gradient is handed to the link (``release``): the hooks fire inside the
backward, before the gradient exists, and a shared uplink serves messages in the order it gets them, so the
shards would go out first and the stage before, which waits for the gradient, would wait for them too (4
emulated homes, 2 stages: the gradient came a shard later in most steps, 7.5 s steps for 6.6 s where it
did not). Its all-reduce then starts at the backward's end; stage 0, which sends no gradient, still reduces
during its backward. The last stage's loss travels as one more, exact
fp32 "bucket" after the gradients. ``finish`` waits for every bucket and writes the sums into ``.grad``.

Each bucket's message is tagged with the bucket index as its micro-batch number (kinds ``reduce_shard``
and ``gather_shard``, part = shard index), so buckets and shards of one step never mix. The arithmetic is
the unbucketed all-reduce's, element by element: fp32 + overlap is bit-identical to fp32 without it.

With a ``verifier`` (``p2ptrain.verify.sum_check``, installed by the agent) every bucket's messages are recorded
(``allreduce.ReduceRecord``) and ``finish`` hands the step's records to it once every bucket is summed and
before any ``.grad`` is written: it exchanges its own messages with the group (under one more bucket index) and
raises to refuse the step, so a sum that fails its check is never applied.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from p2ptrain.futures import wait_all
from p2ptrain.runtime.allreduce import (
    GroupExchange,
    ReduceRecord,
    flatten,
    sharded_all_reduce,
    unflatten_into,
)
from p2ptrain.runtime.wire import Codec, ErrorFeedback

MAX_BUCKETS_IN_FLIGHT = 4  # communication threads per stage
# (the step's records, our rank, the group's size, an exchange of its own): raises to refuse the step
Verifier = Callable[[list[ReduceRecord], int, int, GroupExchange], None]


def plan_buckets(numels: Sequence[int], bucket_elements: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, a new bucket once the current one holds
    ``bucket_elements`` or more (a parameter is never split)."""
    buckets: list[list[int]] = []
    size = bucket_elements
    for i in reversed(range(len(numels))):
        if size >= bucket_elements:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += numels[i]
    return buckets


class _Round:
    """The buckets of one step: which are ready, which started, their pending results."""

    def __init__(self, owner: BucketedAllReduce, rank: int, group_size: int,
                 exchange_for: Callable[[int], GroupExchange]):
        self.owner, self.rank, self.group_size, self.exchange_for = owner, rank, group_size, exchange_for
        self.pending = [len(b) for b in owner.buckets]
        self.ready: set[int] = set()
        self.next_to_start = 0
        self.futures: list[Future] = []
        self.armed = False
        self.held = False  # ready buckets wait for ``release`` (the stage's input gradient goes out first)
        self.lock = threading.Lock()
        self.records = [ReduceRecord() for _ in owner.buckets] if owner.verifier is not None else None

    def param_done(self, index: int) -> None:
        with self.lock:
            if not self.armed:
                return
            b = self.owner.bucket_of[index]
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self.ready.add(b)
                self._start_ready()

    def start_all(self) -> None:
        with self.lock:
            self.ready.update(range(len(self.owner.buckets)))
            self.held = False
            self._start_ready()

    def release(self) -> None:
        with self.lock:
            self.held = False
            self._start_ready()

    def _start_ready(self) -> None:
        while not self.held and self.next_to_start in self.ready:
            b = self.next_to_start
            self.futures.append(self.owner.pool.submit(self.owner.reduce_bucket, b, self))
            self.next_to_start += 1


class BucketedAllReduce:
    """Sums a stage's gradients over its replica group, bucket by bucket (see the module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_elements: int, codec: Codec):
        self.params = list(params)
        self.buckets = plan_buckets([p.numel() for p in self.params], bucket_elements)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.feedback = ErrorFeedback(codec)
        self.pool = ThreadPoolExecutor(max_workers=MAX_BUCKETS_IN_FLIGHT, thread_name_prefix="p2ptrain-allreduce")
        weakref.finalize(self, self.pool.shutdown, wait=False)  # an executor per epoch: no idle thread left
        self._round: _Round | None = None
        self.verifier: Verifier | None = None  # checks each step's sums before they are applied (see the module)
        self.overlapped_buckets = 0  # of the last step: buckets started before its backward ended
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, index: int):
        def on_grad(_param: torch.Tensor) -> None:
            current = self._round
            if current is not None:
                current.param_done(index)
        return on_grad

    def begin(self, rank: int, group_size: int, exchange_for: Callable[[int], GroupExchange]) -> None:
        """Start a step: ``exchange_for(bucket)`` talks to the group under that bucket's tags."""
        self._round = _Round(self, rank, group_size, exchange_for)

    def arm(self, hold: bool = False) -> None:
        """The next backward is the step's last: start each bucket as soon as its gradients are final; with
        ``hold``, once they are and ``release`` was called (module docstring)."""
        assert self._round is not None
        with self._round.lock:
            self._round.armed = True
            self._round.held = hold

    def release(self) -> None:
        """Start the buckets ``arm(hold=True)`` held back (those ready now, then each as it becomes ready)."""
        assert self._round is not None
        self._round.release()

    def abandon(self) -> None:
        """The step failed: forget its round (buckets in flight end by their own deadlines, unused)."""
        self._round = None

    def reduce_bucket(self, b: int, round_: _Round) -> torch.Tensor:
        grads = [self.params[i].grad for i in self.buckets[b]]
        flat = flatten([g.detach().cpu() if g is not None else torch.zeros(self.params[i].shape)
                        for g, i in zip(grads, self.buckets[b], strict=True)])
        record = round_.records[b] if round_.records is not None else None
        return sharded_all_reduce(flat, round_.rank, round_.group_size, round_.exchange_for(b), self.feedback, key=b,
                                  record=record)

    def finish(self, loss_sum: torch.Tensor | None) -> float | None:
        """Start what has not started, wait for every bucket, write the sums into ``.grad``; the summed loss
        (exact) when ``loss_sum`` is given."""
        round_ = self._round
        assert round_ is not None
        with round_.lock:
            self.overlapped_buckets = round_.next_to_start
        round_.start_all()
        loss_future = None
        if loss_sum is not None:
            exact = ErrorFeedback(Codec("fp32"))
            exchange = round_.exchange_for(len(self.buckets))
            loss_future = self.pool.submit(sharded_all_reduce, loss_sum.reshape(1).to(torch.float32),
                                           round_.rank, round_.group_size, exchange, exact)
        try:
            extra = [loss_future] if loss_future is not None else []
            totals = wait_all([*round_.futures, *extra])  # each bounded by the exchange's call deadlines
            loss = float(totals.pop()[0]) if extra else None
            if round_.records is not None and self.verifier is not None:
                # an index past the loss's: the verifier's messages never share a tag with the sums'
                self.verifier(round_.records, round_.rank, round_.group_size, round_.exchange_for(len(self.buckets) + 1))
        finally:
            self._round = None
        with torch.no_grad():
            for bucket, total in zip(self.buckets, totals, strict=True):
                slots = [self.params[i].grad if self.params[i].grad is not None else self.params[i].new_zeros(
                    self.params[i].shape) for i in bucket]
                unflatten_into(total.to(slots[0].device), slots)
                for i, g in zip(bucket, slots, strict=True):
                    self.params[i].grad = g
        return loss

    def sum_tensors(self, tensors: Sequence[torch.Tensor], rank: int, group_size: int,
                    exchange_for: Callable[[int], GroupExchange], part: Sequence[int] | None = None,
                    fragment: int = 0, checked: bool = False) -> list[torch.Tensor]:
        """The group's sums of ``tensors`` (one per parameter, e.g. DiLoCo's pseudo-gradients; with ``part``,
        one per parameter of ``part``, indices into the parameters: a fragment's), in this reducer's buckets
        (each cut to ``part``'s parameters) with its error feedback (kept per ``fragment`` when ``part`` is
        given), every bucket at once; new host tensors aligned with ``tensors``. The arithmetic of ``finish``
        on gradients equal to ``tensors``. ``checked`` (with a ``verifier``): every bucket's messages are
        recorded and the verifier checks the sums (over ``exchange_for(len(buckets))``, a tag no bucket's sums
        use) before they are returned; it must then cut no bucket (one fragment: all the parameters)."""
        position = {i: k for k, i in enumerate(part)} if part is not None else {i: i for i in range(len(self.params))}
        cut = [(b, [position[i] for i in bucket if i in position]) for b, bucket in enumerate(self.buckets)]
        cut = [(b, members) for b, members in cut if members]
        records = [ReduceRecord() for _ in cut] if checked and self.verifier is not None else None
        assert records is None or len(cut) == len(self.buckets), "a checked sum covers every bucket"
        futures = [self.pool.submit(sharded_all_reduce, flatten([tensors[k].detach().cpu() for k in members]),
                                    rank, group_size, exchange_for(b), self.feedback,
                                    key=b if part is None else (fragment, b),
                                    record=records[i] if records is not None else None)
                   for i, (b, members) in enumerate(cut)]
        totals = wait_all(futures)
        if records is not None:
            self.verifier(records, rank, group_size, exchange_for(len(self.buckets)))
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for (_, members), total in zip(cut, totals, strict=True):  # each bounded by its calls
            slots = [torch.empty(tensors[k].shape, dtype=tensors[k].dtype) for k in members]
            unflatten_into(total, slots)
            for k, slot in zip(members, slots, strict=True):
                out[k] = slot
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.pool.shutdown(wait=False)
