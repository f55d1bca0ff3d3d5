"""The wire codecs' CPU cost (issue 31): encode + decode throughput, in MB/s of float32 in, of every codec
(``runtime.wire.CODECS``) on a 1M-element and a 64k-element tensor, one thread; today's codecs beside the
ones before they were made cheaper (the frozen copy ``tests/runtime/wire_oracle.py``, which produces the
same bytes), side by side in one run, old and new interleaved, each the fastest of ``--repeats`` rounds.

    python benchmarks/codec_speed.py [--repeats 7] [--threads 1] [--json]

``topk`` and ``lowrank`` are in no wire and were not changed: both columns time today's code (their
ratio is the noise of the measurement). ``lowrank`` takes the tensor as rows of 256.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch

from p2ptrain.runtime.wire import CODECS, Codec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "runtime"))
import wire_oracle  # noqa: E402  (the frozen copy of the codecs before issue 31)

SIZES = (1 << 20, 1 << 16)
LOWRANK_WIDTH = 256


def _old(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if name not in ("fp32", "bf16", *wire_oracle.QUANTISED):
        return None
    return lambda x: wire_oracle.decode(name, wire_oracle.encode(name, x), tuple(x.shape))


def _new(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return Codec(name).round_trip


def _fastest_s(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


@click.command()
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
def main(repeats: int, threads: int, as_json: bool) -> None:
    torch.set_num_threads(threads)
    rows = []
    for numel in SIZES:
        x = torch.randn(numel // LOWRANK_WIDTH, LOWRANK_WIDTH, generator=torch.Generator().manual_seed(0))
        for name in CODECS:
            old, new = _old(name) or _new(name), _new(name)
            rounds = max(1, (8 << 20) // numel)  # a few ms a sample at the least
            old_s = new_s = float("inf")
            for _ in range(repeats):  # interleaved: a busy moment of the machine spoils both alike
                old_s = min(old_s, _fastest_s(old, x, rounds))
                new_s = min(new_s, _fastest_s(new, x, rounds))
            mb = numel * 4 / 1e6
            rows.append({"codec": name, "elements": numel, "old_mb_s": mb / old_s, "new_mb_s": mb / new_s,
                         "ratio": old_s / new_s, "changed": _old(name) is not None})
    if as_json:
        click.echo(json.dumps({"threads": threads, "rows": rows}))
        return
    click.echo(f"encode + decode, MB/s of float32 in, {threads} thread(s), fastest of {repeats}")
    click.echo(f"{'codec':<8} {'elements':>9} {'before':>9} {'after':>9} {'after/before':>13}")
    for r in rows:
        note = "" if r["changed"] else "  (unchanged)"
        click.echo(f"{r['codec']:<8} {r['elements']:>9} {r['old_mb_s']:>9.0f} {r['new_mb_s']:>9.0f} "
                   f"{r['ratio']:>12.2f}x{note}")


if __name__ == "__main__":
    main()
