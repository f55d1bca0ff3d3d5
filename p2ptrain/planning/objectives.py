"""The objectives a plan can be scored by, by name: the paper's cost (``cost``) and our runtime's step time
(``simulated``, which builds on ``cost``), so that neither module imports the other's caller."""

from __future__ import annotations

import numpy as np

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.cost import DtfmObjective, Objective
from p2ptrain.planning.simulated import SimulatedObjective
from p2ptrain.planning.workload import Workload

OBJECTIVES = ("dtfm", "simulated")


def refine_assignment(objective: Objective, assignment: np.ndarray) -> np.ndarray:
    """``objective.refine(assignment)`` for objectives whose exact cost sees more than the decomposition
    the search uses (``simulated``: where a group sits in the pipeline); the assignment itself otherwise."""
    refine = getattr(objective, "refine", None)
    return refine(assignment) if refine is not None else assignment


def make_objective(name: str, cluster: Cluster, workload: Workload, num_stages: int) -> Objective:
    """The objective called ``name``: "dtfm" (the paper's communication cost, above) or "simulated" (the
    step time of our runtime, ``planning.simulated``; its workload may be a ``StepWorkload`` with a step profile)."""
    if name == "dtfm":
        return DtfmObjective(cluster, workload, num_stages)
    if name == "simulated":
        return SimulatedObjective(cluster, workload, num_stages)
    raise ValueError(f"unknown objective {name!r} (choose from {', '.join(OBJECTIVES)})")
