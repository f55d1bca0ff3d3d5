"""What the scheduler returns: a Plan (with its cost, the baselines and how the search went) or Infeasible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2ptrain.planning.cost import CostBreakdown


@dataclass(frozen=True)
class SearchStats:
    """How a plan was found. ``seconds`` is None when the caller gave no clock."""

    seed: int
    evaluations: int
    seconds: float | None = None
    method: str = "clustered"  # a search method (``SEARCH_METHODS``) or "exhaustive" (then it is optimal)
    stopped_by: str = "converged"  # "converged", "evaluations" or "time budget"
    fallback: str | None = None  # "megatron": the search found nothing cheaper, the plan is that order


@dataclass(frozen=True)
class Plan:
    """``pipelines[i][j]`` is the device index holding stage j of pipeline i; column j is stage j's group."""

    pipelines: tuple[tuple[int, ...], ...]
    objective: str
    cost: CostBreakdown
    baselines: dict[str, CostBreakdown]
    search: SearchStats
    # Mixed devices (``joint``): stage j holds blocks [a, b) = layers[j] (None: the even split), its peak
    # memory per device in GB, and what the plan was scored for (wire format of activations, schedule).
    layers: tuple[tuple[int, int], ...] | None = None
    stage_memory_gb: tuple[float, ...] | None = None
    wire: str | None = None
    schedule: str | None = None
    unfit_baselines: tuple[str, ...] = ()  # baselines that do not fit the devices' memory (priced anyway)

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0])

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    def stage_groups(self) -> list[list[int]]:
        """The data-parallel group of each stage (column j of ``pipelines``)."""
        return [[row[j] for row in self.pipelines] for j in range(self.num_stages)]

    def to_json(self) -> dict[str, Any]:
        """The plan document of docs/design.md ("Plan file"), plus a ``search`` object (``method``, ``stopped_by``,
        ``fallback``); plans with a layer split add ``layers``, ``stage_memory_gb``, ``wire`` and
        ``schedule`` (docs/mixed-gpus.md)."""
        doc = {
            "stages": self.num_stages,
            "replicas": self.num_replicas,
            "objective": self.objective,
            "cost_s": self.cost.cost_s,
            "data_parallel_s": self.cost.data_parallel_s,
            "pipeline_s": self.cost.pipeline_s,
            "pipelines": [list(p) for p in self.pipelines],
            "baselines": {name: {"cost_s": c.cost_s, **({"fits": False} if name in self.unfit_baselines else {})}
                          for name, c in self.baselines.items()},
            "search": {
                "seconds": self.search.seconds,
                "evaluations": self.search.evaluations,
                "seed": self.search.seed,
                "method": self.search.method,
                "stopped_by": self.search.stopped_by,
                "fallback": self.search.fallback,
            },
        }
        if self.layers is not None:
            doc["layers"] = [list(r) for r in self.layers]
        if self.stage_memory_gb is not None:
            doc["stage_memory_gb"] = [round(x, 6) for x in self.stage_memory_gb]
        for key in ("wire", "schedule"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return doc


@dataclass(frozen=True)
class Infeasible:
    """No plan exists for this request; ``reason`` is one line saying why and what to change."""

    reason: str
