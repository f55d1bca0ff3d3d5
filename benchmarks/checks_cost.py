"""What the checks of members' work cost a swarm's step: the same swarm with them on and off, side by side.

    python benchmarks/checks_cost.py                                # 4 agents, 2 x 2, small, 8 steps, 2 pairs
    python benchmarks/checks_cost.py --model tiny --pairs 1 --steps 6
    python benchmarks/checks_cost.py --device cuda --precision bf16 --wire bf16 --batch-size 32 --micro-batches 8
    python benchmarks/checks_cost.py --model tiny --scenario worldwide     # emulated links: the rounds' latency

Each pair runs ``p2ptrain swarm`` with ``--no-verify`` and then with the checks on (``[verify]`` defaults: the
sum check every step, the recompute check at its rate), alternating so that a busy machine weighs on both
alike. A step's time is the slowest trainer's (``step_time_s`` of its step events), the first step left out;
the run's is the median over steps. Printed per pair and over all of them: the step off and on, their
ratio, and where the checks' time went, from the step events: ``verify_s`` (the checks' time in the step's
hook: the sum check's sketches, commitments and rounds, with its waits for the group's slowest member, and the
wait for the recompute check of the step before) and ``sum_check_cpu_s`` (the sum check's own CPU time there,
none of its waits), each as a share of the step, and the recompute check's own report (micro-batches
recomputed, seconds beside the next steps, seconds the steps waited for it).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
RECOMPUTE = re.compile(r"every one of the (\d+) micro-batch\(es\) of stage \d+'s members recomputed here held \(the "
                       r"recompute check took ([\d.]+) s beside the next steps, and the steps waited ([\d.]+) s")


def run_swarm(workdir: Path, verify: bool, options: list[str], timeout_s: float) -> dict:
    """One swarm; its steps' times, the sum check's share and the recompute check's report."""
    command = [sys.executable, "-m", "p2ptrain", "swarm", "--workdir", str(workdir), "--json",
               "--verify" if verify else "--no-verify", *options]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise click.ClickException(f"the swarm failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    steps: dict[int, list[dict]] = {}
    for path in sorted(workdir.glob("agent-*.events.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "step":
                steps.setdefault(event["step"], []).append(event)
    measured = sorted(steps)[1:]  # the first step warms up
    step_s = [max(e["step_time_s"] for e in steps[s]) for s in measured]
    verify_share = [max((e.get("verify_s") or 0.0) / e["step_time_s"] for e in steps[s] if e["step_time_s"] > 0)
                    for s in measured]
    cpu_share = [max((e.get("sum_check_cpu_s") or 0.0) / e["step_time_s"] for e in steps[s] if e["step_time_s"] > 0)
                 for s in measured]
    recomputed = [m.groups() for path in workdir.glob("agent-*.log") for m in RECOMPUTE.finditer(path.read_text())]
    return {"step_s": statistics.median(step_s), "steps": len(step_s), "wall_s": time.monotonic() - started,
            "verify_share": statistics.median(verify_share) if verify else 0.0,
            "sum_check_cpu_share": statistics.median(cpu_share) if verify else 0.0,
            "recomputed": sum(int(n) for n, _, _ in recomputed),
            "recompute_shadow_s": sum(float(s) for _, s, _ in recomputed),
            "recompute_waited_s": sum(float(w) for _, _, w in recomputed)}


@click.command()
@click.option("--agents", default=4, show_default=True, type=click.IntRange(min=2))
@click.option("--stages", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--model", default="small", show_default=True)
@click.option("--steps", default=8, show_default=True, type=click.IntRange(min=3))
@click.option("--pairs", default=2, show_default=True, type=click.IntRange(min=1), help="Off/on runs, alternating.")
@click.option("--scenario", default="none", show_default=True, help="The swarm's emulated network (none: loopback).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--precision", default="fp32", show_default=True)
@click.option("--wire", default="fp32", show_default=True)
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--micro-batches", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--timeout-s", default=900.0, show_default=True, type=click.FloatRange(min=1), help="Per swarm.")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as one JSON document.")
def main(agents: int, stages: int, model: str, steps: int, pairs: int, scenario: str, device: str, precision: str,
         wire: str, batch_size: int, micro_batches: int, timeout_s: float, as_json: bool) -> None:
    options = ["--agents", str(agents), "--stages", str(stages), "--model", model, "--steps", str(steps),
               "--scenario", scenario, "--device", device, "--precision", precision, "--wire", wire,
               "--batch-size", str(batch_size), "--micro-batches", str(micro_batches)]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="p2ptrain-checks-") as tmp:
        for pair in range(pairs):
            for verify in (False, True):
                click.echo(f"pair {pair + 1}/{pairs}: checks {'on' if verify else 'off'} ...", err=True)
                run = run_swarm(Path(tmp) / f"{pair}-{int(verify)}", verify, options, timeout_s)
                runs.append({"pair": pair, "verify": verify, **run})
                click.echo(f"  step {run['step_s']:.3f} s over {run['steps']} steps ({run['wall_s']:.0f} s in all)",
                           err=True)
    off = statistics.median(r["step_s"] for r in runs if not r["verify"])
    on = statistics.median(r["step_s"] for r in runs if r["verify"])
    checked = [r for r in runs if r["verify"]]
    summary = {"options": options, "runs": runs, "step_off_s": off, "step_on_s": on, "ratio": on / off,
               "sum_check_share": statistics.median(r["verify_share"] for r in checked),
               "sum_check_cpu_share": statistics.median(r["sum_check_cpu_share"] for r in checked),
               "recomputed": sum(r["recomputed"] for r in checked),
               "recompute_waited_s": sum(r["recompute_waited_s"] for r in checked)}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    for pair in range(pairs):
        a, b = (next(r for r in runs if r["pair"] == pair and r["verify"] == v) for v in (False, True))
        click.echo(f"pair {pair + 1}: off {a['step_s']:.3f} s, on {b['step_s']:.3f} s ({b['step_s'] / a['step_s']:.2f}x); "
                   f"the hook {b['verify_share']:.1%} of a step, the sum check's CPU {b['sum_check_cpu_share']:.1%}; {b['recomputed']} micro-batches recomputed, "
                   f"{b['recompute_shadow_s']:.2f} s beside the steps, {b['recompute_waited_s']:.2f} s waited for")
    click.echo(f"checks on / off: {on:.3f} / {off:.3f} s = {on / off:.2f}x (medians of {pairs} pair(s)); the hook "
               f"{summary['sum_check_share']:.1%} of a step, the sum check's own CPU {summary['sum_check_cpu_share']:.1%}")


if __name__ == "__main__":
    main()
