"""Planner benchmark: our scheduler on the paper's five 64-device networks (8 × 8) and at 1024 devices
(32 × 32, world-wide regions), side by side with Megatron's rank order, random assignments and the
paper's GCMA figures (quoted: a reference column); then the same networks *as measured* (every link's
latency and bandwidth perturbed, device order shuffled), where GCMA runs live beside ours.

    p2ptrain bench planner            # or: python benchmarks/planner.py
    p2ptrain bench planner --no-large --perturbation 0.25
    p2ptrain bench planner --json

Search time is CPU time of this process (``time.process_time``: one core, whatever else the machine
runs), next to wall time. GCMA's quoted run times are the paper scheduler's, measured once on one core.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click
import numpy as np

from p2ptrain.planning import (
    PAPER_REFERENCE,
    PAPER_WORKLOAD,
    SCENARIOS,
    DtfmObjective,
    Plan,
    scenario,
    schedule,
)
from p2ptrain.planning.measured import perturbed

LARGE_DEVICES, LARGE_STAGES = 1024, 32
LARGE_BUDGET_S = 55.0
MEASURED_BUDGET_S = 5.0  # CPU seconds, the same for ours and GCMA on the measured 64-device networks
PERTURBATION = 0.10


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


def _timed(cluster: Any, stages: int, seed: int, budget_s: float, method: str) -> tuple[Plan, float]:
    start = time.process_time()
    plan = schedule(cluster, PAPER_WORKLOAD, stages, seed=seed, time_budget_s=budget_s, clock=time.process_time,
                    search=method)
    assert isinstance(plan, Plan)
    return plan, time.process_time() - start


def _measured(name: str, devices: int, stages: int, seed: int, level: float, budget_s: float, gcma: bool,
              shuffle: bool) -> dict[str, Any]:
    """One perturbed network: ours, GCMA (live, same budget), Megatron's order and the exact-network plan,
    all on the perturbed links."""
    exact = scenario(name, devices)
    noisy, order = perturbed(exact, level, np.random.default_rng(seed), shuffle=shuffle)
    objective = DtfmObjective(noisy, PAPER_WORKLOAD, stages)
    inverse = np.argsort(order)
    exact_plan = schedule(exact, PAPER_WORKLOAD, stages, seed=seed, time_budget_s=budget_s, clock=time.process_time)
    assert isinstance(exact_plan, Plan)
    ours, ours_cpu = _timed(noisy, stages, seed, budget_s, "clustered")
    megatron = objective.evaluate(inverse[np.arange(devices).reshape(stages, -1).T]).cost_s  # in *region* order
    row = {
        "network": name, "devices": devices, "stages": stages, "perturbation": level, "seed": seed,
        "budget_cpu_s": budget_s, "ours_s": ours.cost.cost_s, "ours_cpu_s": ours_cpu,
        "ours_evaluations": ours.search.evaluations, "ours_fallback": ours.search.fallback,
        "megatron_s": megatron, "exact_plan_s": objective.evaluate(inverse[np.array(exact_plan.pipelines)]).cost_s,
    }
    if gcma:
        theirs, gcma_cpu = _timed(noisy, stages, seed, budget_s, "gcma")
        row.update(gcma_s=theirs.cost.cost_s, gcma_cpu_s=gcma_cpu, gcma_evaluations=theirs.search.evaluations,
                   gcma_fallback=theirs.search.fallback)
    return row


def run_measured_benchmark(seed: int = 0, large: bool = True, level: float = PERTURBATION,
                           budget_s: float = MEASURED_BUDGET_S) -> list[dict[str, Any]]:
    """The five networks perturbed by ±``level`` and shuffled (GCMA live beside ours, the same CPU budget);
    with ``large``, 1024 world-wide devices perturbed in region order (ours only: GCMA's cyclic partitioning
    is quadratic in devices a move)."""
    rows = [_measured(name, 64, 8, seed, level, budget_s, True, True) for name in SCENARIOS]
    if large:
        rows.append(_measured("worldwide", LARGE_DEVICES, LARGE_STAGES, seed, level, LARGE_BUDGET_S, False, False))
    return rows


def format_measured(rows: list[dict[str, Any]]) -> str:
    head = (f"{'network':<11} {'N':>5} {'ours s':>8} {'GCMA s':>8} {'Megatron':>9} {'exact plan':>10}  "
            f"{'GCMA/ours':>9} {'Meg/ours':>8} {'exact/ours':>10}  {'ours cpu':>8} {'GCMA cpu':>8} {'budget':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        has = "gcma_s" in r
        gcma = f"{r['gcma_s']:8.3f}" if has else f"{'—':>8}"
        gcma_ratio = f"{r['gcma_s'] / r['ours_s']:8.2f}×" if has else f"{'—':>9}"
        gcma_cpu = f"{r['gcma_cpu_s']:8.2f}" if has else f"{'—':>8}"
        lines.append(
            f"{r['network']:<11} {r['devices']:>5} {r['ours_s']:8.3f} {gcma} {r['megatron_s']:9.3f} "
            f"{r['exact_plan_s']:10.3f}  {gcma_ratio} {r['megatron_s'] / r['ours_s']:7.2f}× "
            f"{r['exact_plan_s'] / r['ours_s']:9.2f}×  {r['ours_cpu_s']:8.2f} {gcma_cpu} {r['budget_cpu_s']:6.0f}"
        )
    if rows:
        r = rows[0]
        lines.append(f"every link's latency and bandwidth ×U[{1 - r['perturbation']:g}, {1 + r['perturbation']:g}] "
                     f"(seed {r['seed']}), device order shuffled (1024: region order kept); the same CPU budget "
                     f"for ours and GCMA (live, population 100); Megatron's order over the devices in region order; "
                     f"exact plan: ours on the unperturbed network, on the perturbed links")
    return "\n".join(lines)


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (f"{'network':<11} {'N':>5} {'S×D':>6} {'ours s':>8} {'Megatron':>9} {'random':>8} {'GCMA†':>8}  "
            f"{'Meg/ours':>8} {'rand/ours':>9} {'GCMA†/ours':>10} {'cpu s':>6} {'wall s':>6} {'GCMA† s':>7} {'evals':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gcma = f"{r['gcma_s']:8.3f}" if "gcma_s" in r else f"{'—':>8}"
        gcma_ratio = f"{r['gcma_over_ours']:8.2f}×" if "gcma_s" in r else f"{'—':>9}"
        gcma_time = f"{r['gcma_search_s']:7.0f}" if "gcma_s" in r else f"{'—':>7}"
        shape = f"{r['stages']}×{r['devices'] // r['stages']}"
        lines.append(
            f"{r['network']:<11} {r['devices']:>5} {shape:>6} {r['ours_s']:8.3f} {r['megatron_s']:9.3f} "
            f"{r['random_s']:8.3f} {gcma}  {r['megatron_over_ours']:7.2f}× {r['random_over_ours']:8.2f}× "
            f"{gcma_ratio}  {r['search_cpu_s']:6.2f} {r['search_wall_s']:6.2f} {gcma_time} {r['evaluations']:>7}"
        )
    lines.append("cost: seconds of communication per iteration (paper's model, c_PP 0.471249 GB, c_DP 0.65 GB); "
                 "random: mean of 100 random assignments\n"
                 "GCMA†: the paper's figures and run times, quoted for reference (NOTES.md), not run here; "
                 "GCMA run live is in the measured networks below")
    return "\n".join(lines)


@click.command(name="planner")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every search.")
@click.option("--large/--no-large", default=True, show_default=True,
              help=f"Also plan {LARGE_DEVICES} world-wide devices in {LARGE_STAGES} stages (about a minute).")
@click.option("--perturbation", type=click.FloatRange(0.0, 0.9), default=PERTURBATION, show_default=True,
              help="Measured networks: each link's latency and bandwidth scaled by a factor in [1 − x, 1 + x].")
@click.option("--budget", "budget_s", type=click.FloatRange(min=0.1), default=MEASURED_BUDGET_S, show_default=True,
              help="Measured 64-device networks: CPU seconds for ours and for GCMA, each.")
@click.option("--measured/--no-measured", default=True, show_default=True,
              help="Also plan the networks as measured (perturbed, shuffled), with GCMA run live.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as one JSON document.")
def command(seed: int, large: bool, perturbation: float, budget_s: float, measured: bool, as_json: bool) -> None:
    """The scheduler on the paper's five networks (64 devices, 8 stages) and at 1024 devices; then on the
    same networks as measured, beside GCMA run live."""
    rows = run_planner_benchmark(seed=seed, large=large)
    noisy = run_measured_benchmark(seed=seed, large=large, level=perturbation, budget_s=budget_s) if measured else []
    if as_json:
        click.echo(json.dumps({"planner": rows, "measured": noisy}))
        return
    click.echo(format_rows(rows))
    if measured:
        click.echo("")
        click.echo("measured networks")
        click.echo(format_measured(noisy))
