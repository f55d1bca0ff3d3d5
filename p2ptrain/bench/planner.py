"""Planner benchmark: our scheduler on the paper's five 64-device networks (8 × 8) and at 1024 devices
(32 × 32, world-wide regions), side by side with Megatron's rank order, random assignments and the
paper's GCMA figures.

    p2ptrain bench planner            # or: python benchmarks/planner.py
    p2ptrain bench planner --json

Search time is CPU time of this process (``time.process_time``: one core, whatever else the machine
runs), next to wall time. GCMA's run times are the paper scheduler's, measured once on one core here.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from p2ptrain.planning import PAPER_REFERENCE, PAPER_WORKLOAD, SCENARIOS, Plan, scenario, schedule

LARGE_DEVICES, LARGE_STAGES = 1024, 32
LARGE_BUDGET_S = 55.0


def _run(name: str, devices: int, stages: int, seed: int, budget_s: float | None) -> dict[str, Any]:
    wall = time.perf_counter()
    plan = schedule(scenario(name, devices), PAPER_WORKLOAD, stages, seed=seed, time_budget_s=budget_s,
                    clock=time.process_time)
    assert isinstance(plan, Plan)
    ours, meg, rnd = plan.cost.cost_s, plan.baselines["megatron"].cost_s, plan.baselines["random"].cost_s
    row = {
        "network": name, "devices": devices, "stages": stages, "ours_s": ours,
        "data_parallel_s": plan.cost.data_parallel_s, "pipeline_s": plan.cost.pipeline_s,
        "megatron_s": meg, "random_s": rnd, "megatron_over_ours": meg / ours, "random_over_ours": rnd / ours,
        "search_cpu_s": plan.search.seconds, "search_wall_s": time.perf_counter() - wall,
        "evaluations": plan.search.evaluations, "stopped_by": plan.search.stopped_by,
    }
    if devices == 64 and stages == 8:
        ref = PAPER_REFERENCE[name]
        row.update(gcma_s=ref["gcma_s"], gcma_over_ours=ref["gcma_s"] / ours, gcma_search_s=ref["gcma_search_s"])
    return row


def run_planner_benchmark(seed: int = 0, large: bool = True) -> list[dict[str, Any]]:
    rows = [_run(name, 64, 8, seed, None) for name in SCENARIOS]
    if large:
        rows.append(_run("worldwide", LARGE_DEVICES, LARGE_STAGES, seed, LARGE_BUDGET_S))
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (f"{'network':<11} {'N':>5} {'S×D':>6} {'ours s':>8} {'Megatron':>9} {'random':>8} {'GCMA':>8}  "
            f"{'Meg/ours':>8} {'rand/ours':>9} {'GCMA/ours':>9}  {'cpu s':>6} {'wall s':>6} {'GCMA s':>6} {'evals':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gcma = f"{r['gcma_s']:8.3f}" if "gcma_s" in r else f"{'—':>8}"
        gcma_ratio = f"{r['gcma_over_ours']:8.2f}×" if "gcma_s" in r else f"{'—':>9}"
        gcma_time = f"{r['gcma_search_s']:6.0f}" if "gcma_s" in r else f"{'—':>6}"
        shape = f"{r['stages']}×{r['devices'] // r['stages']}"
        lines.append(
            f"{r['network']:<11} {r['devices']:>5} {shape:>6} {r['ours_s']:8.3f} {r['megatron_s']:9.3f} "
            f"{r['random_s']:8.3f} {gcma}  {r['megatron_over_ours']:7.2f}× {r['random_over_ours']:8.2f}× "
            f"{gcma_ratio}  {r['search_cpu_s']:6.2f} {r['search_wall_s']:6.2f} {gcma_time} {r['evaluations']:>7}"
        )
    lines.append("cost: seconds of communication per iteration (paper's model, c_PP 0.471249 GB, c_DP 0.65 GB); "
                 "random: mean of 100 random assignments")
    return "\n".join(lines)


@click.command(name="planner")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every search.")
@click.option("--large/--no-large", default=True, show_default=True,
              help=f"Also plan {LARGE_DEVICES} world-wide devices in {LARGE_STAGES} stages (about a minute).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as one JSON document.")
def command(seed: int, large: bool, as_json: bool) -> None:
    """The scheduler on the paper's five networks (64 devices, 8 stages) and at 1024 devices."""
    rows = run_planner_benchmark(seed=seed, large=large)
    click.echo(json.dumps({"planner": rows}) if as_json else format_rows(rows))
