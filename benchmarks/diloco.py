"""DiLoCo's cost in quality: every-step synchronisation against DiLoCo rounds of H inner steps, the same model
on the same prepared corpus for the same tokens, validation loss side by side over several seeds.

    python benchmarks/diloco.py [--model tiny] [--steps 500] [--replicas 4] [--h 5,10,25] [--outer 1.0:0,...]
                                [--seeds 0,1,2]
                                [--batch-size 16] [--data PREPARED] [--json]

Each run is the single-process reference (``p2ptrain train --simulate-replicas D``, fp32: what a distributed
run of the same settings gives to 1e-4), so the numbers say what the algorithm costs, not the wire. Prints,
per setting, the final validation loss (mean over seeds, ± half the spread between seeds) and its ratio to
every-step sync's, and the number of outer rounds. Without ``--data`` the built-in corpus is prepared
(byte-level, 2 % held out) into a temporary folder.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import click

from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.reference import train_reference

CORPUS = Path(__file__).resolve().parent.parent / "p2ptrain" / "model" / "data"


def _prepared(data: str | None, workdir: Path) -> str:
    if data is not None:
        return data
    from p2ptrain.model.prepare import PrepareConfig, prepare_dataset

    out = workdir / "corpus"
    prepare_dataset(PrepareConfig(str(CORPUS), str(out)))
    return str(out)


@click.command()
@click.option("--model", default="tiny", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=500, show_default=True)
@click.option("--replicas", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--micro-batches", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--h", "hs", default="5,10,25", show_default=True, help="Comma-separated inner steps per round.")
@click.option("--outer", "outers", default="1.0:0", show_default=True,
              help="Comma-separated outer lr:momentum pairs, each run with every H.")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--data", help="A prepared dataset (p2ptrain data prepare).  [default: the built-in corpus, prepared]")
@click.option("--json", "as_json", is_flag=True)
def command(model, steps, replicas, batch_size, micro_batches, hs, outers, seeds, data, as_json):
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = _prepared(data, Path(tmp))
        base = TrainConfig(model=model, steps=steps, replicas=replicas, global_batch_size=batch_size,
                           micro_batches=micro_batches, data=data, eval_every=steps, num_threads=1, device="cpu")
        pairs = [tuple(float(v) for v in pair.split(":")) for pair in outers.split(",")]
        settings = [("every-step", base)] + [
            (f"H={h} {lr:g}/{m:g}", TrainConfig(**{**base.__dict__, "sync": "diloco", "diloco": DiLoCoConfig(
                inner_steps=int(h), outer_lr=lr, outer_momentum=m)}))
            for h in hs.split(",") for lr, m in pairs]  # fmt: skip
        rows = []
        for name, cfg in settings:
            losses, started = [], time.perf_counter()
            for seed in (int(s) for s in seeds.split(",")):
                result = train_reference(TrainConfig(**{**cfg.__dict__, "seed": seed}))
                losses.append(result.val_losses[-1][1])
            rows.append({"setting": name, "val_losses": losses, "mean": statistics.fmean(losses),
                         "spread": (max(losses) - min(losses)) / 2, "seconds": time.perf_counter() - started,
                         "rounds": -(-steps // cfg.diloco.inner_steps) if cfg.sync == "diloco" else steps})
            if not as_json:
                click.echo(f"  {name}: {rows[-1]['mean']:.4f} ± {rows[-1]['spread']:.4f}", err=True)
    baseline = rows[0]["mean"]
    for row in rows:
        row["vs_every_step"] = row["mean"] / baseline
    if as_json:
        click.echo(json.dumps({"model": model, "steps": steps, "replicas": replicas, "batch_size": batch_size,
                               "tokens": steps * batch_size * base.shape.seq_len, "rows": rows}))
        return
    click.echo(f"{model}, {steps} steps of {batch_size} sequences ({steps * batch_size * base.shape.seq_len:,} "
               f"tokens), {replicas} replicas, seeds {seeds}; validation loss after the last step:")
    click.echo(f"{'setting':<18} {'val loss':>16} {'vs every-step':>14} {'outer rounds':>13}")
    for row in rows:
        click.echo(f"{row['setting']:<18} {row['mean']:>8.4f} ± {row['spread']:.4f} {row['vs_every_step']:>13.3f}x "
                   f"{row['rounds']:>13}")


if __name__ == "__main__":
    command()
