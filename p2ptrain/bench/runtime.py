"""Runtime benchmark: transport throughput, and the step time of S × D workers against one process.

Both trainers run the same model, global batch, micro-batches and seed in the same benchmark run, so the
ratio is measured side by side on the same (shared, noisy) machine. The first step of each is left out of
the median (it includes warm-up: allocation, first connections).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from p2ptrain.bench.transport import Throughput, measure_throughput
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
    from p2ptrain.runtime.launcher import train_distributed
    from p2ptrain.runtime.reference import train_reference

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


def run(cfg: TrainConfig, sizes_mib=(1, 4, 16, 64), repeats: int = 5) -> tuple[list[Throughput], StepTimes]:
    return measure_throughput(sizes_mib, repeats), measure_step_times(cfg)
