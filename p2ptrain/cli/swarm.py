"""``p2ptrain swarm``: a bootstrap and N agents on this machine — the demo, the test rig, the benchmark rig.

    p2ptrain swarm                                          # 4 agents, 2 stages, the paper's world-wide network
    p2ptrain swarm --agents 8 --stages 4 --scenario worldwide --plan megatron --steps 20
    p2ptrain swarm --agents 4 --stages 2 --steps 3 --scenario none --json > run.json
    p2ptrain swarm --agents 6 --stages 3 --kill 4@3 --kill leader@6 --partition 2@8:15 --steps 12 --json
    p2ptrain swarm --agents 8 --stages 4 --steps 40 --monitor 8080     # and watch it on http://127.0.0.1:8080/
    p2ptrain swarm --agents 4 --stages auto --scenario none             # the leader chooses the stage count

Progress goes to stderr (one line redrawn on a terminal, a line per change otherwise), then a summary;
``--json`` prints the summary as one JSON document on stdout instead (``losses`` and ``step_time_s`` per
step, ``plan`` by agent index, predicted cost, emulation factors, peer IDs). The work dir keeps every
agent's log and ``swarm.json`` (PIDs). Exit code 0 only if every agent trained every step; SIGTERM or
Ctrl-C stop every process it started.
"""

from __future__ import annotations

import json
import logging
import sys

import click

from p2ptrain.cli.config_options import Flag, OptionTable, build
from p2ptrain.cli.optimizer_options import RECIPES_HELP, optimizer_flags, sync_flags
from p2ptrain.planning.scenarios import NAMED_SCENARIOS
from p2ptrain.swarm.config import SwarmConfig

OPTIONS = OptionTable(SwarmConfig, [
    "agents", "stages", "steps", Flag(None, "scenario", type=click.Choice([*NAMED_SCENARIOS, "none"])),
    Flag("--cluster", "cluster_file"), "time_scale", "size_factor", "compute_scale", Flag("--plan", "strategy"),
    "objective", "model", "subspace",
    *optimizer_flags(), *sync_flags(),
    "init_from", "batch_size", "micro_batches", "wire", "schedule", "overlap", "seed", "data", "precision", "compile",
    "eval_every", "device", "workdir", "run",
    Flag("--json", param="as_json", is_flag=True, help="Print the summary as one JSON document on stdout."),
    Flag("--kill", "kills", type=click.STRING, multiple=True, metavar="AGENT@STEP",
         callback=lambda c, p, v: _at_pairs(v, "--kill"), convert=lambda v: tuple((a, int(s)) for a, s in v)),
    Flag("--partition", "partitions", type=click.STRING, multiple=True, metavar="AGENT@STEP:SECONDS",
         callback=lambda c, p, v: _partitions(v)),
    Flag("--join", "joins", type=click.STRING, multiple=True, metavar="N@STEP",
         callback=lambda c, p, v: _at_pairs(v, "--join"), convert=lambda v: tuple((int(n), int(s)) for n, s in v)),
    "checkpoint_every", Flag("--resume", "resume"), "liveness", "verify", "warm_copies",
    Flag("--call-timeout", "call_timeout_s"), Flag("--peer-ttl", "peer_ttl_s"), "link_partners",
    Flag("--monitor", "monitor_port", is_flag=False, flag_value=0, default=None, metavar="[PORT]"),
], click_defaults=True)


@click.command(name="swarm", epilog=RECIPES_HELP)
@OPTIONS.add
@click.pass_context
def command(ctx: click.Context, as_json: bool, **params: object) -> None:
    """Start a bootstrap and N agents on this machine, train, and summarise."""
    from p2ptrain.lifecycle import StopSignal, logger_levels
    from p2ptrain.swarm.agent_launcher import run_swarm
    from p2ptrain.swarm.report import SwarmDisplay, format_summary

    if not (ctx.parent.params.get("verbose") if ctx.parent else 0):  # the progress line is the output
        ctx.with_resource(logger_levels({"p2ptrain": logging.WARNING}))
    tree = OPTIONS.tree(params)
    if tree["scenario"] == "none" or "cluster_file" in tree:
        tree["scenario"] = None
    tree["checkpoint_every"] = tree["checkpoint_every"] or tree["eval_every"]
    config = build(SwarmConfig, tree)
    display = SwarmDisplay(sys.stderr)
    with StopSignal() as stop:
        try:
            result = run_swarm(config, stop, on_update=display.update,
                               on_monitor=lambda url: click.echo(f"monitor: {url}", err=True))
        finally:
            display.close()
    if as_json:
        click.echo(json.dumps(result.summary))
    else:
        regions = None
        if result.summary.get("network"):
            from p2ptrain.planning import load_cluster

            cluster = load_cluster(f"{result.workdir}/cluster.json")
            regions = [d.region for d in cluster.devices]
        click.echo(format_summary(result.summary, regions), err=True)
    if not result.ok:
        click.echo(f"Error: {result.error}", err=True)
        ctx.exit(1)


def _partitions(values: tuple[str, ...]) -> tuple[tuple[str, int, float], ...]:
    """``AGENT@STEP:SECONDS`` values as (AGENT, STEP, SECONDS)."""
    out = []
    for value in values:
        head, _, seconds = value.partition(":")
        try:
            ((agent, step),) = _at_pairs((head,), "--partition")
            out.append((agent, int(step), float(seconds)))
        except (click.BadParameter, ValueError):
            raise click.BadParameter(f"{value!r} is not AGENT@STEP:SECONDS", param_hint="--partition") from None
    return tuple(out)


def _at_pairs(values: tuple[str, ...], option: str) -> tuple[tuple[str, str], ...]:
    """``A@B`` values as (A, B) pairs, B a whole number."""
    pairs = []
    for value in values:
        head, sep, step = value.partition("@")
        if not sep or not head or not step.isdigit() or (option == "--join" and not head.isdigit()):
            raise click.BadParameter(f"{value!r} is not {'AGENT@STEP' if option == '--kill' else 'N@STEP'}",
                                     param_hint=option)
        pairs.append((head, step))
    return tuple(pairs)
