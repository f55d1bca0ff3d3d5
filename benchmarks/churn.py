"""Churn benchmark: how long a swarm takes to recover from a SIGKILLed agent, beside its step time.

    python benchmarks/churn.py [--agents 6] [--stages 3] [--steps 10] [--call-timeout 4] [--peer-ttl 4] [--json]

Runs a loopback swarm (Megatron plans, checkpoints every 2 steps) that loses a non-leader agent with step 3
in flight and then the leader with step 7 in flight, and prints, per re-plan, the seconds from the kill to
the next completed step, the same in median step times, and why the leader re-planned. Recovery is bounded
by the call deadline (the survivors halt), the peer record lifetime (the dead peer leaves the membership),
the plan's publication and the state hand-over; the printed ratio says what that costs in steps.
"""

from __future__ import annotations

import json
import logging
import tempfile

import click

from p2ptrain.agent.swarm import SwarmConfig, run_swarm
from p2ptrain.net.identity import load_or_create_identity
from p2ptrain.net.lifecycle import StopSignal


@click.command()
@click.option("--agents", default=6, show_default=True)
@click.option("--stages", default=3, show_default=True)
@click.option("--steps", default=10, show_default=True)
@click.option("--call-timeout", default=4.0, show_default=True)
@click.option("--peer-ttl", default=4.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(agents: int, stages: int, steps: int, call_timeout: float, peer_ttl: float, as_json: bool) -> None:
    workdir = tempfile.mkdtemp(prefix="p2ptrain-bench-churn-")
    ids = [load_or_create_identity(f"{workdir}/agent-{k}.id").peer_id for k in range(agents)]
    replica = next(k for k in range(agents) if ids[k] != min(ids))
    config = SwarmConfig(agents=agents, stages=stages, steps=steps, scenario=None, strategy="megatron",
                         workdir=workdir, call_timeout_s=call_timeout, peer_ttl_s=peer_ttl, checkpoint_every=2,
                         kills=((str(replica), 3), ("leader", 7)))  # fmt: skip
    with StopSignal() as stop:
        result = run_swarm(config, stop)
    summary = result.summary
    step_s = summary["median_step_time_s"] or float("nan")
    rows = [{**r, "steps_lost": (r["recovery_s"] / step_s) if r["recovery_s"] is not None else None}
            for r in summary["replans"]]  # fmt: skip
    if as_json:
        click.echo(json.dumps({"ok": result.ok, "median_step_time_s": step_s, "replans": rows,
                               "call_timeout_s": call_timeout, "peer_ttl_s": peer_ttl}))
        return
    click.echo(f"{agents} agents, {stages} stages, {steps} steps on loopback; call deadline {call_timeout:g} s, "
               f"peer record lifetime {peer_ttl:g} s; finished: {result.ok}; median step {step_s:.3f} s")
    click.echo(f"{'epoch':>5} {'from step':>9} {'recovery s':>10} {'in steps':>8}  reason")
    for r in rows:
        recovery = f"{r['recovery_s']:10.2f} {r['steps_lost']:7.1f}×" if r["recovery_s"] is not None else f"{'—':>10} {'—':>8}"
        click.echo(f"{r['epoch']:>5} {r['start_step']:>9} {recovery}  {r['reason'][:90]}")
    click.echo(f"logs: {workdir}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
