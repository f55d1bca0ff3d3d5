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

from p2ptrain.agent.config import OBJECTIVE_NAMES, STRATEGIES
from p2ptrain.cli.optimizer_options import (
    INIT_FROM_HELP,
    RECIPES_HELP,
    diloco_flags,
    optimizer_flags,
    optimizer_options,
    sync_options,
)
from p2ptrain.cli.stage_count import StageCount
from p2ptrain.planning.model_shapes import MODEL_PRESETS
from p2ptrain.planning.scenarios import NAMED_SCENARIOS
from p2ptrain.runtime.wire import WIRE_FORMATS


@click.command(name="swarm", epilog=RECIPES_HELP)
@click.option("--agents", type=click.IntRange(min=1), default=4, show_default=True, help="Agent processes.")
@click.option("--stages", type=StageCount(), default=2, show_default=True,
              help="Pipeline stages; auto: the leader chooses them for the run's first plan.")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Optimizer steps.")
@click.option("--scenario", type=click.Choice([*NAMED_SCENARIOS, "none"]), default="worldwide", show_default=True,
              help="The network to emulate, scaled to --agents devices (volunteers: mixed GPUs too, their compute "
                   "emulated); 'none': plain loopback.")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False),
              help="Emulate this cluster file instead (docs/design.md format, one device per agent).")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True),
              help="Emulated seconds per network second.  [default: 0.05 for a scenario, 1 for --cluster, times "
                   "--compute-scale]")
@click.option("--size-factor", type=click.FloatRange(min=0, min_open=True),
              help="This run's bytes per paper byte.  [default: automatic for a scenario, 1 for --cluster]")
@click.option("--compute-scale", type=click.FloatRange(min=1), default=1.0, show_default=True,
              help="Play every emulated device this many times slower, and (unless --time-scale is given) "
                   "the network alike: the same world in slow motion, in which more agents than cores "
                   "compute as on cards of their own.")
@click.option("--plan", "strategy", type=click.Choice(list(STRATEGIES)), default="scheduled", show_default=True,
              help="The leader's strategy.")
@click.option("--objective", type=click.Choice(list(OBJECTIVE_NAMES)), default="dtfm", show_default=True,
              help="What the leader scores plans by: the paper's communication cost, or the simulated step time.")
@click.option("--model", type=click.Choice(list(MODEL_PRESETS)), default="tiny", show_default=True)
@optimizer_options
@sync_options
@click.option("--init-from", type=click.Path(file_okay=False), help=INIT_FROM_HELP)
@click.option("--batch-size", type=click.IntRange(min=1),
              help="Global batch.  [default: matched to the paper's c_PP/c_DP when emulating a scenario, else 16]")
@click.option("--micro-batches", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--wire", type=click.Choice(list(WIRE_FORMATS)), default="fp32", show_default=True,
              help="How tensors travel between agents (fp32 is exact).")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b"]), default="gpipe", show_default=True,
              help="Pipeline schedule.")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="All-reduce gradient buckets during the last backward.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--data", help="Training data: a text file or folder, or a prepared dataset (p2ptrain data prepare).  "
              "[default: the built-in corpus]")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Compute precision (autocast; fp32 is exact).")
@click.option("--compile/--no-compile", "compile_blocks", default=False, show_default=True,
              help="torch.compile each transformer block (not bit for bit eager; seconds to compile).")
@click.option("--eval-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Validation loss of the checkpoints every K steps (a prepared dataset; checkpoints every K "
              "steps unless --checkpoint-every says otherwise).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), help="Logs, configs and status here.  [default: a new temp dir]")
@click.option("--run", "run_id", help="Run name (DHT keys).  [default: swarm-<random>]")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON document on stdout.")
@click.option("--kill", "kills", multiple=True, metavar="AGENT@STEP", callback=lambda c, p, v: _at_pairs(v, "--kill"),
              help="SIGKILL agent AGENT (an index, or 'leader') while step STEP is in flight; repeatable.")
@click.option("--partition", "partitions", multiple=True, metavar="AGENT@STEP:SECONDS",
              callback=lambda c, p, v: _partitions(v),
              help="Cut agent AGENT off (SIGSTOP its processes) while step STEP is in flight, for SECONDS; repeatable.")
@click.option("--join", "joins", multiple=True, metavar="N@STEP", callback=lambda c, p, v: _at_pairs(v, "--join"),
              help="Start N more agents once step STEP is done; they take a role at the next re-plan; repeatable.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Save every stage's state every K steps in <workdir>/checkpoints (0: never).")
@click.option("--resume", is_flag=True,
              help="Start from the newest step every stage has a copy of on the agents' own disks "
                   "(<workdir>/agent-K.state), or in <workdir>/checkpoints with --checkpoint-every.")
@click.option("--liveness/--no-liveness", default=True, show_default=True,
              help="Heartbeat pings that notice a dead or cut-off agent within seconds (off: only failed calls "
                   "and expired records do).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="The checks of members' work ([verify] enabled, p2ptrain.verify; off: to measure what they cost).")
@click.option("--warm-copies/--no-warm-copies", default=True, show_default=True,
              help="Copy every stage's state to another agent every few steps (off: only at re-plans).")
@click.option("--call-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds a tensor call may take before its peer counts as failed.")
@click.option("--peer-ttl", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Lifetime of an agent's peer record (heartbeats notice a silent agent sooner).")
@click.option("--monitor", "monitor_port", type=click.IntRange(0, 65535), is_flag=False, flag_value=0,
              default=None, metavar="[PORT]",
              help="Also serve the run's live web page (p2ptrain monitor) on PORT (none given: any free port); "
                   "its address is printed when it is up.")
@click.pass_context
def command(ctx: click.Context, agents: int, stages: int | str, steps: int, scenario: str, cluster_file: str | None,
            time_scale: float | None, size_factor: float | None, compute_scale: float, strategy: str, objective: str, model: str,
            batch_size: int | None, micro_batches: int, wire: str, schedule: str, overlap: bool, seed: int, data: str | None, precision: str, compile_blocks: bool, eval_every: int, device: str, workdir: str | None, run_id: str | None,
            as_json: bool, kills: tuple, partitions: tuple, joins: tuple, checkpoint_every: int, resume: bool, call_timeout: float,
            peer_ttl: float, liveness: bool, verify: bool, warm_copies: bool, monitor_port: int | None,
            init_from: str | None, sync: str | None, **optimizer: object) -> None:
    """Start a bootstrap and N agents on this machine, train, and summarise."""
    from p2ptrain.lifecycle import StopSignal
    from p2ptrain.model.optim import OptimizerConfig
    from p2ptrain.model.outer import DiLoCoConfig
    from p2ptrain.swarm.agent_launcher import SwarmConfig, run_swarm
    from p2ptrain.swarm.report import SwarmDisplay, format_summary

    if not (ctx.parent.params.get("verbose") if ctx.parent else 0):
        logging.getLogger("p2ptrain").setLevel(logging.WARNING)  # the progress line is the output
    config = SwarmConfig(
        agents=agents, stages=stages, steps=steps, scenario=None if scenario == "none" or cluster_file else scenario,
        cluster_file=cluster_file, time_scale=time_scale, size_factor=size_factor, compute_scale=compute_scale,
        strategy=strategy,
        objective=objective, model=model,
        batch_size=batch_size, micro_batches=micro_batches, wire=wire, schedule=schedule, overlap=overlap, seed=seed, data=data, precision=precision, compile=compile_blocks, eval_every=eval_every, device=device, workdir=workdir, run=run_id,
        kills=tuple((a, int(s)) for a, s in kills), partitions=partitions, joins=tuple((int(n), int(s)) for n, s in joins),
        checkpoint_every=checkpoint_every or eval_every, resume=resume, call_timeout_s=call_timeout, peer_ttl_s=peer_ttl,
        liveness=liveness, verify=verify, warm_copies=warm_copies, monitor_port=monitor_port,
        optimizer=OptimizerConfig(**optimizer_flags(optimizer)), init_from=init_from,
        sync=sync or "every-step", diloco=DiLoCoConfig(**diloco_flags(optimizer)),
    )
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
