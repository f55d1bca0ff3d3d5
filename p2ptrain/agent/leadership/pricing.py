"""The workload a plan is priced with: the leader's, and every follower's check of the leader's plan.

    pricing = PlanPricing(config, view, boundary_s)
    workload = pricing.plan_workload(trainers, membership, train)         # what a plan of trainers is scored by
    workload, layers = pricing.split_workload(trainers, membership, train)  # ... and the split a re-plan keeps
    costs = pricing.measured_costs(membership)                            # message and boundary costs, measured

The leader (``leader.Leader``) owns one; the agent's plan check asks it through ``Leader.pricing``.
Under the ``simulated`` objective the workload carries the trainers' calibrated step profile
(``runtime.calibration``), in the (emulated) network's units; once the run trains with a layer split, every
re-plan keeps it (stage states are handed over per stage).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_maker import run_workload
from p2ptrain.net.dht.records import PlanRecord
from p2ptrain.planning import LayeredWorkload, Workload, even_layers
from p2ptrain.planning.split import Layers
from p2ptrain.runtime.calibration import layered_workload, step_profile, step_workload
from p2ptrain.runtime.config import TrainConfig

logger = logging.getLogger(__name__)


class PlanPricing:
    """Prices plans for an agent with ``config``: ``current`` gives the plan it follows or saw last (whose layer
    split a re-plan keeps), read at each use; ``boundary_s`` the step boundaries' costs, appended while it trains."""

    def __init__(self, config: AgentConfig, current: Callable[[], PlanRecord | None], boundary_s: Sequence[float]):
        self.config = config
        self._current = current
        self._boundary_s = boundary_s

    def plan_workload(self, trainers: list[str], membership: Membership, train: TrainConfig) -> Workload:
        """The workload a plan of ``trainers`` is scored with under ``train`` (the run settings: our own when we
        lead, the plan's when we check the leader's; its ``stages`` the plan's S, ``run_stages.at_stages``)."""
        return self.split_workload(trainers, membership, train)[0]

    def split_workload(self, trainers: list[str], membership: Membership,
                        train: TrainConfig) -> tuple[Workload, Layers | None]:
        """``plan_workload``, and the layer split a re-plan keeps (None: the planner chooses). Stage states
        are kept and handed over per stage, so once the run trains with a split its re-plans keep it (a new
        split would ask a source for blocks it does not hold); the leader and the followers that check its
        plan pin the same split, the one of the plan being trained."""
        stages = train.stages
        workload = run_workload(train, stages, len(trainers) // stages, self.config.emulation.size_factor)
        if self.config.plan.objective == "simulated":
            workload = self._step_workload(workload, trainers, membership, stages, train)
        current = self._current()
        if not isinstance(workload, LayeredWorkload) or current is None:
            return workload, None
        layers = current.layer_ranges or even_layers(workload.costs.num_layers, stages)
        return workload.at(layers), layers

    def _step_workload(self, workload: Workload, trainers: list[str], membership: Membership, stages: int,
                       train: TrainConfig) -> Workload:
        """The workload with the trainers' calibrated step profile, in the (emulated) network's units."""
        emulation = self.config.emulation
        measured = [r.compute for p in trainers if (r := membership.peers.get(p)) is not None and r.compute]
        if len(measured) < len(trainers):
            logger.warning("%d of %d trainers published no calibration; the step profile uses the others'",
                           len(trainers) - len(measured), len(trainers))
        boundary_s = statistics.median(self._boundary_s) if self._boundary_s else 0.0  # every step boundary polls the same
        if measured and len(measured) == len(trainers):  # each device's own measurement (mixed devices)
            return layered_workload(measured, workload, train, len(trainers) // stages,
                                    boundary_s=boundary_s, time_scale=emulation.time_scale if emulation.enabled else 1.0,
                                    size_factor=emulation.size_factor if emulation.enabled else 1.0,
                                    verify=self.config.verify)
        profile = step_profile(measured, train, stages, len(trainers) // stages, boundary_s=boundary_s,
                               time_scale=emulation.time_scale if emulation.enabled else 1.0,
                               size_factor=emulation.size_factor if emulation.enabled else 1.0,
                               verify=self.config.verify)
        return step_workload(workload, profile)

    def measured_costs(self, membership: Membership) -> dict[str, float]:
        """What the stage-count choice prices besides the model: the transport's cost of one message (the
        median of the members' calibrations, where they have one) and our own pause between two steps."""
        messages = [r.compute.message_s for r in membership.peers.values() if r.compute is not None]
        return {"message_s": statistics.median(messages) if messages else 0.0,
                "boundary_s": statistics.median(self._boundary_s) if self._boundary_s else 0.0}
