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

from p2ptrain.planning import make_objective, scenario
from p2ptrain.planning.layers import model_workload
from p2ptrain.planning.model_shapes import model_shape

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


def step_time_s(network: str, setting: str, micro_batches: int) -> float:
    """The simulated step time of GPT-3 XL on ``network`` with ``setting`` (module docstring), seconds."""
    wire, schedule, overlap = _parse(setting)
    cluster = scenario(network, DEVICES)
    base = model_workload(model_shape("gpt3-xl"), cluster, num_stages=STAGES, batch_tokens=BATCH_TOKENS,
                          micro_batches=micro_batches, activation_bytes=FP32_BYTES, gradient_bytes=FP32_BYTES)
    bucket_gb = BUCKET_ELEMENTS * FP32_BYTES / GB if overlap else 0.0
    step = dataclasses.replace(base.step, wire=wire, schedule=schedule, bucket_gb=bucket_gb,
                               volume_bytes=(FP32_BYTES,) * 3)  # float32 volumes: the wire scales them
    assert base.costs is not None
    workload = dataclasses.replace(base, step=step).at(_even(base.costs.num_layers))
    objective = make_objective("simulated", cluster, workload, STAGES)
    replicas = DEVICES // STAGES
    layout = np.arange(DEVICES).reshape(replicas, STAGES)  # pipeline p: devices 8p … 8p+7, inside one region
    return objective.evaluate(objective.refine(layout)).cost_s


def _even(num_layers: int) -> tuple[tuple[int, int], ...]:
    per = num_layers // STAGES
    return tuple((j * per, (j + 1) * per) for j in range(STAGES))


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
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def command(settings: str, micro_batches: int, as_json: bool) -> None:
    chosen = tuple(s.strip() for s in settings.split(",") if s.strip())
    for s in chosen:
        _parse(s)
    report = measure(chosen, micro_batches)
    click.echo(json.dumps(report) if as_json else format_report(report))
