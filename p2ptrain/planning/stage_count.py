"""How many pipeline stages: every stage count whose stages fit the devices' memory is planned for the
simulated step time with compute, and the fastest plan wins.

Candidates: every S that divides the device count (stages of equal size) and is at most the model's blocks
(``stage_counts``). For each, the workload is the model's at S stages (``layers.model_workload``) with the
run's settings (``StepProfile``: wire, schedule, overlap, clipping, DiLoCo's H and streaming), and M
micro-batches per pipeline (given, or ``default_micro_batches``).

Memory (``layers``, the planner's model for mixed GPUs): a stage's parameters' training state, 16 bytes
each (fp32 weights, gradients, AdamW's two moments; DiLoCo's anchor and outer momentum live in host memory,
``model.outer``, so a DiLoCo run needs no more of the card), plus the activations of the micro-batches it holds at its peak (GPipe:
all M; 1F1B: min(S, M)). With ``recompute`` None, activation recomputation is used only for the stage
counts that do not fit without it (it costs one more forward per backward). Devices that say their
``memory_gb`` are held to it, by the joint planner that also chooses the layer split (``joint``);
devices that do not are held to ``memory_gb`` (None: no limit) with the even split. A stage count that
fits nowhere is kept in the answer with the reason.

Each fitting S is planned by ``scheduler.schedule`` under the ``simulated`` objective (the partition
search, or the joint search on mixed devices) with an equal share of the time budget. A plan's compute
utilisation is its busiest device's compute seconds per step (``SimulatedObjective.compute_s``) over the
step's seconds: the share of the step the slowest-to-finish device computes, 1 when communication and
the pipeline's bubble are all hidden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.layers import (
    LayeredWorkload,
    micro_batches_in_flight,
    model_workload,
)
from p2ptrain.planning.model_shapes import ModelShape
from p2ptrain.planning.plan import Infeasible, Plan
from p2ptrain.planning.scheduler import schedule
from p2ptrain.planning.simulated import SimulatedObjective, StepProfile
from p2ptrain.planning.split import even_layers
from p2ptrain.planning.strategies import DEFAULT_METHOD

SEQUENCES_PER_MICRO_BATCH = 4  # ``default_micro_batches``
MAX_DEFAULT_MICRO_BATCHES = 64  # the simulation's cost grows with M


@dataclass(frozen=True)
class StageOption:
    """One stage count: how it fits (micro-batches, recomputation, each stage's peak memory per device in GB,
    for the plan's split or else the even one), and its plan (of ``workload``) and busiest device's compute
    seconds per step; or why it was skipped."""

    num_stages: int
    micro_batches: int
    recompute: bool
    stage_memory_gb: tuple[float, ...]
    plan: Plan | None = None
    compute_s: float = 0.0
    skipped: str | None = None
    workload: LayeredWorkload | None = field(default=None, repr=False)

    @property
    def step_s(self) -> float | None:
        return None if self.plan is None else self.plan.cost.cost_s

    @property
    def compute_utilisation(self) -> float | None:
        """The busiest device's compute over the step (module docstring)."""
        return None if self.plan is None else self.compute_s / self.plan.cost.cost_s


@dataclass(frozen=True)
class StageChoice:
    """Every candidate stage count, in increasing order; ``best`` is the fastest planned one (None: none fits)."""

    options: tuple[StageOption, ...]

    @property
    def best(self) -> StageOption | None:
        planned = [o for o in self.options if o.plan is not None]
        return min(planned, key=lambda o: o.plan.cost.cost_s) if planned else None


def stage_counts(num_devices: int, num_layers: int) -> tuple[int, ...]:
    """The candidate stage counts: divisors of the device count, at most the model's blocks."""
    return tuple(s for s in range(1, min(num_devices, num_layers) + 1) if num_devices % s == 0)


def default_micro_batches(shape: ModelShape, num_devices: int, num_stages: int, batch_tokens: int) -> int:
    """Micro-batches of at most 4 sequences, and at least 4 per stage (GPipe's bubble is (S − 1)/(M + S − 1)
    of a step), at most ``MAX_DEFAULT_MICRO_BATCHES``."""
    shard_tokens = batch_tokens / (num_devices // num_stages)
    per_micro_batch = SEQUENCES_PER_MICRO_BATCH * shape.seq_len
    return min(max(4 * num_stages, -(-int(shard_tokens) // per_micro_batch)), MAX_DEFAULT_MICRO_BATCHES)


def stage_workload(cluster: Cluster, shape: ModelShape, num_stages: int, *, batch_tokens: int, micro_batches: int,
                   settings: StepProfile, recompute: bool, activation_bytes: int = 2,
                   source: str = "model") -> LayeredWorkload:
    """The model's layered workload at ``num_stages`` stages with the run's ``settings`` (its wire, schedule,
    overlap, clipping, DiLoCo, overheads; its micro-batches and compute come from the model), memory
    counted for the schedule's micro-batches in flight (module docstring)."""
    base = model_workload(shape, cluster, num_stages=num_stages, batch_tokens=batch_tokens,
                          micro_batches=micro_batches, activation_bytes=activation_bytes, recompute=recompute,
                          source=source,
                          in_flight=micro_batches_in_flight(settings.schedule, num_stages, micro_batches))
    step = dataclasses.replace(settings, micro_batches=micro_batches, reference_tflops=base.step.reference_tflops)
    return dataclasses.replace(base, step=step)


def fits_memory(workload: LayeredWorkload, num_stages: int, memory_gb: float | None) -> tuple[float, ...] | None:
    """Each stage's peak memory per device at the even split, or None when a stage needs more than
    ``memory_gb`` (no limit: None)."""
    assert workload.costs is not None
    need = workload.costs.memory(even_layers(workload.costs.num_layers, num_stages))
    return need if memory_gb is None or max(need) <= memory_gb * (1 + 1e-12) else None


def choose_stages(
    cluster: Cluster,
    shape: ModelShape,
    *,
    batch_tokens: int,
    settings: StepProfile | None = None,
    micro_batches: int | None = None,
    recompute: bool | None = None,
    memory_gb: float | None = None,
    activation_bytes: int = 2,
    candidates: tuple[int, ...] | None = None,
    seed: int = 0,
    time_budget_s: float | None = None,
    clock: Callable[[], float] | None = None,
    search: str = DEFAULT_METHOD,
    source: str = "model",
) -> StageChoice:
    """Plan every candidate stage count that fits memory and return them all (module docstring); the choice
    is ``StageChoice.best``. ``memory_gb`` holds devices that do not say their memory; ``recompute`` None:
    recomputation where needed; ``time_budget_s`` (with ``clock``) is shared equally by the plans;
    ``settings`` None: the runtime's defaults (``StepProfile``)."""
    settings = settings or StepProfile()
    counts = candidates if candidates is not None else stage_counts(cluster.num_devices, shape.num_layers)
    for s in counts:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1 or cluster.num_devices % s or s > shape.num_layers:
            raise ValueError(f"{s} stages: the stage count must divide the {cluster.num_devices} devices and be at "
                             f"most the model's {shape.num_layers} blocks")
    mixed = any(d.tflops or d.memory_gb for d in cluster.devices)
    if mixed and memory_gb is not None:  # devices that do not say their memory have ``memory_gb``
        cluster = dataclasses.replace(cluster, devices=tuple(
            dataclasses.replace(d, memory_gb=d.memory_gb or memory_gb) for d in cluster.devices))
    start = clock() if clock is not None else None
    options: list[StageOption] = []
    for k, s in enumerate(counts):
        m = micro_batches or default_micro_batches(shape, cluster.num_devices, s, batch_tokens)
        budget = None
        if time_budget_s is not None and clock is not None and start is not None:
            budget = max((time_budget_s - (clock() - start)) / (len(counts) - k), 1e-3)
        tries = (False, True) if recompute is None else (recompute,)
        option = None
        for again in tries:
            workload = stage_workload(cluster, shape, s, batch_tokens=batch_tokens, micro_batches=m, settings=settings,
                                      recompute=again, activation_bytes=activation_bytes, source=source)
            option = _plan_option(cluster, workload, s, m, again, mixed, memory_gb, seed, budget, clock, search)
            if option.plan is not None:
                break
        assert option is not None
        options.append(option)
    return StageChoice(tuple(options))


def _plan_option(cluster: Cluster, workload: LayeredWorkload, s: int, m: int, recompute: bool, mixed: bool,
                 memory_gb: float | None, seed: int, budget: float | None, clock: Callable[[], float] | None,
                 search: str) -> StageOption:
    assert workload.costs is not None
    even = even_layers(workload.costs.num_layers, s)
    need = workload.costs.memory(even)
    if not mixed:
        if fits_memory(workload, s, memory_gb) is None:
            return StageOption(s, m, recompute, need, skipped=f"a stage needs {max(need):.3g} GB of memory, the "
                                                               f"devices have {memory_gb:.3g} GB")
        plan = schedule(cluster, workload.at(even), s, seed=seed, objective="simulated", time_budget_s=budget,
                        clock=clock if budget is not None else None, search=search)
    else:
        plan = schedule(cluster, workload, s, seed=seed, objective="simulated", time_budget_s=budget,
                        clock=clock if budget is not None else None, search=search)
    if isinstance(plan, Infeasible):
        return StageOption(s, m, recompute, need, skipped=plan.reason)
    layers = plan.layers or even
    objective = SimulatedObjective(cluster, workload.at(layers), s)
    compute_s = objective.compute_s(np.array(plan.pipelines))
    return StageOption(s, m, recompute, workload.costs.memory(layers), plan=plan, compute_s=compute_s,
                       workload=workload)
