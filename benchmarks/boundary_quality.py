"""What a stage-boundary codec costs in quality: the same model on the same prepared corpus for the same tokens,
cut into S stages whose boundaries carry the activations and their gradients in each setting's wire and
subspace, validation loss side by side over several seeds against the uncompressed run.

    python benchmarks/boundary_quality.py [--model small] [--steps 500] [--stages 4]
                                          [--settings fp32,int8/k8,int8/k32,int4/k32] [--seeds 0,1,2]
                                          [--batch-size 16] [--data PREPARED | --corpus TEXT] [--jobs N]
                                          [--threads 1] [--eval-every K] [--device cpu|cuda] [--json]

A setting is ``WIRE`` or ``WIRE/kK``: the run's wire format (``runtime.wire``: its activation codec forward, its
activation-gradient codec back) and, with ``kK``, the model's residual stream in a subspace of rank K
(``model.subspace``: K values a token cross a boundary instead of the hidden size). Each run is the single-process
reference of S stages (``runtime.stage_boundaries``: the codecs round-trip at the S − 1 cuts as the workers'
messages do; a test holds the two equal), one replica, every-step: the numbers say what the boundary costs, not
the data-parallel wire or DiLoCo (``benchmarks/diloco.py``). The first setting is the baseline (``fp32``: nothing
lost, no subspace). Printed per setting: the final validation loss (mean over seeds ± half the spread), its ratio
to the baseline's, and the bytes a token sends across a boundary forward / back beside bf16's (2 · hidden size).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
from diloco import _prepared, curve_line, run_all

from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import wire_bytes, wire_format


def _setting(base: TrainConfig, text: str) -> TrainConfig:
    wire, _, rank = text.partition("/k")
    return TrainConfig(**{**base.__dict__, "wire": wire, "subspace": int(rank or 0)})


def _bytes_per_token(cfg: TrainConfig) -> tuple[float, float]:
    """(forward, back) bytes of one token's boundary values in the run's codecs."""
    wire, width = wire_format(cfg.wire), cfg.shape.boundary_width
    n = 1 << 16  # per element over a long message: the block scales amortised as the runtime's messages are
    return (wire_bytes(wire.activation.name, n) / n * width, wire_bytes(wire.activation_grad.name, n) / n * width)


@click.command()
@click.option("--model", default="small", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--stages", type=click.IntRange(min=2), default=4, show_default=True)
@click.option("--settings", default="fp32,int8/k8,int8/k32,int4/k32", show_default=True,
              help="Comma-separated WIRE or WIRE/kK (module docstring); the first is the baseline.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--micro-batches", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--data", help="A prepared dataset (p2ptrain data prepare).  [default: the built-in corpus, prepared]")
@click.option("--corpus", help="A text file or folder to prepare byte-level instead of the built-in corpus.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at once, each in a process of its own.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="CPU threads per run.")
@click.option("--eval-every", type=click.IntRange(min=0), default=0,
              help="Validation curve every K steps.  [default: only after the last step]")
@click.option("--json", "as_json", is_flag=True)
def command(model, steps, stages, settings, batch_size, micro_batches, seeds, data, corpus, device, jobs, threads,
            eval_every, as_json):
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    seed_list = [int(s) for s in seeds.split(",")]
    names = [s.strip() for s in settings.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        base = TrainConfig(model=model, steps=steps, stages=stages, global_batch_size=batch_size,
                           micro_batches=micro_batches, data=_prepared(data, corpus, Path(tmp)),
                           eval_every=eval_every or steps, num_threads=threads, device=device)
        configs = {name: _setting(base, name) for name in names}  # a bad setting: a ValueError before any run
        runs = {(name, seed): TrainConfig(**{**cfg.__dict__, "seed": seed}) for name, cfg in configs.items()
                for seed in seed_list}
        started = time.perf_counter()
        results = run_all(runs, jobs)
    rows = []
    for name, cfg in configs.items():
        curves = [results[(name, seed)][0] for seed in seed_list]
        losses = [curve[-1][1] for curve in curves]
        forward, back = _bytes_per_token(cfg)
        rows.append({"setting": name, "val_losses": losses, "mean": statistics.fmean(losses),
                     "spread": (max(losses) - min(losses)) / 2, "bytes_per_token": [forward, back],
                     "curve": [(step, statistics.fmean(c[i][1] for c in curves)) for i, (step, _) in
                               enumerate(curves[0])]})
    for row in rows:
        row["vs_baseline"] = row["mean"] / rows[0]["mean"]
    bf16 = 2.0 * base.shape.hidden_size
    tokens = steps * batch_size * base.shape.seq_len
    if as_json:
        click.echo(json.dumps({"model": model, "steps": steps, "stages": stages, "batch_size": batch_size,
                               "tokens": tokens, "bf16_bytes_per_token": bf16, "rows": rows,
                               "seconds": time.perf_counter() - started}))
        return
    click.echo(f"{model}, {stages} stages, {steps} steps of {batch_size} sequences ({tokens:,} tokens), seeds "
               f"{seeds}; validation loss after the last step; a boundary's bytes a token forward / back (bf16: "
               f"{bf16:g}):")
    click.echo(f"{'setting':<14} {'val loss':>16} {'vs ' + names[0]:>10} {'bytes / token':>16} {'vs bf16':>14}")
    for row in rows:
        forward, back = row["bytes_per_token"]
        click.echo(f"{row['setting']:<14} {row['mean']:>8.4f} ± {row['spread']:.4f} {row['vs_baseline']:>9.3f}x "
                   f"{forward:>7.1f} / {back:<7.1f} {bf16 / forward:>5.3g}x / {bf16 / back:<5.3g}x")
    if eval_every:
        click.echo(curve_line(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    command()
