"""A shard dispute at a real model size: its bulk, the judge's bound on it, and what finding and judging it cost.

    python benchmarks/shard_dispute.py [--model gpt2] [--stages 2] [--stage 0] [--replicas 2] [--wire fp32]

The stage's parameters are cut into the all-reduce's buckets as a trainer cuts them (``buckets.plan_buckets``,
the default bucket size); for its largest bucket and a median one, a group of ``--replicas`` runs the real sharded
all-reduce and sum check in one process (threads, in-process queues) on random gradients, owner 1 dropping member
0's contribution and attesting what it added (``corrupt_member.py censor``): member 0's check (c) fails with a
shard dispute (``verify.dispute.judge_shard``). Printed per bucket: the shard's elements, the bulk's bytes, the
cap the leader's ``Disputes`` allows a stage of this size, the seconds of member 0's honest-code check (sketches,
signatures, packing the bulk) beside the seconds of the same check on an honest step, and the judge's seconds.
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain.model.stage import build_stage  # noqa: E402
from p2ptrain.net.identity import generate_identity  # noqa: E402
from p2ptrain.planning.model_shapes import model_shape  # noqa: E402
from p2ptrain.runtime.allreduce import REDUCE, ReduceRecord, sharded_all_reduce  # noqa: E402
from p2ptrain.runtime.buckets import plan_buckets  # noqa: E402
from p2ptrain.runtime.executor import DEFAULT_BUCKET_ELEMENTS  # noqa: E402
from p2ptrain.runtime.wire import Codec, ErrorFeedback  # noqa: E402
from p2ptrain.verify.dispute import judge_shard, max_shard_bulk_bytes  # noqa: E402
from p2ptrain.verify.evidence import ShardHeader  # noqa: E402
from p2ptrain.verify.sum_check import SumChecker, VerificationFailed  # noqa: E402

RUN = "shard-dispute"


class _Exchange:
    def __init__(self, queues, rank: int, space: int, censor_from: int | None = None, codec=None, size=0):
        self.queues, self.rank, self.space = queues, rank, space
        self.censor_from, self.codec, self.size, self.real = censor_from, codec, size, None

    def send(self, to_rank, kind, part, tensor) -> Future:
        self.queues[(self.space, self.rank, to_rank, str(kind), part)].put(tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank, kind, part, shape, dtype):
        message = self.queues[(self.space, from_rank, self.rank, str(kind), part)].get(timeout=600)
        if kind == REDUCE and from_rank == self.censor_from:
            self.real = message
            return self.codec.encode(torch.zeros(self.size))
        return message


def _step(numel: int, n: int, codec: Codec, censor: bool, identities) -> tuple[float, object]:
    """One step of the group on one bucket of ``numel`` elements; member 0's check seconds and outcome."""
    group = tuple(i.peer_id for i in identities)
    queues: dict = defaultdict(queue.Queue)
    lock = threading.Lock()
    gen = torch.Generator().manual_seed(numel)
    flats = [torch.randn(numel, generator=gen) for _ in range(n)]
    sizes = [numel // n + (1 if k < numel % n else 0) for k in range(n)]
    out: dict[int, tuple[float, object]] = {}

    def member(r: int) -> None:
        record = ReduceRecord()
        censoring = censor and r == 1
        exchange = _Exchange(queues, r, 0, 0 if censoring else None, codec, sizes[r])
        sharded_all_reduce(flats[r], r, n, exchange, ErrorFeedback(codec), key=0, record=record)
        if censoring:
            record.received[0] = exchange.real
        verifier = SumChecker(identities[r].private_key, RUN, 0, group, codec)
        verifier.begin_step(0, 0)
        started = time.perf_counter()
        try:
            verifier([record], r, n, _Exchange(queues, r, 1))
            outcome = None
        except VerificationFailed as e:
            outcome = e.finding
        with lock:
            out[r] = (time.perf_counter() - started, outcome)

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(member, r) for r in range(n)]:
            f.result()
    return out[0]


@click.command()
@click.option("--model", default="gpt2", show_default=True)
@click.option("--stages", type=click.IntRange(1), default=2, show_default=True)
@click.option("--stage", type=click.IntRange(0), default=0, show_default=True)
@click.option("--replicas", type=click.IntRange(2), default=2, show_default=True)
@click.option("--wire", type=click.Choice(["fp32", "bf16", "int8"]), default="fp32", show_default=True)
def main(model: str, stages: int, stage: int, replicas: int, wire: str) -> None:
    shape = model_shape(model)
    numels = [p.numel() for p in build_stage(shape, stage, stages, 0).parameters()]
    buckets = [sum(numels[i] for i in b) for b in plan_buckets(numels, DEFAULT_BUCKET_ELEMENTS)]
    cap = max_shard_bulk_bytes(sum(numels), len(numels), replicas)
    print(f"{model} stage {stage} of {stages}: {sum(numels) / 1e6:.1f} M parameters in {len(buckets)} buckets "
          f"(largest {max(buckets) / 1e6:.1f} M, median {statistics.median(buckets) / 1e6:.2f} M elements); "
          f"group of {replicas}, wire {wire}; the judge's cap on a bulk: {cap / 1e6:.0f} MB", flush=True)
    codec = Codec(wire)
    identities = [generate_identity() for _ in range(replicas)]
    group = tuple(i.peer_id for i in identities)
    print("bucket     shard elems   bulk MB   honest check s   check with finding s   judge s   verdict")
    for label, numel in (("median", int(statistics.median(buckets))), ("largest", max(buckets))):
        honest_s, none = _step(numel, replicas, codec, False, identities)
        assert none is None, none
        found_s, finding = _step(numel, replicas, codec, True, identities)
        assert finding is not None and finding.check == "attest", finding
        header = ShardHeader.from_bytes(finding.evidence)
        started = time.perf_counter()
        verdict = judge_shard(header, finding.bulk, group[1], RUN, group, codec)
        judge_s = time.perf_counter() - started
        print(f"{label:<10} {numel // replicas:>11,}   {len(finding.bulk) / 1e6:7.2f}   {honest_s:14.3f}   "
              f"{found_s:20.3f}   {judge_s:7.3f}   holds={verdict.holds}", flush=True)


if __name__ == "__main__":
    main()
