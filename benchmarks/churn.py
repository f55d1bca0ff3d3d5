"""Churn benchmark: how long a swarm takes from a failure to its next completed step, with the defaults a
user gets, beside the same runs without heartbeats and warm copies (how p2ptrain recovered before them).

    python benchmarks/churn.py [--json] [--only kill|partition]

Two runs, each twice (defaults; then ``--no-liveness --no-warm-copies``), in one invocation:

* **kill**: the paper's world-wide network emulated on 6 agents (3 stages), an agent SIGKILLed with step 3
  in flight, then the leader with step 6 in flight (``p2ptrain swarm --agents 6 --stages 3 --steps 10
  --kill 4@3 --kill leader@6``);
* **partition**: 4 agents on loopback (2 stages), one agent other than the leader cut off (SIGSTOP of its
  processes) with step 3 in flight, for 20 s.

Per failure: the seconds to the next completed step (of a new epoch, or of the same one when nothing was
re-planned: a cut-off agent that comes back before any deadline only stalls the run), the same in median
step times. Per re-plan: where the new epoch starts, how many steps were redone, and what the warm copies
cost (one copy's predicted seconds, every how many steps, seconds per step). The comparison runs keep the
copies each epoch's start makes; before this change a lost stage restarted from step 0.
"""

from __future__ import annotations

import json
import logging
import tempfile

import click

from p2ptrain.lifecycle import StopSignal
from p2ptrain.net.identity import load_or_create_identity
from p2ptrain.swarm.agent_launcher import SwarmConfig, run_swarm

TODAY = {"liveness": False, "warm_copies": False}


def _configs(only: str | None) -> list[tuple[str, str, SwarmConfig]]:
    runs = []
    for label, extra in (("defaults", {}), ("no heartbeats, no copies", TODAY)):
        if only in (None, "kill"):
            workdir = tempfile.mkdtemp(prefix="p2ptrain-bench-churn-kill-")
            runs.append(("kill", label, SwarmConfig(agents=6, stages=3, steps=10, workdir=workdir,
                                                     kills=(("4", 3), ("leader", 6)), **extra)))
        if only in (None, "partition"):
            workdir = tempfile.mkdtemp(prefix="p2ptrain-bench-churn-partition-")
            ids = [load_or_create_identity(f"{workdir}/agent-{k}.id").peer_id for k in range(4)]
            cut = next(str(k) for k in range(4) if ids[k] != min(ids))
            runs.append(("partition", label, SwarmConfig(agents=4, stages=2, steps=12, scenario=None, workdir=workdir,
                                                          partitions=((cut, 3, 20.0),), **extra)))
    return runs


@click.command()
@click.option("--only", type=click.Choice(["kill", "partition"]), help="Run one of the two scenarios.")
@click.option("--json", "as_json", is_flag=True)
def main(only: str | None, as_json: bool) -> None:
    results = []
    for scenario, label, config in _configs(only):
        click.echo(f"running {scenario} ({label}) in {config.workdir} ...", err=True)
        with StopSignal() as stop:
            result = run_swarm(config, stop)
        summary = result.summary
        step_s = summary["median_step_time_s"] or float("nan")
        steps = [e for a in result.agents for e in a.events.all("step")]
        failures = []
        for index, failure in sorted(summary["killed"].items(), key=lambda kv: kv[1]["time"]):
            before = [e for e in steps if e["time"] <= failure["time"]]
            epoch = max((e["epoch"] for e in before), default=0)
            done = max((e["step"] for e in before if e["epoch"] == epoch), default=0)
            after = [e["time"] for e in steps if e["time"] > failure["time"] and (e["epoch"] > epoch or e["step"] > done)]
            next_s = min(after) - failure["time"] if after else None
            failures.append({"agent": index, "as": failure["as"], "step": failure["step"], "next_step_s": next_s,
                             "in_steps": next_s / step_s if next_s is not None else None})
        replans = [{**r, "in_steps": r["recovery_s"] / step_s if r["recovery_s"] is not None else None}
                   for r in summary["replans"]]
        results.append({"scenario": scenario, "settings": label, "ok": result.ok, "median_step_time_s": step_s,
                        "failures": failures,
                        "restarted_from_zero": any(r["start_step"] == 0 for r in replans), "replans": replans,
                        "workdir": result.workdir})
    if as_json:
        click.echo(json.dumps(results))
        return
    click.echo(f"{'scenario':<10} {'settings':<25} {'ok':<5} {'step s':>6}  failure                 next step s  in steps")
    for run in results:
        for f in run["failures"]:
            took = f"{f['next_step_s']:11.1f} {f['in_steps']:8.1f}×" if f["next_step_s"] is not None else f"{'—':>11} {'—':>9}"
            what = f"agent {f['agent']} {'cut off' if f['as'] == 'partitioned' else 'killed'} @{f['step']}"
            click.echo(f"{run['scenario']:<10} {run['settings']:<25} {str(run['ok']):<5} {run['median_step_time_s']:6.2f}  "
                       f"{what:<22} {took}")
    click.echo("\nre-plans:")
    click.echo(f"{'scenario':<10} {'settings':<25} {'epoch':>5} {'kind':<8} {'from':>4} {'redone':>6} {'recovery s':>10}  "
               "copies (every, s/copy, s/step)  reason")
    for run in results:
        for r in run["replans"]:
            copies = r.get("warm_copies") or {}
            recovery = f"{r['recovery_s']:10.1f}" if r.get("recovery_s") is not None else f"{'—':>10}"
            copy = (f"{copies['every_steps']}, {copies['copy_s']:.3f}, {copies['per_step_s']:.4f}"
                    if copies.get("every_steps") else "off")
            click.echo(f"{run['scenario']:<10} {run['settings']:<25} {r['epoch']:>5} {r['kind']:<8} {r['start_step']:>4} "
                       f"{r['steps_redone']:>6} {recovery}  {copy:<30}  {r['reason'][:70]}")
    click.echo("next step: seconds from the kill (or the cut) to the next completed step; from: the step the new "
               "epoch starts at; redone: steps trained again")

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
