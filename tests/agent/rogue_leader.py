"""A peer that runs the real agent but leads badly, for the tests of open runs (not a test module).

    python rogue_leader.py bad CONFIG     publishes a structurally valid plan with the worst assignment of its
                                          trainers (every permutation scored; it claims the honest cost)
    python rogue_leader.py silent CONFIG  never plans while it leads (it answers pings, measures links)
    python rogue_leader.py leaves_out CONFIG   its plans plan itself and the next two peers only
    python rogue_leader.py idle_stage CONFIG   plans honestly with itself as a trainer (the planner's own
                                          assignment: a plan as cheap as any follower's), then never computes
                                          (it takes tensors, and halts once another peer did)
    python rogue_leader.py other_data CONFIG   its peer record claims another dataset; it leads in its own view
    python rogue_leader.py int4 CONFIG    its plans switch the run's wire to int4 (its peer record says fp32)
    python rogue_leader.py late_silent CONFIG  silent, and joins the run once CONFIG.go exists (a fresh key
                                          arriving while the run trains)
    python rogue_leader.py silent_replan CONFIG  plans the run's first plan as shipped and trains in it, then
                                          never re-plans (silent at the first failure)

Everything else is the agent as shipped: it joins, publishes its profile and links, answers pings.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np
from gated_agent import GatedAgent
from rogue_member import CooperativeSwallower

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.leadership.leader import Leader
from p2ptrain.agent.leadership.membership import Membership
from p2ptrain.agent.leadership.plan_maker import cluster_order, trainers_and_spares
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal
from p2ptrain.planning import make_objective


class SilentLeading(Leader):
    def lead(self, membership) -> None:
        self._note_waiting("rogue: leading, and never planning")


class SilentLeader(Agent):
    _leading_class = SilentLeading


class LateSilent(GatedAgent):
    _leading_class = SilentLeading


class WorstPlanning(Leader):
    def _publish_plan(self, planning) -> None:
        plan = planning.future.result()
        objective = make_objective(self.config.plan.objective, planning.cluster, planning.workload, plan["stages"])
        shape = (plan["replicas"], plan["stages"])
        worst = max(itertools.permutations(range(planning.cluster.num_devices)),
                    key=lambda p: objective.evaluate(np.array(p).reshape(shape)).cost_s)
        pipelines = [list(row) for row in np.array(worst).reshape(shape).tolist()]
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({**plan, "pipelines": pipelines})  # the honest cost_s stays: it lies about its plan
        super()._publish_plan(dataclasses.replace(planning, future=done))


class WorstPlanner(Agent):
    _leading_class = WorstPlanning


class LeavesOutLeading(Leader):
    def _start_planning(self, membership, trainers, spares, rows, trigger, replan, start_step, sources,
                        step_s=0.0) -> None:
        # every plan: itself and the next two peers, two live honest agents left out (an honest plan right after a
        # bad one is followed by those that never read the bad one and refused by those that did: the run splits)
        membership = Membership({p: membership.peers[p] for p in membership.ids[:3]})
        trainers, spares = trainers_and_spares(cluster_order(membership.peers), self.config.train)
        super()._start_planning(membership, trainers, spares, rows, trigger, replan, start_step, sources, step_s)


class LeavesOut(Agent):
    _leading_class = LeavesOutLeading


class IdleStageLeading(Leader):
    def _start_planning(self, membership, trainers, spares, rows, trigger, replan, start_step, sources,
                        step_s=0.0) -> None:
        if self.peer_id in spares:  # a spare by the cluster order: it makes itself a trainer
            k = spares.index(self.peer_id)
            trainers, spares = [*trainers[:-1], self.peer_id], [*spares[:k], trainers[-1], *spares[k + 1:]]
        super()._start_planning(membership, trainers, spares, rows, trigger, replan, start_step, sources, step_s)


class IdleStage(CooperativeSwallower):  # given a stage, it takes tensors, answers nothing, halts when told
    _leading_class = IdleStageLeading


OTHER_DATA = "byte-256:ffffffffffffffff"


class OtherData(Agent):
    def _publish_peer_record(self, profile, compute=None) -> None:
        real, self.data_id = self.data_id, OTHER_DATA  # says so in its record; its own view keeps the real one
        try:
            super()._publish_peer_record(profile, compute)
        finally:
            self.data_id = real


class SilentReplanLeading(Leader):
    def _replan(self, current, membership) -> None:
        self._note_waiting("rogue: leading, and never re-planning")


class SilentReplan(Agent):
    _leading_class = SilentReplanLeading


class Int4Leading(Leader):
    def __init__(self, config, *args, **kwargs):
        super().__init__(dataclasses.replace(config, train=dataclasses.replace(config.train, wire="int4")), *args,
                         **kwargs)


class Int4(Agent):
    _leading_class = Int4Leading


MODES = {"bad": WorstPlanner, "silent": SilentLeader, "leaves_out": LeavesOut, "idle_stage": IdleStage,
         "other_data": OtherData, "int4": Int4, "late_silent": LateSilent,
         "silent_replan": SilentReplan}


def main(mode: str, config_path: str) -> None:
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        agent = MODES[mode](config, stop)
        agent.gate = Path(config_path + ".go")  # read by the gated modes only
        agent.run()


if __name__ == "__main__":
    main(*sys.argv[1:])
