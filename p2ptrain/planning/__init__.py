"""p2ptrain.planning — pure planning: which device runs which (pipeline, stage).

numpy, scipy and networkx only; no torch, hivemind, asyncio, clock or global RNG. The leader agent calls
``schedule`` in-process with the measured cluster::

    from p2ptrain.planning import load_cluster, schedule, PAPER_WORKLOAD
    plan = schedule(load_cluster("cluster.json"), PAPER_WORKLOAD, num_stages=8, seed=0)
    plan.to_json()  # or an Infeasible with the reason

- ``cluster``: the devices and every pair's delay and bandwidth; ``measured``: regions recovered from noisy
  links, and noisy twins; ``estimated``: whom each peer measures, and the other links estimated;
  ``canonical``: a device order independent of the listing; ``scenarios``: the
  paper's five networks.
- ``workload``: the bytes crossing a stage boundary and all-reduced per stage; ``layers``: the workload per
  layer; ``model_shapes``: the presets' dimensions; ``split``: layer splits.
- ``cost``: the paper's cost model; ``simulated/``: the runtime's step time (derived in
  ``docs/simulated.md``); ``wire_model``: what the runtime's settings do to a step; ``objectives``: both by name.
- ``scheduler``: ``schedule``, the entry point; ``strategies``: the search methods by name; ``search``: the
  partition search; ``clustered``: the default search on the network's structure; ``starts``: where it
  starts; ``path`` and ``matching``: the stage order and one hop's cost; ``gcma``: the paper's scheduler;
  ``exhaustive``: the exact optimum for small clusters; ``joint``: layer split and assignment together for
  mixed devices; ``stage_count``: how many stages.
- ``plan``: a ``Plan`` or ``Infeasible``; ``report``: a plan for people; ``baselines``: Megatron's order and
  random assignments.
"""

from p2ptrain.planning.baselines import megatron_assignment, random_assignment, random_cost
from p2ptrain.planning.cluster import Cluster, Device, cluster_from_dict, load_cluster
from p2ptrain.planning.cost import CostBreakdown, DtfmObjective, Objective
from p2ptrain.planning.exhaustive import solve_exhaustive
from p2ptrain.planning.gcma import GcmaConfig
from p2ptrain.planning.layers import (
    LayerCosts,
    LayeredWorkload,
    LayerModel,
    Parts,
    layer_model,
    model_workload,
)
from p2ptrain.planning.measured import link_clusters, perturbed
from p2ptrain.planning.model_shapes import MODEL_PRESETS, ModelShape, model_shape
from p2ptrain.planning.objectives import make_objective
from p2ptrain.planning.plan import Infeasible, Plan, SearchStats
from p2ptrain.planning.scenarios import ALL_SCENARIOS, MIXED_SCENARIOS, PAPER_REFERENCE, SCENARIOS, scenario
from p2ptrain.planning.scheduler import schedule
from p2ptrain.planning.search import SearchConfig
from p2ptrain.planning.simulated import SimulatedObjective, StepProfile, StepWorkload
from p2ptrain.planning.split import check_layers, even_layers
from p2ptrain.planning.stage_count import StageChoice, StageOption, choose_stages
from p2ptrain.planning.strategies import DEFAULT_METHOD, SEARCH_METHODS
from p2ptrain.planning.workload import PAPER_WORKLOAD, Workload, parameter_count, workload_from_model

__all__ = [
    "ALL_SCENARIOS",
    "MIXED_SCENARIOS",
    "LayerCosts",
    "LayerModel",
    "LayeredWorkload",
    "Parts",
    "check_layers",
    "even_layers",
    "layer_model",
    "model_workload",
    "MODEL_PRESETS",
    "PAPER_REFERENCE",
    "DEFAULT_METHOD",
    "PAPER_WORKLOAD",
    "SCENARIOS",
    "SEARCH_METHODS",
    "Cluster",
    "CostBreakdown",
    "Device",
    "DtfmObjective",
    "GcmaConfig",
    "Infeasible",
    "ModelShape",
    "Objective",
    "Plan",
    "SearchConfig",
    "SearchStats",
    "SimulatedObjective",
    "StageChoice",
    "StageOption",
    "StepProfile",
    "StepWorkload",
    "Workload",
    "choose_stages",
    "cluster_from_dict",
    "link_clusters",
    "load_cluster",
    "make_objective",
    "megatron_assignment",
    "model_shape",
    "parameter_count",
    "perturbed",
    "random_assignment",
    "random_cost",
    "scenario",
    "schedule",
    "solve_exhaustive",
    "workload_from_model",
]
