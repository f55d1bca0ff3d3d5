"""Runtime benchmark: transport throughput, and the step time of S × D workers against one process.

Both trainers run the same model, global batch, micro-batches and seed in the same benchmark run, so the
ratio is measured side by side on the same (shared, noisy) machine. The first step of each is left out of
the median (it includes warm-up: allocation, first connections).

    p2ptrain bench runtime [--model tiny] [--steps 8] [--batch-size 16] [--stages 2 --replicas 2] [--json]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
from dataclasses import dataclass

import click

from p2ptrain.bench.transport import Throughput, measure_throughput, throughput_table
from p2ptrain.lifecycle import logger_levels
from p2ptrain.runtime.config import TrainConfig


@dataclass(frozen=True)
class StepTimes:
    stages: int
    replicas: int
    model: str
    global_batch_size: int
    single_process_median_s: float
    distributed_median_s: float
    losses_equal: bool  # the distributed losses equal the single-process ones (relative 1e-4)

    @property
    def ratio(self) -> float:
        """Distributed step time over single-process step time."""
        return self.distributed_median_s / self.single_process_median_s


def measure_step_times(cfg: TrainConfig) -> StepTimes:
    from p2ptrain.runtime.reference import train_reference
    from p2ptrain.runtime.worker_launcher import train_distributed

    single = train_reference(dataclasses.replace(cfg, stages=1, replicas=1))
    distributed = train_distributed(cfg)
    equal = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(distributed.losses, single.losses, strict=True))
    return StepTimes(
        stages=cfg.stages,
        replicas=cfg.replicas,
        model=cfg.model,
        global_batch_size=cfg.global_batch_size,
        single_process_median_s=statistics.median(single.step_time_s[1:]),
        distributed_median_s=statistics.median(distributed.step_time_s[1:]),
        losses_equal=equal,
    )


def run(cfg: TrainConfig, sizes_mib=(1, 4, 16, 64), repeats: int = 15) -> tuple[list[Throughput], StepTimes]:
    return measure_throughput(sizes_mib, repeats), measure_step_times(cfg)


@click.command(name="runtime", help="Transport throughput on loopback, and the step time of S x D worker processes "
               "beside single-process training (same model, batch and seed), measured in one run.")
@click.option("--model", default="tiny", show_default=True, help="Model preset.")
@click.option("--steps", type=click.IntRange(min=2), default=8, show_default=True, help="Steps per trainer.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="Global batch.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--sizes", default="1,4,16,64", show_default=True, help="Transport tensor sizes, MiB, comma-separated.")
@click.option("--repeats", type=click.IntRange(min=1), default=15, show_default=True,
              help="Interleaved rounds per transport size and pattern (median reported).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def command(model, steps, batch_size, micro_batches, stages, replicas, sizes, repeats, as_json) -> None:
    try:
        sizes_mib = [int(s) for s in sizes.split(",")]
    except ValueError:
        raise click.BadParameter(f"{sizes!r} is not a comma-separated list of MiB", param_hint="--sizes") from None
    click.get_current_context().with_resource(logger_levels({"p2ptrain": logging.WARNING}))  # for this run
    cfg = TrainConfig(model=model, steps=steps, global_batch_size=batch_size, micro_batches=micro_batches,
                      stages=stages, replicas=replicas, num_threads=1)
    throughput, times = run(cfg, sizes_mib, repeats)
    if as_json:
        click.echo(json.dumps({
            "transport": [dataclasses.asdict(t) | {"ratio": t.ratio} for t in throughput],
            "step_time": dataclasses.asdict(times) | {"ratio": times.ratio},
        }))
        return
    click.echo(throughput_table(throughput))
    click.echo(f"\nstep time, {times.model}, global batch {times.global_batch_size}, one torch thread per process")
    click.echo(f"  single process:                      {times.single_process_median_s * 1e3:8.1f} ms")
    click.echo(f"  {times.stages} stages x {times.replicas} replicas (processes): {times.distributed_median_s * 1e3:8.1f} ms")
    click.echo(f"  ratio distributed / single:          {times.ratio:8.2f}x   losses equal: {times.losses_equal}")
