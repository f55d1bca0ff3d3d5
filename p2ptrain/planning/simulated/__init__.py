"""The ``simulated`` objective: the step time of what the runtime really does (GPipe or 1F1B micro-batches over
per-link FIFOs and access links, the bucketed all-reduce, codecs, the checks), not just its traffic. Its
derivation, step by step, is ``docs/simulated.md``.

- ``profile``: ``StepProfile``, what a step does besides moving bytes (compute, codecs, the run's settings),
  and ``StepWorkload``, a workload that carries one;
- ``objective``: ``SimulatedObjective``, the closed form the search optimises (group values, hop values,
  ``combine``), the stage order under the simulation (``refine``) and the exact prediction (``evaluate``);
- ``events``: the event simulation of a plan's steps (``simulate_steps``, ``SimulatedSteps``) without access
  links, and the statistic a prediction reports (``step_period``);
- ``access``: the queues of a simulation over access links (``Access``: each device's uplink and downlink).
"""

from p2ptrain.planning.simulated.events import (
    MAX_SIMULATED_BUCKETS,
    SimulatedSteps,
    bucket_shares,
    step_period,
)
from p2ptrain.planning.simulated.objective import SimulatedObjective
from p2ptrain.planning.simulated.profile import DEFAULT_STEPS, StepProfile, StepWorkload

__all__ = [
    "DEFAULT_STEPS",
    "MAX_SIMULATED_BUCKETS",
    "SimulatedObjective",
    "SimulatedSteps",
    "StepProfile",
    "StepWorkload",
    "bucket_shares",
    "step_period",
]
