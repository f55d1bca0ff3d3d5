"""``p2ptrain plan``: plan a cluster — which device runs which (pipeline, stage).

    p2ptrain plan --scenario worldwide                  # the paper's 64-device world-wide network
    p2ptrain plan --scenario spot --devices 16 --stages 4
    p2ptrain plan --cluster examples/clusters/three_regions.json --stages 4 --json
    p2ptrain plan --scenario worldwide --objective simulated --micro-batches 4   # our runtime's step time
    p2ptrain plan --cluster measured.json --search gcma --time-budget 10      # the paper's scheduler, live
    p2ptrain plan --scenario volunteers --model gpt3-xl   # mixed GPUs: layer split, memory, compute-aware
    p2ptrain plan --scenario homes --model gpt3-xl --stages auto   # the planner chooses the stage count

With ``--objective simulated --model NAME`` on a cluster whose devices say their ``tflops`` or
``memory_gb`` (mixed GPUs), the plan is compute- and memory-aware (``planning.joint``): the layer split and
the assignment are chosen together for the simulated step time with compute, every stage fitting its
devices' memory. That is the default on the built-in mixed networks (``volunteers``); elsewhere the
default stays the paper's communication cost, so existing cluster files plan as they always did, except
on ``homes``, whose access links only the simulated objective sees.

``--stages auto`` (with ``--model``) plans every stage count whose stages fit the devices' memory and
prints the fastest (``planning.stage_count``), with each count's predicted step and compute utilisation.
A plan priced with compute says its predicted compute utilisation: the busiest device's compute seconds
per step over the step's seconds.
"""

from __future__ import annotations

import json
import time

import click
import numpy as np

from p2ptrain.cli.stage_count import StageCount
from p2ptrain.planning import (
    MIXED_SCENARIOS,
    MODEL_PRESETS,
    PAPER_WORKLOAD,
    Cluster,
    Infeasible,
    LayeredWorkload,
    Plan,
    Workload,
    even_layers,
    load_cluster,
    model_shape,
    model_workload,
    scenario,
    schedule,
    workload_from_model,
)
from p2ptrain.planning.objectives import OBJECTIVES
from p2ptrain.planning.report import format_plan
from p2ptrain.planning.scenarios import HOME_SCENARIOS, NAMED_SCENARIOS
from p2ptrain.planning.simulated import SimulatedObjective, StepProfile, StepWorkload
from p2ptrain.planning.stage_count import StageChoice, choose_stages, default_micro_batches
from p2ptrain.planning.strategies import DEFAULT_METHOD, SEARCH_METHODS
from p2ptrain.planning.workload import PAPER_BATCH_TOKENS

DEFAULT_STAGES = 8
DEFAULT_TIME_BUDGET_S = 60.0


class OneLineErrors(click.Command):
    """A click command whose flag errors are one line ("Error: …", exit 2), like every other bad input."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise ValueError(e.format_message()) from None


@click.command(name="plan", cls=OneLineErrors)
@click.option("--scenario", "scenario_name", metavar="NAME",
              help=f"Plan a built-in network: {', '.join(NAMED_SCENARIOS)} (volunteers: mixed GPUs; homes: one "
                   "device per home behind its 100 Mbit/s access link).")
@click.option("--devices", type=int, metavar="N",
              help="With --scenario: scale the network to N devices, keeping its structure (default 64).")
@click.option("--cluster", "cluster_file", metavar="FILE",
              help="Plan the cluster in this JSON file (devices, latency_ms, bandwidth_gbps; see docs/design.md).")
@click.option("--stages", type=StageCount(), metavar="S|auto",
              help=f"Pipeline stages; the device count must be a multiple (default {DEFAULT_STAGES}). auto (with "
                   "--model): plan every stage count that fits the devices' memory and keep the fastest.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the search: same seed, same plan.")
@click.option("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, show_default=True, metavar="SECONDS",
              help="Stop the search after this long, with the best plan so far (it usually converges sooner).")
@click.option("--search", "search_method", type=click.Choice(list(SEARCH_METHODS)), default=DEFAULT_METHOD,
              show_default=True,
              help="clustered: our search, on the regions and instances recovered from the links, then on the links "
                   "as measured; partition: our partition search on the links alone; gcma: the paper's scheduler.")
@click.option("--model", "model_name", metavar="NAME",
              help=f"Derive c_PP and c_DP from a model preset ({', '.join(MODEL_PRESETS)}) instead of the "
                   "paper's constants (c_PP 0.471249 GB, c_DP 0.65 GB).")
@click.option("--batch-tokens", type=int, default=PAPER_BATCH_TOKENS, show_default=True, metavar="TOKENS",
              help="With --model: the global batch in tokens.")
@click.option("--activation-gb", type=float, metavar="GB",
              help="c_PP: activations one data shard sends across one stage boundary, in GB (overrides).")
@click.option("--gradient-gb", type=float, metavar="GB",
              help="c_DP: gradients of one stage, all-reduced by its data-parallel group, in GB (overrides).")
@click.option("--objective", type=click.Choice(list(OBJECTIVES)),
              help="dtfm: the paper's communication cost; simulated: the step time of our runtime (GPipe "
                   "micro-batches, per-link FIFOs, parallel all-reduce shards; communication only unless the "
                   "devices are mixed). Default: simulated with --model on a mixed scenario (volunteers), dtfm otherwise.")
@click.option("--micro-batches", type=click.IntRange(min=1), metavar="M",
              help="With --objective simulated: micro-batches per pipeline and step (default 1; mixed devices: "
                   "micro-batches of at most 4 sequences, at least 4 per stage, at most 64).")
@click.option("--recompute/--no-recompute", default=True, show_default=True,
              help="Mixed devices: activation checkpointing (a stage keeps each block's input, not its "
                   "activations; the backward pass recomputes the forward).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON document (docs/design.md) instead.")
def command(
    scenario_name: str | None,
    devices: int | None,
    cluster_file: str | None,
    stages: int | str | None,
    seed: int,
    time_budget: float,
    search_method: str,
    model_name: str | None,
    batch_tokens: int,
    activation_gb: float | None,
    gradient_gb: float | None,
    objective: str,
    micro_batches: int | None,
    recompute: bool,
    as_json: bool,
) -> None:
    """Assign pipeline stages and data shards to devices, minimising communication time per iteration
    (the paper's cost model), and compare the plan with Megatron's rank order and random assignments."""
    if (scenario_name is None) == (cluster_file is None):
        raise ValueError("give exactly one of --scenario NAME or --cluster FILE")
    if devices is not None and scenario_name is None:
        raise ValueError("--devices scales a --scenario; a --cluster file has its own devices")
    if time_budget <= 0:
        raise ValueError(f"--time-budget must be positive, got {time_budget:g}")
    if scenario_name is not None:
        if scenario_name not in NAMED_SCENARIOS:
            raise ValueError(f"unknown scenario {scenario_name!r} (choose from {', '.join(NAMED_SCENARIOS)})")
        cluster = scenario(scenario_name, 64 if devices is None else devices)
        title = f"scenario {scenario_name}"
    else:
        cluster = load_cluster(cluster_file)
        title = f"cluster {cluster_file}"
    if stages == "auto":
        if model_name is None:
            raise ValueError("--stages auto needs --model (the model's memory and compute choose the stage count)")
        if objective == "dtfm" or activation_gb is not None or gradient_gb is not None:
            raise ValueError("--stages auto plans for the simulated step time of the model: no --objective dtfm, "
                             "--activation-gb or --gradient-gb")
        shape = model_shape(model_name)
        choice = choose_stages(cluster, shape, batch_tokens=batch_tokens, micro_batches=micro_batches,
                               recompute=recompute, seed=seed, time_budget_s=time_budget, clock=time.perf_counter,
                               search=search_method, source=f"model {model_name}, {batch_tokens} tokens a batch")
        _print_choice(choice, cluster, title, as_json)
        return
    num_stages = DEFAULT_STAGES if stages is None else stages
    if num_stages < 1 or cluster.num_devices % num_stages:
        hint = "" if stages is not None else " (pass --stages)"
        raise ValueError(f"{cluster.num_devices} devices cannot be split into {num_stages} stages of equal size{hint}")
    if objective is None:  # as before mixed devices came, except on the built-in mixed networks and homes
        objective = "simulated" if (scenario_name in MIXED_SCENARIOS and model_name is not None
                                    or scenario_name in HOME_SCENARIOS) else "dtfm"
    mixed = model_name is not None and any(d.tflops or d.memory_gb for d in cluster.devices)
    if mixed and objective == "simulated":
        if activation_gb is not None or gradient_gb is not None:
            raise ValueError("--activation-gb/--gradient-gb do not apply to a mixed-device plan (the model sets them)")
        workload = model_workload(model_shape(model_name), cluster, num_stages=num_stages, batch_tokens=batch_tokens,
                                  micro_batches=micro_batches or default_micro_batches(
                                      model_shape(model_name), cluster.num_devices, num_stages, batch_tokens),
                                  recompute=recompute,
                                  source=f"model {model_name}, {batch_tokens} tokens a batch")
        plan = schedule(cluster, workload, num_stages, seed=seed, objective=objective, time_budget_s=time_budget,
                        clock=time.perf_counter, search=search_method)
        _print(plan, cluster, workload, title, as_json)
        return
    workload = PAPER_WORKLOAD
    if model_name is not None:
        workload = workload_from_model(model_shape(model_name), num_stages=num_stages,
                                       num_replicas=cluster.num_devices // num_stages, batch_tokens=batch_tokens,
                                       source=f"model {model_name}, {batch_tokens} tokens a batch")
    workload = workload.with_overrides(activation_gb, gradient_gb)
    if micro_batches is not None and objective != "simulated":
        raise ValueError("--micro-batches needs --objective simulated (the paper's cost has no micro-batches)")
    if objective == "simulated":
        workload = StepWorkload(workload.activation_gb, workload.gradient_gb, workload.source,
                                step=StepProfile(micro_batches=micro_batches or 1))
    plan = schedule(cluster, workload, num_stages, seed=seed, objective=objective, time_budget_s=time_budget,
                    clock=time.perf_counter, search=search_method)
    _print(plan, cluster, workload, title, as_json)


def _print(plan: Plan | Infeasible, cluster: Cluster, workload: Workload, title: str, as_json: bool,
           extra: dict | None = None, notes: tuple[str, ...] = ()) -> None:
    if isinstance(plan, Infeasible):
        raise ValueError(plan.reason)
    utilisation = _utilisation(plan, cluster, workload)
    if as_json:
        doc = plan.to_json()
        doc["devices"] = [d.name for d in cluster.devices]
        doc["workload"] = {"activation_gb": workload.activation_gb, "gradient_gb": workload.gradient_gb}
        if utilisation is not None:
            doc["compute_utilisation"] = utilisation
        click.echo(json.dumps(doc | (extra or {})))
        return
    lines = [format_plan(plan, cluster, workload, title), *notes]
    if utilisation is not None:
        lines.append(f"predicted compute utilisation: {utilisation:.1%} (the busiest device's compute over the "
                     "step)")
    click.echo("\n".join(lines))


def _utilisation(plan: Plan, cluster: Cluster, workload: Workload) -> float | None:
    """The plan's busiest device's compute per step over its step (None: not priced with compute)."""
    if plan.objective != "simulated":
        return None
    at = workload.at(plan.layers or even_layers(workload.costs.num_layers, plan.num_stages)) \
        if isinstance(workload, LayeredWorkload) else workload
    objective = SimulatedObjective(cluster, at, plan.num_stages)
    compute = objective.compute_s(np.array(plan.pipelines))
    return compute / plan.cost.cost_s if compute > 0 and plan.cost.cost_s > 0 else None


def _print_choice(choice: StageChoice, cluster: Cluster, title: str, as_json: bool) -> None:
    best = choice.best
    if best is None:
        reasons = "; ".join(f"{o.num_stages} stages: {o.skipped}" for o in choice.options)
        raise ValueError(f"no stage count fits: {reasons}")
    rows = [{"stages": o.num_stages, "micro_batches": o.micro_batches, "recompute": o.recompute,
             "step_s": o.step_s, "compute_utilisation": o.compute_utilisation, "skipped": o.skipped}
            for o in choice.options]
    notes = ["stage counts (predicted step, compute utilisation; the fastest is planned above):"]
    for o in choice.options:
        what = (f"{o.step_s:9.3f} s  {o.compute_utilisation:6.1%}" if o.plan is not None
                else f"skipped: {o.skipped}")
        mark = "  <- chosen" if o is best else ""
        notes.append(f"  {o.num_stages:>4} stages, {o.micro_batches:>3} micro-batches"
                     f"{', recompute' if o.recompute else ''}: {what}{mark}")
    assert best.plan is not None and best.workload is not None
    _print(best.plan, cluster, best.workload, f"{title}, {best.num_stages} stages chosen", as_json,
           extra={"stage_options": rows}, notes=tuple(notes))
