"""The sum check's own CPU per member and step, in one process: the real all-reduce and ``SumChecker`` of a group
of two, with real signatures, the messages through in-process queues (no transport, no waits counted).

    python benchmarks/sum_check_cpu.py                                # small's stage, fp32, bf16 and int8
    python benchmarks/sum_check_cpu.py --params 81000000 --codecs bf16 --steps 4

Each member's thread CPU time in ``SumChecker.__call__`` (``time.thread_time``: the sketches, digests,
signatures and judgements, none of the waits for the other member), the first two steps left out (the running
sums start, buffers are made); the median and the fastest over the rest and both members, and per parameter of
the stage. The stage is cut into buckets of ``[train] bucket_elements`` as the runtime cuts it. One torch thread
per member, as the agents run.
"""

from __future__ import annotations

import queue
import statistics
import threading
import time
from concurrent.futures import Future

import click
import torch

from p2ptrain.net.identity import generate_identity
from p2ptrain.runtime.allreduce import ReduceRecord, sharded_all_reduce
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import Codec, ErrorFeedback
from p2ptrain.verify.sum_check import SumChecker

SMALL_STAGE = 4_800_000  # parameters of one of the `small` preset's two stages, about


class _Exchange:
    """A member's view of the group for one space of tags: sends go into the receiver's queue."""

    def __init__(self, queues: dict, lock: threading.Lock, rank: int, space: int):
        self.queues, self.lock, self.rank, self.space = queues, lock, rank, space

    def _queue(self, key) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault(key, queue.Queue())

    def send(self, to_rank, kind, part, tensor) -> Future:
        self._queue((self.space, self.rank, to_rank, str(kind), part)).put(tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def recv(self, from_rank, kind, part, shape, dtype) -> torch.Tensor:
        return self._queue((self.space, from_rank, self.rank, str(kind), part)).get(timeout=60)


def member_cpu_s(codec_name: str, params: int, bucket_elements: int, steps: int) -> list[float]:
    """Both members' CPU seconds in the check, per step after the first two."""
    n = 2
    identities = [generate_identity() for _ in range(n)]
    group = tuple(i.peer_id for i in identities)
    codec = Codec(codec_name)
    numels = [bucket_elements] * (params // bucket_elements) + ([params % bucket_elements] if params % bucket_elements else [])
    feedbacks = [ErrorFeedback(codec) for _ in range(n)]
    checkers = [SumChecker(identities[r].private_key, "bench", 0, group, codec) for r in range(n)]
    generator = torch.Generator().manual_seed(0)
    measured: list[float] = []
    for step in range(steps + 2):
        queues: dict = {}
        lock = threading.Lock()
        flats = [[torch.randn(m, generator=generator) for m in numels] for _ in range(n)]
        cpu = [0.0] * n

        def member(r: int, flats=flats, queues=queues, lock=lock, cpu=cpu, step=step) -> None:
            torch.set_num_threads(1)
            records = [ReduceRecord() for _ in numels]
            for b in range(len(numels)):
                sharded_all_reduce(flats[r][b], r, n, _Exchange(queues, lock, r, b), feedbacks[r], key=b,
                                   record=records[b])
            checkers[r].begin_step(0, step)
            started = time.thread_time()
            checkers[r](records, r, n, _Exchange(queues, lock, r, len(numels) + 1))
            cpu[r] = time.thread_time() - started

        threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if step >= 2:
            measured += cpu
    return measured


@click.command()
@click.option("--params", default=SMALL_STAGE, show_default=True, type=click.IntRange(min=1000),
              help="Parameters of the stage.")
@click.option("--codecs", default="fp32,bf16,int8", show_default=True, help="Gradient codecs, comma-separated.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1), help="Measured steps.")
def main(params: int, codecs: str, steps: int) -> None:
    bucket_elements = TrainConfig().bucket_elements
    click.echo(f"a member of a group of 2, a stage of {params:,} parameters in buckets of {bucket_elements:,}, "
               f"{steps} steps")
    for name in codecs.split(","):
        cpu = member_cpu_s(name.strip(), params, bucket_elements, steps)
        median = statistics.median(cpu)
        click.echo(f"  {name.strip():5s}: {median * 1e3:7.1f} ms a step (fastest {min(cpu) * 1e3:.1f}), "
                   f"{median / params * 1e9:.1f} ns per parameter")


if __name__ == "__main__":
    main()
