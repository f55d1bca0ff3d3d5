"""The cost of decentralisation at the paper's scale: GPT-3 XL on 64 devices of one GPU type, world-wide
against inside one data center, predicted by the ``simulated`` objective (the one the e2e benchmark
checks against measured step times) for each of the runtime's settings.

    p2ptrain bench decentralisation [--settings fp32/gpipe/no-overlap,bf16/1f1b/overlap,...] [--json]

Workload (``planning.layers.model_workload``): GPT-3 XL (24 layers, d 2048, sequence 2048), a batch of
2^20 tokens (512 sequences) in 8 pipelines × 8 stages, each pipeline's 64 sequences in ``--micro-batches``
micro-batches; compute from the model's FLOPs at 35 % of a V100's 125 TFLOP/s (every device alike);
float32 gradients (c_DP of the largest stage), activations as the wire format sends them. Buckets of
2^18 gradient elements for the overlapped all-reduce (the runtime's default), merged by the simulation into
at most 8.

Layouts: on both networks each pipeline lies inside one instance / region and each stage's data-parallel
group spans them (the layout the paper's scheduler found there, ``paper/NOTES.md``), in the stage order the
simulation likes best (``SimulatedObjective.refine``): the plan the scheduler converges to on these two
networks, without a search's run time. The figure is world-wide step time over data-center step time; the
paper measured 1.7–3.5× (fp16, GPipe, its own runtime), CocktailSGD reports ~1.2× at 500 Mbit/s.

With ``--networks`` (``measure_networks``): every network × stage count × setting × DiLoCo H, the best per
network over the data center's best, each row with its predicted compute utilisation (the busiest device's
compute over the step). Only stage counts whose stages fit a V100's memory (``--memory-gb``, 32 by default;
the paper's cards had 16 or 32) are priced, by the planner's memory model (``planning.stage_count``: fp32
training state, 16 bytes a parameter: DiLoCo's two more copies are in host memory; float32 activations of the schedule's micro-batches in
flight), with activation recomputation only where they do not fit without it (it costs a forward per
backward); the others are listed as skipped, with what they need. ``homes-1g`` and ``homes-100m`` are 64
homes with their access links (``--access-link``, the default: each home's uplink and downlink shared by its
flows; ``--no-access-link``: every pair a path of its own, as before the model had them). ``--sync-overlap``
prices every H > 1 as Streaming DiLoCo (the round's all-reduce streamed during the next round's steps,
``StepProfile.sync_overlap``). Each (network, stages, setting) is laid out once (refined at every-step sync)
and priced at every H. Wire formats: any of ``planning.wire_model.WIRE_BYTES``. A setting may end in ``/kK``:
GPT-3 XL with its residual stream in a subspace of rank K (``model.subspace``: a stage boundary carries K values a
token instead of 2048, both ways; its two output projections are K wide, so it computes less too). The table
then gives each network's best per stage count over the data center's best at that count, with a boundary's
bytes a token beside bf16's (2 · 2048).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from p2ptrain.planning import ALL_SCENARIOS, make_objective, scenario
from p2ptrain.planning.layers import model_workload
from p2ptrain.planning.model_shapes import ModelShape, model_shape
from p2ptrain.planning.plan import Plan
from p2ptrain.planning.scenarios import homes
from p2ptrain.planning.scheduler import schedule
from p2ptrain.planning.simulated import StepProfile
from p2ptrain.planning.split import even_layers
from p2ptrain.planning.stage_count import fits_memory, stage_workload
from p2ptrain.planning.wire_model import SCHEDULES, WIRE_BYTES

SETTINGS = tuple(f"{wire}/{schedule}/{overlap}" for wire in ("fp32", "bf16", "int8", "int4")
                 for schedule, overlap in (("gpipe", "no-overlap"), ("gpipe", "overlap"), ("1f1b", "overlap")))
BASELINE = "fp32/gpipe/no-overlap"  # the runtime without codecs, 1F1B or overlapped all-reduce
NETWORKS = ("datacenter", "worldwide")
DEVICES, STAGES = 64, 8
BATCH_TOKENS = 1 << 20
BUCKET_ELEMENTS = 1 << 18
FP32_BYTES = 4
GB = 1e9
V100_MEMORY_GB = 32.0  # the larger V100 (SXM2 32 GB); the paper's instances had 16 or 32 GB cards
MODEL = "gpt3-xl"


@dataclass(frozen=True)
class Row:
    setting: str
    datacenter_s: float
    worldwide_s: float

    @property
    def ratio(self) -> float:
        """World-wide step time over data-center step time (the cost of decentralisation)."""
        return self.worldwide_s / self.datacenter_s


HOMES = {"homes-1g": 1.0, "homes-100m": 0.1}  # every pair at this many Gbit/s, 20-150 ms (planning.scenarios.homes)


def network_cluster(network: str, access: bool = True):
    """The paper's network ``network`` at 64 devices, or 64 homes (``homes-1g``, ``homes-100m``; ``access``:
    behind their access links)."""
    if network in HOMES:
        return homes(DEVICES, HOMES[network], access=access)
    return scenario(network, DEVICES)


def step_time_s(network: str, setting: str, micro_batches: int, stages: int = STAGES, sync_every: int = 1) -> float:
    """The simulated step time of GPT-3 XL on ``network`` with ``setting`` (module docstring), seconds;
    ``sync_every`` > 1: DiLoCo rounds of that many steps (one all-reduce a round)."""
    wire, schedule, overlap = _parse(setting)
    cluster = network_cluster(network)
    base = model_workload(_shape(setting), cluster, num_stages=stages, batch_tokens=BATCH_TOKENS,
                          micro_batches=micro_batches, activation_bytes=FP32_BYTES, gradient_bytes=FP32_BYTES)
    bucket_gb = BUCKET_ELEMENTS * FP32_BYTES / GB if overlap else 0.0
    step = dataclasses.replace(base.step, wire=wire, schedule=schedule, bucket_gb=bucket_gb,
                               volume_bytes=(FP32_BYTES,) * 3, sync_every=sync_every)  # float32: the wire scales
    assert base.costs is not None
    workload = dataclasses.replace(base, step=step).at(even_layers(base.costs.num_layers, stages))
    objective = make_objective("simulated", cluster, workload, stages)
    replicas = DEVICES // stages
    layout = np.arange(DEVICES).reshape(replicas, stages)  # pipeline p: devices S·p … S·p+S−1, inside one region
    return objective.evaluate(objective.refine(layout)).cost_s


@dataclass(frozen=True)
class Fit:
    """Whether a stage count's stages fit a device's memory with a schedule and DiLoCo or not: with
    recomputation or without (None: neither), and the peak GB a device needs (with recomputation if it
    does not fit either way)."""

    recompute: bool | None
    need_gb: float


def memory_fit(stages: int, schedule: str, sync_every: int, micro_batches: int, memory_gb: float) -> Fit:
    """GPT-3 XL's stages at ``stages`` (the even split) against ``memory_gb`` a device (module docstring)."""
    cluster = scenario("datacenter", DEVICES)  # V100s alike: the network does not matter here
    need = 0.0
    for recompute in (False, True):
        workload = stage_workload(cluster, model_shape(MODEL), stages, batch_tokens=BATCH_TOKENS,
                                  micro_batches=micro_batches, settings=StepProfile(schedule=schedule,
                                                                                    sync_every=sync_every),
                                  recompute=recompute, activation_bytes=FP32_BYTES)
        fit = fits_memory(workload, stages, None)
        assert fit is not None
        need = max(fit)
        if need <= memory_gb * (1 + 1e-12):
            return Fit(recompute, need)
    return Fit(None, need)


def measure_networks(networks: tuple[str, ...], stage_counts: tuple[int, ...], settings: tuple[str, ...],
                     sync_everys: tuple[int, ...], micro_batches: int = 8, *, access: bool = True,
                     sync_overlap: bool = False, memory_gb: float = V100_MEMORY_GB,
                     overlap_steps: int = 0, fragments: int = 1, search_s: float | None = None) -> dict[str, Any]:
    """Every (network, stages, setting, H) that fits memory: its step time and compute utilisation; per network
    the best, over the data center's best; and what was skipped (module docstring). ``search_s``: each one laid
    out by the planner's search (``planning.scheduler.schedule``, the simulated objective at its own H) within
    that many seconds, instead of the refined rank order."""
    fits = {(s, schedule, h): memory_fit(s, schedule, h, micro_batches, memory_gb) for s in stage_counts
            for schedule in dict.fromkeys(_parse(st)[1] for st in settings) for h in sync_everys}
    skipped = [{"stages": s, "schedule": schedule, "sync_every": h, "need_gb": fit.need_gb}
               for (s, schedule, h), fit in fits.items() if fit.recompute is None]
    rows = []
    for n in networks:
        cluster = network_cluster(n, access)
        for s in stage_counts:
            for st in settings:
                layouts: dict[bool, np.ndarray] = {}
                for h in sync_everys:
                    recompute = fits[(s, _parse(st)[1], h)].recompute
                    if recompute is None:
                        continue
                    objective = _objective(cluster, st, micro_batches, s, 1, recompute)
                    if recompute not in layouts:  # laid out once, at every-step sync
                        layouts[recompute] = objective.refine(np.arange(DEVICES).reshape(DEVICES // s, s))
                    layout = layouts[recompute]
                    streamed = sync_overlap and h > 1
                    priced = _objective(cluster, st, micro_batches, s, h, recompute, streamed, overlap_steps,
                                        min(fragments, h))
                    if search_s is not None:
                        layout = _searched(cluster, _workload(cluster, st, micro_batches, s, h, recompute, streamed,
                                                              overlap_steps, min(fragments, h)), s, search_s)
                    step = priced.evaluate(layout).cost_s
                    compute = priced.compute_s(layout)
                    rows.append({"network": n, "stages": s, "setting": st, "sync_every": h, "streamed": streamed,
                                 "recompute": recompute, "step_s": step, "compute_s": compute,
                                 "compute_utilisation": compute / step,
                                 "boundary_bytes_per_token": boundary_bytes_per_token(st)})
    best = {n: min((r for r in rows if r["network"] == n), key=lambda r: r["step_s"])
            for n in networks if any(r["network"] == n for r in rows)}
    reference = best.get("datacenter")
    for r in best.values():
        r["vs_datacenter_best"] = r["step_s"] / reference["step_s"] if reference else None
    by_stages = []  # each network's best at each stage count, over the data center's best at that count
    for s in stage_counts:
        at = {n: min((r for r in rows if (r["network"], r["stages"]) == (n, s)), key=lambda r: r["step_s"])
              for n in networks if any((r["network"], r["stages"]) == (n, s) for r in rows)}
        dc = at.get("datacenter")
        by_stages += [{**r, "vs_datacenter_same_stages": r["step_s"] / dc["step_s"] if dc else None}
                      for r in at.values()]
    return {"model": MODEL, "devices": DEVICES, "batch_tokens": BATCH_TOKENS, "micro_batches": micro_batches,
            "memory_gb": memory_gb, "access_links": access, "sync_overlap": sync_overlap,
            "overlap_steps": overlap_steps, "fragments": fragments, "rows": rows,
            "skipped": skipped, "best": best, "best_by_stages": by_stages,
            "bf16_boundary_bytes_per_token": 2.0 * model_shape(MODEL).hidden_size}


def _objective(cluster, setting: str, micro_batches: int, stages: int, sync_every: int, recompute: bool,
               sync_overlap: bool = False, overlap_steps: int = 0, fragments: int = 1):
    workload = _workload(cluster, setting, micro_batches, stages, sync_every, recompute, sync_overlap, overlap_steps,
                         fragments)
    return make_objective("simulated", cluster, workload, stages)


def _workload(cluster, setting: str, micro_batches: int, stages: int, sync_every: int, recompute: bool,
              sync_overlap: bool, overlap_steps: int, fragments: int):
    wire, schedule, overlap = _parse(setting)
    bucket_gb = BUCKET_ELEMENTS * FP32_BYTES / GB if overlap else 0.0
    settings = StepProfile(wire=wire, schedule=schedule, bucket_gb=bucket_gb, volume_bytes=(FP32_BYTES,) * 3,
                           sync_every=sync_every, sync_overlap=sync_overlap,
                           overlap_steps=overlap_steps, fragments=fragments)  # float32 volumes: the wire scales
    workload = stage_workload(cluster, _shape(setting), stages, batch_tokens=BATCH_TOKENS,
                              micro_batches=micro_batches, settings=settings, recompute=recompute,
                              activation_bytes=FP32_BYTES)
    return workload.at(even_layers(model_shape(MODEL).num_layers, stages))


def _searched(cluster, workload, stages: int, budget_s: float) -> np.ndarray:
    """The layout the planner's search finds for ``workload`` within ``budget_s``."""
    plan = schedule(cluster, workload, stages, objective="simulated", time_budget_s=budget_s,
                    clock=time.perf_counter)
    if not isinstance(plan, Plan):
        raise ValueError(f"the planner found no plan: {plan}")
    return np.array(plan.pipelines)


def format_networks(report: dict[str, Any]) -> str:
    how = "access links" if report["access_links"] else "no access links"
    lines = [f"GPT-3 XL, {report['devices']} V100s of {report['memory_gb']:g} GB, batch {report['batch_tokens']} "
             f"tokens, {report['micro_batches']} micro-batches per pipeline; homes with {how}; simulated step "
             "seconds (H: DiLoCo's steps per round, 1: every step; ~: streamed; rc: activation recomputation; "
             "util: compute utilisation)",
             f"{'network':<12} {'stages':>6} {'setting':<22} {'H':>5} {'rc':>3} {'step s':>9} {'util':>6}"]
    for r in report["rows"]:
        h = f"{'~' if r['streamed'] else ''}{r['sync_every']}"
        rc = "yes" if r["recompute"] else ""
        lines.append(f"{r['network']:<12} {r['stages']:>6} {r['setting']:<22} {h:>5} {rc:>3} {r['step_s']:9.2f} "
                     f"{r['compute_utilisation']:6.1%}")
    for f in report["skipped"]:
        lines.append(f"skipped: {f['stages']} stages, {f['schedule']}, H {f['sync_every']}: a stage needs "
                     f"{f['need_gb']:.1f} GB even with recomputation ({report['memory_gb']:g} GB a device)")
    lines.append("best per network and stage count (a stage boundary's bytes a token forward / back, and bf16's "
                 f"{report['bf16_boundary_bytes_per_token']:g} over them):")
    for r in report["best_by_stages"]:
        ratio = "" if r["vs_datacenter_same_stages"] is None else \
            f"  {r['vs_datacenter_same_stages']:.2f}x the data center's at {r['stages']} stages"
        forward, back = r["boundary_bytes_per_token"]
        bf16 = report["bf16_boundary_bytes_per_token"]
        lines.append(f"  {r['network']:<12} {r['stages']:>2} stages {r['step_s']:8.2f} s  ({r['setting']}, H "
                     f"{r['sync_every']}; {forward:.0f} / {back:.0f} B a token, {bf16 / forward:.0f}x / "
                     f"{bf16 / back:.0f}x){ratio}")
    lines.append("best per network:")
    for n, r in report["best"].items():
        ratio = "" if r["vs_datacenter_best"] is None else f"  {r['vs_datacenter_best']:.2f}x the data center's best"
        h = f"{'streamed ' if r['streamed'] else ''}H {r['sync_every']}"
        lines.append(f"  {n:<12} {r['step_s']:8.2f} s  ({r['stages']} stages, {r['setting']}, {h}, compute "
                     f"utilisation {r['compute_utilisation']:.1%}){ratio}")
    return "\n".join(lines)


def _parse(setting: str) -> tuple[str, str, bool]:
    """``WIRE/SCHEDULE/overlap|no-overlap[/kK]`` (any wire format the planner knows, ``WIRE_BYTES``; ``kK``: the
    model's residual stream in a subspace of rank K, ``model.subspace``); one-line ValueError otherwise."""
    parts = setting.strip().split("/")
    if len(parts) not in (3, 4) or parts[0] not in WIRE_BYTES or parts[1] not in SCHEDULES or \
            parts[2] not in ("overlap", "no-overlap") or (len(parts) == 4 and _rank(parts[3]) is None):
        raise ValueError(f"--settings: {setting!r} is not WIRE/SCHEDULE/overlap|no-overlap[/kK] (wire one of "
                         f"{', '.join(WIRE_BYTES)}, schedule one of {', '.join(SCHEDULES)}, K a subspace rank below "
                         f"{model_shape(MODEL).hidden_size})")
    return parts[0], parts[1], parts[2] == "overlap"


def _rank(text: str) -> int | None:
    rank = text[1:]
    ok = text.startswith("k") and rank.isdigit() and 0 < int(rank) < model_shape(MODEL).hidden_size
    return int(rank) if ok else None


def _shape(setting: str) -> ModelShape:
    """GPT-3 XL, in the setting's subspace if it names one."""
    parts = setting.strip().split("/")
    return dataclasses.replace(model_shape(MODEL), subspace=_rank(parts[3]) or 0 if len(parts) == 4 else 0)


def boundary_bytes_per_token(setting: str) -> tuple[float, float]:
    """(forward, backward) bytes one token sends across a stage boundary with ``setting``: the wire's bytes per
    value (activations, activation gradients) times the boundary's width; bf16's are 2·d both ways."""
    wire, _, _ = _parse(setting)
    width = _shape(setting).boundary_width
    return WIRE_BYTES[wire][0] * width, WIRE_BYTES[wire][1] * width


def measure(settings: tuple[str, ...] = SETTINGS, micro_batches: int = 8) -> dict[str, Any]:
    rows = [Row(s, step_time_s("datacenter", s, micro_batches), step_time_s("worldwide", s, micro_batches))
            for s in settings]
    base = next((r for r in rows if r.setting == BASELINE), rows[0])
    best_ww = min(rows, key=lambda r: r.worldwide_s)
    best_dc = min(rows, key=lambda r: r.datacenter_s)
    return {
        "model": "gpt3-xl", "devices": DEVICES, "stages": STAGES, "batch_tokens": BATCH_TOKENS,
        "micro_batches": micro_batches, "rows": [dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows],
        "baseline": {"setting": base.setting, "ratio": base.ratio},
        "best": {"setting": best_ww.setting, "worldwide_s": best_ww.worldwide_s,
                 "ratio_same_setting": best_ww.ratio, "datacenter_best_setting": best_dc.setting,
                 "ratio_to_best_datacenter": best_ww.worldwide_s / best_dc.datacenter_s},
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"GPT-3 XL, {report['devices']} V100s ({report['stages']} stages x {report['devices'] // report['stages']} "
             f"pipelines), batch {report['batch_tokens']} tokens in {report['micro_batches']} micro-batches per "
             "pipeline; simulated step seconds",
             f"{'setting':<22} {'datacenter s':>12} {'worldwide s':>11} {'worldwide/datacenter':>21}"]
    for r in report["rows"]:
        lines.append(f"{r['setting']:<22} {r['datacenter_s']:12.2f} {r['worldwide_s']:11.2f} {r['ratio']:20.2f}x")
    best = report["best"]
    lines.append(f"cost of decentralisation: {report['baseline']['setting']} {report['baseline']['ratio']:.2f}x; "
                 f"best world-wide setting {best['setting']} {best['ratio_same_setting']:.2f}x against the data center "
                 f"with the same setting, {best['ratio_to_best_datacenter']:.2f}x against the data center's best "
                 f"({best['datacenter_best_setting']}); paper 1.7-3.5x, goal <= 1.5x")
    return "\n".join(lines)


@click.command(name="decentralisation", help="World-wide over data-center step time at the paper's scale (GPT-3 XL, "
               "64 V100s), per runtime setting, predicted by the simulated objective.")
@click.option("--settings", default=",".join(SETTINGS), show_default=True,
              help="WIRE/SCHEDULE/overlap|no-overlap, comma-separated.")
@click.option("--micro-batches", type=click.IntRange(min=1), default=8, show_default=True,
              help="Micro-batches per pipeline and step.")
@click.option("--networks", help="With these networks (datacenter, worldwide, homes-1g, homes-100m, or another paper "
              "network), every --stages count and --sync-every: a table of each and the best per network.")
@click.option("--stages", "stage_counts", default=str(STAGES), show_default=True,
              help="With --networks: stage counts (those whose stages do not fit --memory-gb are skipped).")
@click.option("--sync-every", "sync_everys", default="1", show_default=True,
              help="With --networks: DiLoCo's steps per round to price (1: every-step sync).")
@click.option("--sync-overlap", is_flag=True,
              help="With --networks: price every H > 1 as Streaming DiLoCo (the round's all-reduce streamed during "
                   "the next round's steps).")
@click.option("--overlap-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --sync-overlap: the steps of the next round a round's all-reduce is spread over (0: all H).")
@click.option("--fragments", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --sync-overlap: Streaming DiLoCo's fragments, each round's all-reduce carrying 1/F of the "
                   "parameters over its own --overlap-steps (at most H).")
@click.option("--access-link/--no-access-link", default=True, show_default=True,
              help="With --networks: homes behind their access links (each home's uplink and downlink shared by its "
                   "flows), or every pair a path of its own.")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=V100_MEMORY_GB, show_default=True,
              help="With --networks: a device's memory; stage counts whose stages do not fit are skipped.")
@click.option("--search", "search_s", type=click.FloatRange(min=0, min_open=True),
              help="With --networks: lay each row out by the planner's search within this many seconds (the "
                   "simulated objective at the row's own H), not by refining the rank order.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def command(settings: str, micro_batches: int, networks: str | None, stage_counts: str, sync_everys: str,
            sync_overlap: bool, overlap_steps: int, fragments: int, access_link: bool, memory_gb: float,
            search_s: float | None, as_json: bool) -> None:
    chosen = tuple(s.strip() for s in settings.split(",") if s.strip())
    for s in chosen:
        _parse(s)
    if networks is not None:
        names = tuple(n.strip() for n in networks.split(",") if n.strip())
        for n in names:
            if n not in HOMES and n not in ALL_SCENARIOS:
                raise click.BadParameter(f"unknown network {n!r}", param_hint="--networks")
        report = measure_networks(names, _integers(stage_counts, "--stages"), chosen,
                                  _integers(sync_everys, "--sync-every"), micro_batches, access=access_link,
                                  sync_overlap=sync_overlap, memory_gb=memory_gb,
                                  overlap_steps=overlap_steps, fragments=fragments, search_s=search_s)
        click.echo(json.dumps(report) if as_json else format_networks(report))
        return
    report = measure(chosen, micro_batches)
    click.echo(json.dumps(report) if as_json else format_report(report))


def _integers(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of positive integers",
                                 param_hint=flag) from None
    layers = model_shape(MODEL).num_layers
    if flag == "--stages" and any(v < 1 or DEVICES % v or v > layers for v in values):
        raise click.BadParameter(f"{text!r}: stage counts must divide {DEVICES} and be at most {layers} (GPT-3 XL's "
                                 "blocks)", param_hint=flag)
    if any(v < 1 for v in values):
        raise click.BadParameter(f"{text!r}: DiLoCo's H must be a positive integer", param_hint=flag)
    return values
