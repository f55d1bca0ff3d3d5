"""Runtime benchmark: transport throughput on loopback, and step time of --stages 2 --replicas 2 against
single-process training for the same model and batch, measured side by side in one run.

    python benchmarks/runtime.py [--model tiny] [--steps 8] [--batch-size 16] [--stages 2 --replicas 2] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from p2ptrain.bench.runtime import run
from p2ptrain.runtime.config import TrainConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sizes", default="1,4,16,64", help="transport tensor sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = TrainConfig(model=args.model, steps=args.steps, global_batch_size=args.batch_size,
                      micro_batches=args.micro_batches, stages=args.stages, replicas=args.replicas, num_threads=1)
    throughput, steps = run(cfg, [int(s) for s in args.sizes.split(",")], args.repeats)
    if args.json:
        print(json.dumps({
            "transport": [dataclasses.asdict(t) for t in throughput],
            "step_time": dataclasses.asdict(steps) | {"ratio": steps.ratio},
        }))
        return
    print("transport throughput on loopback (median of repeats)")
    print(f"{'size MiB':>8} {'transport MB/s':>14} {'raw stream MB/s':>16} {'ratio':>6}")
    for t in throughput:
        print(f"{t.size_mib:>8} {t.transport_mb_per_s:>14.0f} {t.raw_stream_mb_per_s:>16.0f} {t.ratio:>6.2f}")
    print()
    print(f"step time, {steps.model}, global batch {steps.global_batch_size}, one torch thread per process")
    print(f"  single process:                      {steps.single_process_median_s * 1e3:8.1f} ms")
    print(f"  {steps.stages} stages x {steps.replicas} replicas (processes): {steps.distributed_median_s * 1e3:8.1f} ms")
    print(f"  ratio distributed / single:          {steps.ratio:8.2f}x   losses equal: {steps.losses_equal}")


if __name__ == "__main__":
    main()
