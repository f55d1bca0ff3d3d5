"""Wire formats' cost in quality: the same distributed run of ``tiny`` with fp32, bf16, int8, int4,
int4_all and int2 on the wire, side by side (the real runtime: S × D worker processes on loopback), each
codec's error on the activations and gradients between two stages, and the premise of AQ-SGD's activation
delta coding.

    python benchmarks/wire.py [--steps 200] [--stages 2 --replicas 2] [--micro-batches 2] [--wires fp32,bf16,int8]
                              [--schedule 1f1b] [--seeds 0,1,2] [--sync diloco --inner-steps 10] [--json]

Prints per wire the loss after the last step and the mean of the last 10 steps, each relative to fp32 (with
several seeds: their mean, and the spread over seeds of the last-10 mean's difference), and the bytes one
step puts on the wire. The issue's goals: within 1 % (bf16) and 3 % (8-bit) after 200 steps. With ``--sync
diloco`` the replicas synchronise every ``--inner-steps`` steps, their pseudo-gradients in the wire's
gradient codec; ``--stages 1 --replicas 4`` then measures that codec alone.

With ``--plan PLAN.json --scenario worldwide`` (a plan of ``p2ptrain plan --json`` for that scenario) it
instead measures step times on the emulated network, side by side in interleaved rounds: today's fp32
GPipe without overlap, then fp32, bf16, int8 and int4 with 1F1B and overlap::

    p2ptrain plan --scenario worldwide --devices 4 --stages 2 --json > plan.json
    python benchmarks/wire.py --plan plan.json --scenario worldwide --batch-size 76 --steps 12

The size factor defaults to the swarm's automatic one (this run's activation bytes over the paper's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics

import click

from p2ptrain.model.outer import DiLoCoConfig
from p2ptrain.runtime.config import TrainConfig
from p2ptrain.runtime.wire import CODECS
from p2ptrain.runtime.wire_quality import codec_errors, compare_wires, delta_coding_error


@click.command()
@click.option("--model", default="tiny", show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--micro-batches", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="1f1b", show_default=True)
@click.option("--wires", default="fp32,bf16,int8,int4,int4_all,int2", show_default=True,
              help="Comma-separated wire formats.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds; the table: their mean.")
@click.option("--sync", type=click.Choice(["every-step", "diloco"]), default="every-step", show_default=True)
@click.option("--inner-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="With --sync diloco.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), help="Measure step times on this plan.")
@click.option("--scenario", default="worldwide", show_default=True, help="With --plan: the network to emulate.")
@click.option("--time-scale", type=float, default=0.05, show_default=True)
@click.option("--size-factor", type=float, help="With --plan.  [default: automatic, as the swarm's]")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--settings", default="fp32/gpipe/no-overlap,fp32/1f1b/overlap,bf16/1f1b/overlap,int8/1f1b/overlap,"
              "int4/1f1b/overlap", show_default=True, help="With --plan: WIRE/SCHEDULE/overlap|no-overlap, ...; the "
              "first is the baseline.")
@click.option("--bucket-elements", type=click.IntRange(min=1), default=1 << 18, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def command(model, steps, stages, replicas, micro_batches, batch_size, schedule, wires, seeds, sync, inner_steps,
            plan_path, scenario, time_scale, size_factor, rounds, settings, bucket_elements, as_json):
    seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    cfg = TrainConfig(model=model, steps=steps, stages=stages, replicas=replicas, micro_batches=micro_batches,
                      global_batch_size=batch_size, schedule=schedule, seed=seed_list[0], num_threads=1,
                      bucket_elements=bucket_elements, sync=sync,
                      diloco=DiLoCoConfig(inner_steps=inner_steps))
    if plan_path is not None:
        _step_times(cfg, plan_path, scenario, time_scale, size_factor, rounds, _settings(settings), as_json)
        return
    names = [w.strip() for w in wires.split(",") if w.strip()]
    reports = [compare_wires(dataclasses.replace(cfg, seed=seed), names) for seed in seed_list]
    report = {"seeds": seed_list, "runs": reports, "wires": _mean_rows(reports),
              "codec_errors": codec_errors(cfg, CODECS),
              "delta_coding_error": {name: delta_coding_error(cfg, name) for name in ("int8", "int4")}}
    if as_json:
        click.echo(json.dumps(report))
        return
    click.echo(f"{model}, {stages} stages x {replicas} replicas, batch {batch_size} in {micro_batches} micro-batches, "
               f"{schedule}, {steps} steps, {sync}{f' (H = {inner_steps})' if sync == 'diloco' else ''}, "
               f"seeds {seeds}")
    click.echo(f"{'wire':<9}{'loss@last':>11}{'vs fp32':>9}{'mean last 10':>14}{'vs fp32':>9}{'spread':>8}"
               f"{'act B/step':>12}{'grad B/step':>13}{'DP B/step':>12}")
    for row in report["wires"]:
        b = row["step_wire_bytes"]
        click.echo(f"{row['wire']:<9}{row['final_loss']:>11.4f}{row.get('final_loss_vs_fp32', 0):>+9.2%}"
                   f"{row['last_mean_loss']:>14.4f}{row.get('last_mean_loss_vs_fp32', 0):>+9.2%}"
                   f"{row.get('last_mean_vs_fp32_spread', 0):>8.2%}"
                   f"{b['activation']:>12,}{b['activation_grad']:>13,}{b['all_reduce']:>12,}")
    errors = report["codec_errors"].items()
    click.echo("relative error at the initial parameters, activation / its gradient: " + ", ".join(
        f"{name} {e['activation']:.3f} / {e['activation_grad']:.3f}" for name, e in errors))
    for name, err in report["delta_coding_error"].items():
        click.echo(f"{name} activation error, sent as is: {err['direct']:.4f}; as the change since the slot's "
                   f"last value (AQ-SGD): {err['delta']:.4f}")


def _mean_rows(reports: list[dict]) -> list[dict]:
    """Per wire, the mean over seeds of the losses and of their differences to fp32, and the spread
    (max − min) over seeds of the last-10 mean's difference."""
    rows = []
    for k, first in enumerate(reports[0]["wires"]):
        runs = [report["wires"][k] for report in reports]
        row = {"wire": first["wire"], "step_wire_bytes": first["step_wire_bytes"]}
        for key in ("final_loss", "last_mean_loss", "final_loss_vs_fp32", "last_mean_loss_vs_fp32"):
            if key in first:
                row[key] = statistics.fmean(run[key] for run in runs)
        if "last_mean_loss_vs_fp32" in first:
            diffs = [run["last_mean_loss_vs_fp32"] for run in runs]
            row["last_mean_vs_fp32_spread"] = max(diffs) - min(diffs)
        rows.append(row)
    return rows


def _settings(text: str) -> list[tuple[str, str, bool]]:
    settings = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 3 or parts[2] not in ("overlap", "no-overlap"):
            raise click.BadParameter(f"{item!r}: expected WIRE/SCHEDULE/overlap or WIRE/SCHEDULE/no-overlap")
        settings.append((parts[0], parts[1], parts[2] == "overlap"))
    return settings


def _step_times(cfg, plan_path, scenario, time_scale, size_factor, rounds, settings, as_json):
    from p2ptrain.agent.leadership.plan_maker import run_workload
    from p2ptrain.net.transport.emulation import EmulationConfig
    from p2ptrain.planning import PAPER_WORKLOAD
    from p2ptrain.planning import scenario as paper_scenario
    from p2ptrain.runtime.plan_file import load_plan_file
    from p2ptrain.runtime.wire_quality import compare_step_times

    plan = load_plan_file(plan_path)
    cfg = dataclasses.replace(cfg, stages=plan.stages, replicas=plan.replicas, layers=plan.layers)
    if size_factor is None:
        size_factor = run_workload(cfg, plan.stages, plan.replicas).activation_gb / PAPER_WORKLOAD.activation_gb
    cluster = paper_scenario(scenario, plan.stages * plan.replicas)
    links = plan.links(cluster.latency_ms.tolist(), cluster.bandwidth_gbps.tolist(),
                       EmulationConfig(time_scale=time_scale, size_factor=size_factor))
    rows = compare_step_times(cfg, settings, links, rounds=rounds)
    if as_json:
        click.echo(json.dumps({"scenario": scenario, "time_scale": time_scale, "size_factor": size_factor,
                               "config": cfg.to_dict(), "settings": rows}))
        return
    click.echo(f"{scenario}, {plan.stages} stages x {plan.replicas} replicas, batch {cfg.global_batch_size}, "
               f"time scale {time_scale:g}, size factor {size_factor:.4g}, {rounds} rounds of {cfg.steps} steps")
    for row in rows:
        click.echo(f"{row['wire']:<5} {row['schedule']:<6} {'overlap' if row['overlap'] else 'no overlap':<11}"
                   f"{row['step_time_s']:>8.3f} s {row['speedup_vs_first']:>6.2f}x")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    command()
