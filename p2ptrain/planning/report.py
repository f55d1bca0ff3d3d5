"""Plain-text rendering of a plan for people (the ``--json`` document is ``Plan.to_json``)."""

from __future__ import annotations

from collections import Counter

from p2ptrain.planning.cluster import Cluster
from p2ptrain.planning.plan import Plan
from p2ptrain.planning.workload import Workload

MAX_TABLE_PIPELINES = 16
MAX_TABLE_STAGES = 12


def device_label(cluster: Cluster, index: int) -> str:
    d = cluster.devices[index]
    if d.region and d.region.lower() not in d.name.lower():
        return f"{d.name} ({d.region})"
    return d.name


def format_plan(plan: Plan, cluster: Cluster, workload: Workload, title: str) -> str:
    lines = [
        f"{title}: {cluster.num_devices} devices, {plan.num_stages} stages × {plan.num_replicas} replicas, "
        f"objective {plan.objective}",
        f"workload: c_PP {workload.activation_gb:.6g} GB, c_DP {workload.gradient_gb:.6g} GB ({workload.source})",
        "",
    ]
    lines += _pipeline_table(plan, cluster)
    lines.append("")
    lines += _stage_regions(plan, cluster)
    lines.append("")
    if plan.layers is not None:
        lines += _stage_layers(plan, cluster)
        lines.append("")
    ours = plan.cost
    lines.append(
        f"cost: {ours.cost_s:.3f} s/iteration = data-parallel {ours.data_parallel_s:.3f} s + pipeline {ours.pipeline_s:.3f} s"
    )
    rows = [("this plan", ours)] + [(name + (" (does not fit)" if name in plan.unfit_baselines else ""), c)
                                    for name, c in plan.baselines.items()]
    width = max(len(name) for name, _ in rows)
    lines.append(f"  {'':{width}}  {'cost s':>10}  {'data-par. s':>11}  {'pipeline s':>10}  {'× this plan':>11}")
    for name, c in rows:
        ratio = c.cost_s / ours.cost_s if ours.cost_s > 0 else float("nan")
        lines.append(
            f"  {name:{width}}  {c.cost_s:10.3f}  {c.data_parallel_s:11.3f}  {c.pipeline_s:10.3f}  {ratio:10.2f}×"
        )
    s = plan.search
    took = f"{s.seconds:.2f} s, " if s.seconds is not None else ""
    lines.append(f"search: {s.method}, {took}{s.evaluations} evaluations, seed {s.seed}, stopped: {s.stopped_by}")
    if s.fallback == "megatron":
        lines.append("the search found no plan cheaper than Megatron's rank order: this plan IS Megatron's order "
                     "(give it a larger --time-budget to search further)")
    return "\n".join(lines)


def _pipeline_table(plan: Plan, cluster: Cluster) -> list[str]:
    pipes = plan.pipelines[:MAX_TABLE_PIPELINES]
    stages = min(plan.num_stages, MAX_TABLE_STAGES)
    header = ["pipeline"] + [f"stage {j}" for j in range(stages)]
    body = [[str(i)] + [device_label(cluster, p[j]) for j in range(stages)] for i, p in enumerate(pipes)]
    widths = [max(len(row[k]) for row in [header, *body]) for k in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in [header, *body]]
    hidden = []
    if plan.num_replicas > len(pipes):
        hidden.append(f"{plan.num_replicas - len(pipes)} more pipelines")
    if plan.num_stages > stages:
        hidden.append(f"{plan.num_stages - stages} more stages")
    if hidden:
        out.append(f"… {' and '.join(hidden)} (--json prints the whole plan)")
    return out


def _stage_regions(plan: Plan, cluster: Cluster) -> list[str]:
    if all(d.region is None for d in cluster.devices):
        return []
    out = ["regions of each stage's data-parallel group:"]
    for j, group in enumerate(plan.stage_groups()):
        counts = Counter(cluster.devices[d].region or "?" for d in group)
        out.append(f"  stage {j}: " + ", ".join(f"{n}×{r}" if n > 1 else r for r, n in sorted(counts.items())))
    return out


def _stage_layers(plan: Plan, cluster: Cluster) -> list[str]:
    """Each stage's blocks, its peak memory beside its smallest device's, and its cards' speeds."""
    out = [f"layer split (schedule {plan.schedule}, {plan.wire} activations) and memory per device:"]
    memory = plan.stage_memory_gb or (None,) * plan.num_stages
    for j, ((a, b), group) in enumerate(zip(plan.layers or (), plan.stage_groups(), strict=True)):
        caps = [cluster.devices[d].memory_gb for d in group]
        known = [c for c in caps if c is not None]
        fit = f" of {min(known):g} GB" if known else ""
        used = f"{memory[j]:.2f} GB{fit}" if memory[j] is not None else "?"
        speeds = Counter(f"{cluster.devices[d].tflops:g}" if cluster.devices[d].tflops else "?" for d in group)
        cards = ", ".join(f"{n}×{t}" if n > 1 else t for t, n in sorted(speeds.items()))
        out.append(f"  stage {j}: blocks {a}-{b - 1} ({b - a}), memory {used}, TFLOP/s {cards}")
    return out
