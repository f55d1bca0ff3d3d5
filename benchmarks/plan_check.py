"""A follower's check of a leader's plan at scale (issue 48): the leader's search beside the follower's, which
stops after ``plan.verify_device_evaluations`` over the devices (``plan_maker.check_search``) and leaves out the
random baseline. The world-wide network scaled to each size, its links perturbed ±10 % as measured links are.

    python benchmarks/plan_check.py [--sizes 64,256,1024] [--objective dtfm|simulated] [--budget 60]

Prints, per size, each search's seconds and evaluations, whether the follower's stopped short (where a silent
leader then gets the whole budget), and the follower's plan's cost over the leader's: an honest leader passes
while that is at least 1 / (1 + ``plan.verify_tolerance``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import click
import numpy as np

from p2ptrain.agent.config import PlanConfig
from p2ptrain.agent.leadership.plan_maker import check_search, make_plan, stopped_short
from p2ptrain.planning import PAPER_WORKLOAD, scenario
from p2ptrain.planning.measured import perturbed
from p2ptrain.planning.simulated import StepProfile, StepWorkload


@click.command()
@click.option("--sizes", default="64,256,1024", show_default=True, help="Devices, comma-separated.")
@click.option("--objective", type=click.Choice(["dtfm", "simulated"]), default="dtfm", show_default=True,
              help="What plans are scored by (the agents' default: dtfm).")
@click.option("--budget", type=float, default=60.0, show_default=True, help="plan.time_budget_s.")
def main(sizes: str, objective: str, budget: float) -> None:
    logging.getLogger("p2ptrain").setLevel(logging.WARNING)
    config = PlanConfig(objective=objective, time_budget_s=budget)
    workload = PAPER_WORKLOAD if objective == "dtfm" else StepWorkload(
        PAPER_WORKLOAD.activation_gb, PAPER_WORKLOAD.gradient_gb, "paper", step=StepProfile(micro_batches=4))
    print(f"objective {objective}, budget {budget:g} s, verify_device_evaluations {config.verify_device_evaluations}")
    print(f"{'devices':>7} {'stages':>6} {'leader s':>9} {'evals':>7} {'check s':>8} {'cap':>6} {'evals':>7} "
          f"{'short':>5} {'check/leader cost':>17} {'time':>6}")
    for n in (int(s) for s in sizes.split(",")):
        stages = 4 if n < 256 else 8
        cluster, _ = perturbed(scenario("worldwide", n), 0.1, np.random.default_rng(0))
        runs = {}
        for check in (False, True):
            started = time.perf_counter()
            runs[check] = (make_plan(cluster, workload, stages, dataclasses.replace(config), check=check),
                           time.perf_counter() - started)
        (leader, leader_s), (own, own_s) = runs[False], runs[True]
        print(f"{n:>7} {stages:>6} {leader_s:>9.1f} {leader['search']['evaluations']:>7} {own_s:>8.1f} "
              f"{check_search(config, n).max_evaluations:>6} {own['search']['evaluations']:>7} "
              f"{'yes' if stopped_short(own['search'], config, n) else 'no':>5} "
              f"{own['cost_s'] / leader['cost_s']:>16.3f}x {own_s / leader_s:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
