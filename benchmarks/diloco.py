"""DiLoCo's cost in quality: every-step synchronisation against DiLoCo rounds of H inner steps, the same model
on the same prepared corpus for the same tokens, validation loss side by side over several seeds.

    python benchmarks/diloco.py [--model tiny] [--steps 500] [--replicas 4] [--h 5,10,25] [--outer 1.0:0,...]
                                [--overlap off|on|both] [--overlap-steps 0,5] [--fragments 1,5] [--wire int2]
                                [--no-baseline]
                                [--seeds 0,1,2] [--batch-size 16] [--data PREPARED | --corpus TEXT]
                                [--device cpu|cuda] [--precision fp32|bf16] [--jobs N] [--eval-every K] [--json]

Each run is the single-process reference (``p2ptrain train --simulate-replicas D``; in fp32 what a distributed
run of the same settings gives to 1e-4), so the numbers say what the algorithm costs, not the wire. Prints,
per setting, the final validation loss (mean over seeds, ± half the spread between seeds) and its ratio to
every-step sync's, and the number of outer rounds; with ``--eval-every`` the mean curve too. Without
``--data`` the built-in corpus (or ``--corpus``, a text file or folder) is prepared byte-level, 2 % held out,
into a temporary folder. ``--jobs N`` runs N (setting, seed) runs at once, each in a process of its own
(on a GPU they share the card; ``--threads`` CPU threads each).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import click

from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

CORPUS = Path(__file__).resolve().parent.parent / "p2ptrain" / "model" / "data"


def _prepared(data: str | None, corpus: str | None, workdir: Path) -> str:
    if data is not None:
        return data
    from p2ptrain.model.prepare import PrepareConfig, prepare_dataset

    out = workdir / "corpus"
    prepare_dataset(PrepareConfig(str(corpus or CORPUS), str(out)))
    return str(out)


def _pair(text: str) -> tuple[float, float]:
    lr, momentum = text.split(":")
    return float(lr), float(momentum)


def _run(cfg: TrainConfig) -> tuple[list[tuple[int, float]], float]:
    """One run (in a worker process when --jobs > 1): its validation curve and seconds per step."""
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    if cfg.device == "cuda":
        import torch

        torch.zeros(1, device="cuda")  # CUDA's start-up is not the run's time
    started = time.perf_counter()
    result = train_reference(cfg)
    return [(int(step), float(loss)) for step, loss in result.val_losses], (time.perf_counter() - started) / cfg.steps


@click.command()
@click.option("--model", default="tiny", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--replicas", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--h", "hs", default="5,10,25", show_default=True,
              help="Comma-separated inner steps per round; H@lr:m runs that H with that outer setting only.")
@click.option("--outer", "outers", default="1.0:0", show_default=True,
              help="Comma-separated outer lr:momentum pairs, each run with every H.")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--data", help="A prepared dataset (p2ptrain data prepare).  [default: the built-in corpus, prepared]")
@click.option("--corpus", help="A text file or folder to prepare byte-level instead of the built-in corpus.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs at once, each in a process of its own.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="CPU threads per run.")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, help="Validation curve every K steps.  "
              "[default: only after the last step]")
@click.option("--overlap", "overlaps", type=click.Choice(["off", "on", "both"]), default="off", show_default=True,
              help="DiLoCo's delayed outer step (the round's all-reduce overlapped with the next round): without, "
                   "with, or each setting both ways.")
@click.option("--overlap-steps", "taus", default="0", show_default=True,
              help="Comma-separated steps of the next round an overlapped round's all-reduce gets (0: all H).")
@click.option("--fragments", "fragment_counts", default="1", show_default=True,
              help="Comma-separated numbers of Streaming DiLoCo's fragments (each at most H), each run with every "
                   "DiLoCo setting.")
@click.option("--wire", default="fp32", show_default=True,
              help="The run's wire format: DiLoCo's pseudo-gradients are summed in its gradient codec, each replica "
                   "with its own error feedback (the sharded all-reduce, in one process).")
@click.option("--no-baseline", is_flag=True, help="Skip the every-step runs (ratios are then against the first row).")
@click.option("--json", "as_json", is_flag=True)
def command(model, steps, replicas, batch_size, micro_batches, hs, outers, seeds, data, corpus, device, precision,
            jobs, threads, eval_every, overlaps, taus, fragment_counts, wire, no_baseline, as_json):
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    seed_list = [int(s) for s in seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        data = _prepared(data, corpus, Path(tmp))
        base = TrainConfig(model=model, steps=steps, replicas=replicas, global_batch_size=batch_size,
                           micro_batches=micro_batches, data=data, eval_every=eval_every or steps,
                           num_threads=threads, device=device, precision=precision, wire=wire)
        pairs = [_pair(pair) for pair in outers.split(",")]
        grid = [(int(h.split("@")[0]), _pair(h.split("@")[1])) if "@" in h else (int(h), pair)
                for h in hs.split(",") for pair in ([None] if "@" in h else pairs)]
        tau_list = [int(t) for t in taus.split(",")]
        modes = {"off": [None], "on": tau_list, "both": [None, *tau_list]}[overlaps]
        fragment_list = [int(f) for f in fragment_counts.split(",")]
        settings = ([] if no_baseline else [("every-step", base)]) + [
            (f"H={h} {lr:g}/{m:g}{'' if tau is None else f' overlap {tau or h}'}{f' F{f}' if f > 1 else ''}",
             TrainConfig(**{**base.__dict__, "sync": "diloco", "diloco": DiLoCoConfig(
                 inner_steps=h, outer_lr=lr, outer_momentum=m, overlap=tau is not None, overlap_steps=tau or 0,
                 fragments=f)}))
            for h, (lr, m) in grid for tau in modes for f in fragment_list]
        runs = {(name, seed): TrainConfig(**{**cfg.__dict__, "seed": seed}) for name, cfg in settings
                for seed in seed_list}
        started = time.perf_counter()
        results = run_all(runs, jobs)
        rows = []
        for name, cfg in settings:
            curves = [results[(name, seed)][0] for seed in seed_list]
            losses = [curve[-1][1] for curve in curves]
            rows.append({"setting": name, "val_losses": losses, "mean": statistics.fmean(losses),
                         "spread": (max(losses) - min(losses)) / 2,
                         "curve": [(step, statistics.fmean(c[i][1] for c in curves))
                                   for i, (step, _) in enumerate(curves[0])],
                         "ms_per_step": 1e3 * statistics.fmean(results[(name, s)][1] for s in seed_list),
                         "rounds": -(-steps // cfg.diloco.inner_steps) if cfg.sync == "diloco" else steps})
    baseline = rows[0]["mean"]
    for row in rows:
        row["vs_every_step"] = row["mean"] / baseline
    tokens = steps * batch_size * base.shape.seq_len
    if as_json:
        click.echo(json.dumps({"model": model, "steps": steps, "replicas": replicas, "batch_size": batch_size,
                               "device": device, "precision": precision, "tokens": tokens, "rows": rows,
                               "seconds": time.perf_counter() - started}))
        return
    click.echo(f"{model}, {steps} steps of {batch_size} sequences ({tokens:,} tokens), {replicas} replicas, "
               f"{device} {precision}, seeds {seeds}; validation loss after the last step:")
    click.echo(f"{'setting':<22} {'val loss':>16} {'vs every-step':>14} {'outer rounds':>13}")
    for row in rows:
        click.echo(f"{row['setting']:<22} {row['mean']:>8.4f} ± {row['spread']:.4f} {row['vs_every_step']:>13.3f}x "
                   f"{row['rounds']:>13}")
    if eval_every:
        click.echo(curve_line(rows))
    sys.stdout.flush()


def run_all(runs: dict[tuple[str, int], TrainConfig], jobs: int) -> dict[tuple[str, int], tuple[list, float]]:
    """Every (setting, seed) run's validation curve and seconds per step, ``jobs`` at once in processes of their
    own (one: in this process), each said on stderr as it ends."""
    results, started = {}, time.perf_counter()

    def said(key):
        curve, step_s = results[key]
        click.echo(f"  {key[0]} seed {key[1]}: {curve[-1][1]:.4f} ({step_s * 1e3:.0f} ms/step, "
                   f"{time.perf_counter() - started:.0f} s)", err=True)

    if jobs == 1:
        for key, cfg in runs.items():
            results[key] = _run(cfg)
            said(key)
        return results
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run, cfg): key for key, cfg in runs.items()}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            said(futures[future])
    return results


def curve_line(rows: list[dict]) -> str:
    """The rows' mean validation curves on one line."""
    return "mean validation loss by step: " + "; ".join(
        f"{row['setting']}: " + " ".join(f"{step}:{loss:.3f}" for step, loss in row["curve"]) for row in rows)


if __name__ == "__main__":
    command()
