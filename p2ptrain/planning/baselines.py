"""Baselines a plan is compared with: Megatron's default rank order and random assignments."""

from __future__ import annotations

import numpy as np

from p2ptrain.planning.cost import CostBreakdown, Objective

RANDOM_SAMPLES = 100


def megatron_assignment(num_devices: int, num_stages: int) -> np.ndarray:
    """Megatron's default rank order: stage j's group is devices j·D_dp … j·D_dp + D_dp − 1, and pipeline
    i is {i, D_dp + i, 2·D_dp + i, …} — consecutive device indices share a stage, no matching, no reorder."""
    replicas = num_devices // num_stages
    return np.arange(num_devices).reshape(num_stages, replicas).T.copy()


def random_assignment(num_devices: int, num_stages: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(num_devices).reshape(num_devices // num_stages, num_stages)


def random_cost(objective: Objective, num_devices: int, rng: np.random.Generator, samples: int = RANDOM_SAMPLES) -> CostBreakdown:
    """The mean cost of ``samples`` uniformly random assignments (the paper's "random" scheduler)."""
    costs = [objective.evaluate(random_assignment(num_devices, objective.num_stages, rng)) for _ in range(samples)]
    return CostBreakdown(
        cost_s=float(np.mean([c.cost_s for c in costs])),
        data_parallel_s=float(np.mean([c.data_parallel_s for c in costs])),
        pipeline_s=float(np.mean([c.pipeline_s for c in costs])),
    )
