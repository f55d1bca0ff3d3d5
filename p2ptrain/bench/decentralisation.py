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
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from p2ptrain.planning import ALL_SCENARIOS, make_objective, scenario
from p2ptrain.planning.layers import model_workload
from p2ptrain.planning.model_shapes import model_shape
from p2ptrain.planning.scenarios import homes

SETTINGS = tuple(f"{wire}/{schedule}/{overlap}" for wire in ("fp32", "bf16", "int8", "int4")
                 for schedule, overlap in (("gpipe", "no-overlap"), ("gpipe", "overlap"), ("1f1b", "overlap")))
BASELINE = "fp32/gpipe/no-overlap"  # today's runtime before issue 13
NETWORKS = ("datacenter", "worldwide")
DEVICES, STAGES = 64, 8
BATCH_TOKENS = 1 << 20
BUCKET_ELEMENTS = 1 << 18
FP32_BYTES = 4
GB = 1e9


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


def network_cluster(network: str):
    """The paper's network ``network`` at 64 devices, or 64 homes (``homes-1g``, ``homes-100m``)."""
    if network in HOMES:
        return homes(DEVICES, HOMES[network])
    return scenario(network, DEVICES)


def step_time_s(network: str, setting: str, micro_batches: int, stages: int = STAGES, sync_every: int = 1) -> float:
    """The simulated step time of GPT-3 XL on ``network`` with ``setting`` (module docstring), seconds;
    ``sync_every`` > 1: DiLoCo rounds of that many steps (one all-reduce a round)."""
    wire, schedule, overlap = _parse(setting)
    cluster = network_cluster(network)
    base = model_workload(model_shape("gpt3-xl"), cluster, num_stages=stages, batch_tokens=BATCH_TOKENS,
                          micro_batches=micro_batches, activation_bytes=FP32_BYTES, gradient_bytes=FP32_BYTES)
    bucket_gb = BUCKET_ELEMENTS * FP32_BYTES / GB if overlap else 0.0
    step = dataclasses.replace(base.step, wire=wire, schedule=schedule, bucket_gb=bucket_gb,
                               volume_bytes=(FP32_BYTES,) * 3, sync_every=sync_every)  # float32: the wire scales
    assert base.costs is not None
    workload = dataclasses.replace(base, step=step).at(_even(base.costs.num_layers, stages))
    objective = make_objective("simulated", cluster, workload, stages)
    replicas = DEVICES // stages
    layout = np.arange(DEVICES).reshape(replicas, stages)  # pipeline p: devices S·p … S·p+S−1, inside one region
    return objective.evaluate(objective.refine(layout)).cost_s


def _even(num_layers: int, stages: int = STAGES) -> tuple[tuple[int, int], ...]:
    per = num_layers // stages
    return tuple((j * per, (j + 1) * per) for j in range(stages))


def measure_networks(networks: tuple[str, ...], stage_counts: tuple[int, ...], settings: tuple[str, ...],
                     sync_everys: tuple[int, ...], micro_batches: int = 8) -> dict[str, Any]:
    """Every (network, stages, setting, H) step time; per network the best, over the data center's best."""
    rows = [{"network": n, "stages": s, "setting": st, "sync_every": h,
             "step_s": step_time_s(n, st, micro_batches, s, h)}
            for n in networks for s in stage_counts for st in settings for h in sync_everys]  # fmt: skip
    best = {n: min((r for r in rows if r["network"] == n), key=lambda r: r["step_s"]) for n in networks}
    reference = best.get("datacenter")
    for r in best.values():
        r["vs_datacenter_best"] = r["step_s"] / reference["step_s"] if reference else None
    return {"model": "gpt3-xl", "devices": DEVICES, "batch_tokens": BATCH_TOKENS, "micro_batches": micro_batches,
            "rows": rows, "best": best}


def format_networks(report: dict[str, Any]) -> str:
    lines = [f"GPT-3 XL, {report['devices']} V100s, batch {report['batch_tokens']} tokens, {report['micro_batches']} "
             "micro-batches per pipeline; simulated step seconds (H: DiLoCo's steps per round, 1: every step)",
             f"{'network':<12} {'stages':>6} {'setting':<22} {'H':>4} {'step s':>9}"]
    for r in report["rows"]:
        lines.append(f"{r['network']:<12} {r['stages']:>6} {r['setting']:<22} {r['sync_every']:>4} {r['step_s']:9.2f}")
    lines.append("best per network:")
    for n, r in report["best"].items():
        ratio = "" if r["vs_datacenter_best"] is None else f"  {r['vs_datacenter_best']:.2f}x the data center's best"
        lines.append(f"  {n:<12} {r['step_s']:8.2f} s  ({r['stages']} stages, {r['setting']}, H {r['sync_every']}){ratio}")
    return "\n".join(lines)


def _parse(setting: str) -> tuple[str, str, bool]:
    from p2ptrain.bench.e2e import parse_setting

    return parse_setting(setting)


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
    }  # fmt: skip


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
@click.option("--stages", "stage_counts", default=str(STAGES), show_default=True, help="With --networks: stage counts.")
@click.option("--sync-every", "sync_everys", default="1", show_default=True,
              help="With --networks: DiLoCo's steps per round to price (1: every-step sync).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def command(settings: str, micro_batches: int, networks: str | None, stage_counts: str, sync_everys: str,
            as_json: bool) -> None:  # fmt: skip
    chosen = tuple(s.strip() for s in settings.split(",") if s.strip())
    for s in chosen:
        _parse(s)
    if networks is not None:
        names = tuple(n.strip() for n in networks.split(",") if n.strip())
        for n in names:
            if n not in HOMES and n not in ALL_SCENARIOS:
                raise click.BadParameter(f"unknown network {n!r}", param_hint="--networks")
        report = measure_networks(names, tuple(int(v) for v in stage_counts.split(",")), chosen,
                                  tuple(int(v) for v in sync_everys.split(",")), micro_batches)  # fmt: skip
        click.echo(json.dumps(report) if as_json else format_networks(report))
        return
    report = measure(chosen, micro_batches)
    click.echo(json.dumps(report) if as_json else format_report(report))
