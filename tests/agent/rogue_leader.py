"""A peer that runs the real agent but leads badly, for the tests of open runs (not a test module).

    python rogue_leader.py bad CONFIG     publishes a structurally valid plan with the worst assignment of its
                                          trainers (every permutation scored; it claims the honest cost)
    python rogue_leader.py silent CONFIG  never plans while it leads (it answers pings, measures links)

Everything else is the agent as shipped: it joins, publishes its profile and links, answers pings.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import sys

import numpy as np

from p2ptrain.agent.agent import Agent
from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.leadership.leader import Leading
from p2ptrain.cli import configure_logging
from p2ptrain.config import config_from_dict, read_toml
from p2ptrain.lifecycle import StopSignal
from p2ptrain.planning import make_objective


class SilentLeading(Leading):
    def lead(self, membership) -> None:
        self._note_waiting("rogue: leading, and never planning")


class SilentLeader(Agent):
    _leading_class = SilentLeading


class WorstPlanning(Leading):
    def _publish_plan(self, planning) -> None:
        plan = planning.future.result()
        objective = make_objective(self.config.plan.objective, planning.cluster, planning.workload, plan["stages"])
        shape = (plan["replicas"], plan["stages"])
        worst = max(itertools.permutations(range(planning.cluster.num_devices)),
                    key=lambda p: objective.evaluate(np.array(p).reshape(shape)).cost_s)  # fmt: skip
        pipelines = [list(row) for row in np.array(worst).reshape(shape).tolist()]
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({**plan, "pipelines": pipelines})  # the honest cost_s stays: it lies about its plan
        super()._publish_plan(dataclasses.replace(planning, future=done))


class WorstPlanner(Agent):
    _leading_class = WorstPlanning


def main(mode: str, config_path: str) -> None:
    configure_logging(1)
    config = config_from_dict(AgentConfig, read_toml(config_path))
    with StopSignal() as stop:
        {"bad": WorstPlanner, "silent": SilentLeader}[mode](config, stop).run()


if __name__ == "__main__":
    main(*sys.argv[1:])
