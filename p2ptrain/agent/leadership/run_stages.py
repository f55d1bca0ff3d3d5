"""The run's stage count S: a number the config fixes, or with ``[train] stages = "auto"`` the one the leader
of the run's first plan chooses, which every later plan keeps. Pure (reads a directory at most).

Stage states, warm copies and checkpoints are per stage index of one S (``churn.restart``,
``churn.stage_state``, ``runtime.checkpoint``): a plan of another S would ask a source for blocks it does
not hold. So a run has one S:

* ``choose_run_stages`` (the leader of an auto run's first plan): every candidate S within ``min_stages``
  .. ``max_stages`` for which the members give at least one replica over which the global batch splits
  (``stage_candidates``: the S of ``plan_maker.trainers_and_spares``) is planned for the simulated step
  time with compute over the trainers S would have, each stage held to the memory their peer records
  publish (``planning.stage_count.choose_stages``), and the fastest wins. The plan is then made at that S
  as with a fixed S, under the run's objective, so that followers check it as they always do.
* ``RunStages`` (every agent): the run's S once known, pinned by the config (a number), else by the first
  plan the agent trained a step of or that restarts from states (states of that S exist from then on), or
  by its own copies on disk when it resumes (``stages_on_disk``). A plan merely followed does not pin it: a
  first plan the other members refused trains nothing, and its leader must then follow the next leader's
  S. ``problem`` says why a plan's S is refused, ``next_plan`` which S the leader's next plan must have.
* ``memory_problem`` (a follower of an auto run): the stage a plan gives it must fit its device's memory.
* ``at_stages``: the run's training config at S, for the code that reads ``train.stages``.

The choice prices everything as measured, not in an emulated network's units: links as the rows say,
bytes as this run's tensors have them, compute from the devices' published TFLOP/s at the planner's
utilisation (``planning.layers``), the run's settings (wire, schedule, buckets, clipping, DiLoCo's H) and
the transport's per-message cost and the pause between steps as the leader measured them. Only the
stage counts' order matters.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from p2ptrain.agent.config import EmulationSettings, PlanConfig
from p2ptrain.agent.leadership.plan_maker import build_cluster, replicas_for, trainers_and_spares
from p2ptrain.net.dht.records import LinksRecord, PeerRecord, PlanRecord
from p2ptrain.planning.layers import layer_model, micro_batches_in_flight
from p2ptrain.planning.simulated import StepProfile
from p2ptrain.planning.split import Layers, even_layers
from p2ptrain.planning.stage_count import StageChoice, choose_stages
from p2ptrain.runtime.calibration import run_settings
from p2ptrain.runtime.checkpoint import latest_complete, saved_stages
from p2ptrain.runtime.config import TrainConfig

logger = logging.getLogger(__name__)

MEASURED = EmulationSettings()  # the choice's cluster: links as measured (``build_cluster`` converts nothing)


class RunStages:
    """The run's S as this agent knows it (module docstring). Shared by the agent's loop, its leader's side
    and its plan checks; set once (``pin``), read anywhere."""

    def __init__(self, train: TrainConfig):
        self.auto = train.stages_auto
        self.low, self.high = train.stage_bounds
        self.pinned: int | None = None if self.auto else train.stages
        self.pinned_by = "" if self.auto else "the run's config"

    def pin(self, stages: int, by: str) -> None:
        """The run's S is ``stages`` from now on (``by``: what said so, for the log); once only."""
        if self.pinned is not None:
            return
        self.pinned, self.pinned_by = stages, by
        logger.info("the run trains %d pipeline stages from now on (%s)", stages, by)

    def problem(self, stages: int) -> str | None:
        """Why a plan of ``stages`` stages is refused (None: it is not)."""
        if not self.auto:
            return None if stages == self.pinned else f"it has {stages} stages; the run trains {self.pinned}"
        if self.pinned is not None and stages != self.pinned:
            return (f"it has {stages} stages where the run's are pinned at {self.pinned} by {self.pinned_by} (a plan "
                    "may not change the stage count: stage states are kept per stage)")
        if not self.low <= stages <= self.high:
            return f'it has {stages} stages, outside the run\'s {self.low} .. {self.high} (stages = "auto")'
        return None

    def next_plan(self, current: PlanRecord | None) -> int | None:
        """The S the leader's next plan must have: the pinned one, else that of the plan the run trains (a
        joiner that leads before it followed a plan); None: the run's first plan, whose leader chooses."""
        if self.pinned is not None:
            return self.pinned
        if current is not None and self.problem(current.stages) is None:
            return current.stages
        return None


@functools.lru_cache(maxsize=16)
def at_stages(train: TrainConfig, stages: int) -> TrainConfig:
    """``train`` with its ``stages`` the run's S (itself if it says S already)."""
    return train if train.stages == stages else dataclasses.replace(train, stages=stages)


def stage_candidates(num_members: int, train: TrainConfig) -> tuple[int, ...]:
    """The stage counts within the run's bounds that ``num_members`` peers can train: at least one replica over
    which the global batch splits (``plan_maker.replicas_for``)."""
    low, high = train.stage_bounds
    return tuple(s for s in range(low, min(high, num_members) + 1) if replicas_for(num_members, train, s) > 0)


def activation_bytes(train: TrainConfig) -> int:
    """Bytes per element of the activations a stage keeps: fp32, or 2 under autocast."""
    return 4 if train.precision == "fp32" else 2


def choose_run_stages(order: Sequence[str], peers: Mapping[str, PeerRecord], rows: Mapping[str, LinksRecord],
                      train: TrainConfig, plan: PlanConfig, *, message_s: float = 0.0, boundary_s: float = 0.0,
                      clock: Callable[[], float] = time.perf_counter) -> StageChoice:
    """Every candidate S (``stage_candidates``) planned over its trainers (the first S × D of ``order``), in
    increasing order; ``best`` is the run's S (module docstring). ``message_s``, ``boundary_s``: the
    transport's cost of one message and the pause between two steps, seconds. ValueError if there is no
    candidate."""
    candidates = stage_candidates(len(order), train)
    if not candidates:
        low, high = train.stage_bounds
        raise ValueError(f"{len(order)} peers cannot train {low} .. {high} stages of a global batch of "
                         f"{train.global_batch_size} in {train.micro_batches} micro-batches")
    full = build_cluster(order, peers, rows, MEASURED)
    # compute from what the devices publish (a calibrated cluster's speeds are in other units)
    full = dataclasses.replace(full, devices=tuple(dataclasses.replace(d, tflops=peers[p].tflops)
                                                   for d, p in zip(full.devices, order, strict=True)))
    settings = StepProfile(micro_batches=train.micro_batches, message_s=message_s, boundary_s=boundary_s,
                           **run_settings(train))
    shape = train.shape
    options = []
    for s in candidates:
        trainers, _ = trainers_and_spares(order, train, s)
        cluster = full.permuted(list(range(len(trainers))))
        choice = choose_stages(cluster, shape, batch_tokens=train.global_batch_size * shape.seq_len, settings=settings,
                               micro_batches=train.micro_batches, recompute=train.activation_checkpointing,
                               activation_bytes=activation_bytes(train), candidates=(s,), seed=plan.seed,
                               time_budget_s=plan.time_budget_s / len(candidates), clock=clock,
                               source=f"{train.model}, batch {train.global_batch_size}")
        options.extend(choice.options)
    return StageChoice(tuple(options))


def stage_memory_gb(train: TrainConfig, num_stages: int, num_replicas: int, layers: Layers) -> tuple[float, ...]:
    """Each stage's peak memory on its device, GB, as the choice holds devices to it (``planning.layers``):
    training state, and the activations of the micro-batches the schedule keeps."""
    shape, m = train.shape, train.micro_batches
    model = layer_model(shape, micro_batch_tokens=train.global_batch_size * shape.seq_len / (num_replicas * m),
                        micro_batches=micro_batches_in_flight(train.schedule, num_stages, m),
                        activation_bytes=activation_bytes(train), recompute=train.activation_checkpointing)
    return model.stage_memory_gb(layers)


def memory_problem(plan: PlanRecord, me: str, memory_gb: float | None, train: TrainConfig) -> str | None:
    """Why the stage ``plan`` gives ``me`` does not fit its device's ``memory_gb`` (None: it fits, or ``me`` is a
    spare, or the memory is unknown)."""
    stage = next((j for i in range(plan.replicas) for j in range(plan.stages) if plan.peer_at(i, j) == me), None)
    if stage is None or memory_gb is None:
        return None
    layers = plan.layer_ranges or even_layers(train.shape.num_layers, plan.stages)
    need = stage_memory_gb(train, plan.stages, plan.replicas, layers)[stage]
    if need > memory_gb * (1 + 1e-12):
        return (f"its stage {stage} of {plan.stages} needs {need:.3g} GB of memory; this agent's device has "
                f"{memory_gb:.3g} GB")
    return None


def stages_on_disk(root: str | Path, train: TrainConfig, *, complete: bool) -> int | None:
    """The S (within the run's bounds) of the newest copies in ``root``: a complete checkpoint of every stage
    (``complete``: a shared directory), or any stage's copy (an agent's own); None if there is none."""
    newest: tuple[int, int] | None = None  # (step, S)
    low, high = train.stage_bounds
    for s in range(low, high + 1):
        if complete:
            step = latest_complete(root, s, train.model)
        else:
            step = max((step for _, step in saved_stages(root, s, train.model)), default=None)
        if step is not None and (newest is None or step > newest[0]):
            newest = (step, s)
    return None if newest is None else newest[1]
