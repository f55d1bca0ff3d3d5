"""Runtime benchmark: transport throughput on loopback, and step time of --stages 2 --replicas 2 against
single-process training for the same model and batch, measured side by side in one run.

    python benchmarks/runtime.py [--model tiny] [--steps 8] [--batch-size 16] [--stages 2 --replicas 2] [--json]

The same as ``p2ptrain bench runtime``.
"""

from __future__ import annotations

import logging

from p2ptrain.bench.runtime import command

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    command()
