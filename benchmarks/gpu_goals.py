"""Issue 46's GPU goals in one run, each printed as a ratio beside its baseline (a lent GPU's few minutes):

    python benchmarks/gpu_goals.py [--device cuda] [--model gpt2] [--large llama-1b] [--steps 12] [--json]
    python benchmarks/gpu_goals.py --device cpu --model tiny --large "" --steps 6     # a dry run on a CPU

1. ``p2ptrain train`` of ``--model`` in one process (bf16, batch 16 of the preset's sequences): the baseline's
   tokens/s and MFU; then the same with ``--compile`` (goal for ``gpt2``: MFU ≥ 30 % on an H100/H200).
2. ``p2ptrain swarm`` of 4 agents sharing the device, 2 stages × 2 replicas, bf16 compute and wire, batch 16 in
   4 micro-batches, no emulated network, the leader scoring plans by the simulated step: with the checks off,
   then on (their defaults). Goals: the swarm's tokens/s ≥ 50 % of one process's; its measured step ≤ 1.15×
   the leader's prediction; checks on ≤ 1.10× off; the sum check's own CPU (``sum_check_cpu_s``) a few per
   cent of a step.
3. ``p2ptrain train --compile`` of ``--large`` (goal for ``llama-1b``: MFU ≥ 45 %); skipped when empty.

Each command has its own deadline and its output goes to ``--out``; one that fails is reported and the rest
still run. One process's tokens/s and MFU are over its steps after the first (``steady``: the first compiles);
the swarm's step is the median of its trainers' steps after the first (``median_step_time_s``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"swarm_share": 0.5, "predicted": 1.15, "checks": 1.10, "compile_mfu": {"gpt2": 0.30, "llama-1b": 0.45}}


def run_json(name: str, command: list[str], out: Path, timeout_s: float) -> dict | None:
    """``command`` (a p2ptrain command with ``--json``) under a deadline; its JSON document, or None (logged)."""
    started = time.monotonic()
    click.echo(f"=== {name}: {' '.join(command)}", err=True)
    try:
        done = subprocess.run([sys.executable, "-m", "p2ptrain", *command], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        click.echo(f"=== {name}: past its {timeout_s:.0f} s deadline", err=True)
        return None
    (out / f"{name}.log").write_text(done.stderr)
    (out / f"{name}.json").write_text(done.stdout)
    click.echo(f"=== {name}: rc={done.returncode} in {time.monotonic() - started:.0f} s", err=True)
    if done.returncode != 0:
        click.echo("\n".join(done.stderr.strip().splitlines()[-5:]), err=True)
        return None
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as e:
        click.echo(f"=== {name}: its output is not one JSON document ({e})", err=True)
        return None


def steady(document: dict | None) -> dict | None:
    """A ``train --json`` document with its tokens/s and MFU over the steps after the first (the first compiles,
    with ``--compile`` tens of seconds): ``tokens_per_s`` and ``mfu`` scaled by the mean step over the median of
    the rest."""
    if document is None or len(document.get("step_time_s") or []) < 2 or not document.get("tokens_per_s"):
        return document
    times = document["step_time_s"]
    factor = statistics.fmean(times) / statistics.median(times[1:])
    return document | {"tokens_per_s": document["tokens_per_s"] * factor,
                       "mfu": document["mfu"] * factor if document.get("mfu") is not None else None}


def sum_check_share(workdir: Path) -> float | None:
    """The median over steps (the first left out) of the largest ``sum_check_cpu_s`` / ``step_time_s``."""
    steps: dict[int, list[dict]] = {}
    for path in workdir.glob("agent-*.events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "step" and event.get("sum_check_cpu_s") is not None:
                steps.setdefault(event["step"], []).append(event)
    shares = [max(e["sum_check_cpu_s"] / e["step_time_s"] for e in steps[s] if e["step_time_s"] > 0)
              for s in sorted(steps)[1:]]
    return statistics.median(shares) if shares else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@click.command()
@click.option("--device", default="cuda", show_default=True)
@click.option("--model", default="gpt2", show_default=True)
@click.option("--large", default="llama-1b", show_default=True, help="A large preset to train compiled; '' skips it.")
@click.option("--steps", default=12, show_default=True, type=click.IntRange(min=3))
@click.option("--out", default="gpu-goals", show_default=True, help="Where the commands' logs, JSON and workdirs go.")
@click.option("--timeout-s", default=240.0, show_default=True, type=click.FloatRange(min=10), help="Per command.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON document.")
def main(device: str, model: str, large: str, steps: int, out: str, timeout_s: float, as_json: bool) -> None:
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    common = ["--model", model, "--device", device, "--precision", "bf16", "--steps", str(steps), "--json"]
    alone = steady(run_json("train", ["train", *common, "--batch-size", "16"], folder, timeout_s))
    compiled = steady(run_json("train-compile", ["train", *common, "--batch-size", "16", "--compile"], folder,
                               timeout_s))
    swarms = {}
    for checks in ("off", "on"):
        workdir = folder / f"swarm-{checks}"
        swarms[checks] = run_json(f"swarm-{checks}", [
            "swarm", *common, "--agents", "4", "--stages", "2", "--wire", "bf16", "--scenario", "none",
            "--objective", "simulated",
            "--batch-size", "16", "--micro-batches", "4", "--no-verify" if checks == "off" else "--verify",
            "--workdir", str(workdir)], folder, timeout_s)
        if swarms[checks] is not None:
            swarms[checks]["sum_check_share"] = sum_check_share(workdir)
    big = steady(run_json("large-compile", ["train", "--model", large, "--device", device, "--precision", "bf16",
                                            "--steps", str(steps), "--compile", "--json"], folder, timeout_s)) \
        if large else None

    def get(document: dict | None, key: str) -> float | None:
        return None if document is None else document.get(key)

    off, on = swarms["off"], swarms["on"]
    mfu_goal = GOALS["compile_mfu"]
    # (what, measured, baseline, ratio, goal, the number the goal is for: "ratio" or "measured", at least or at most)
    rows = [
        ("one process: tokens/s", get(alone, "tokens_per_s"), None, None, None, "", ""),
        ("one process: MFU", get(alone, "mfu"), None, None, None, "", ""),
        ("--compile: MFU", get(compiled, "mfu"), get(alone, "mfu"), ratio(get(compiled, "mfu"), get(alone, "mfu")),
         mfu_goal.get(model), "measured", ">="),
        ("swarm, checks off: tokens/s / one process's", get(off, "tokens_per_s"), get(alone, "tokens_per_s"),
         ratio(get(off, "tokens_per_s"), get(alone, "tokens_per_s")), GOALS["swarm_share"], "ratio", ">="),
        ("swarm, checks off: measured / predicted step", get(off, "median_step_time_s"), get(off, "predicted_cost_s"),
         ratio(get(off, "median_step_time_s"), get(off, "predicted_cost_s")), GOALS["predicted"], "ratio", "<="),
        ("swarm, checks on / off: step", get(on, "median_step_time_s"), get(off, "median_step_time_s"),
         ratio(get(on, "median_step_time_s"), get(off, "median_step_time_s")), GOALS["checks"], "ratio", "<="),
        ("swarm, checks on: the sum check's CPU share of a step", get(on, "sum_check_share"), None, None, None, "", ""),
        (f"{large or '(no large preset)'} --compile: MFU", get(big, "mfu"), None, None, mfu_goal.get(large),
         "measured", ">="),
    ]

    def met(row: tuple) -> bool | None:
        _, measured, _, r, goal, which, at = row
        value = r if which == "ratio" else measured
        if goal is None or value is None:
            return None
        return value >= goal if at == ">=" else value <= goal

    if as_json:
        click.echo(json.dumps([dict(zip(("what", "measured", "baseline", "ratio", "goal"), row[:5], strict=True))
                               | {"met": met(row)} for row in rows], indent=1))
        return

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    click.echo(f"{'':54s} {'measured':>10s} {'baseline':>10s} {'ratio':>8s} {'goal':>9s} met")
    for row in rows:
        what, measured, baseline, r, goal, which, at = row
        aim = "-" if goal is None else f"{at}{goal:g}" + (" x" if which == "ratio" else "")
        verdict = {True: "yes", False: "NO", None: "-"}[met(row)]
        click.echo(f"{what:54s} {show(measured):>10s} {show(baseline):>10s} {show(r):>8s} {aim:>9s} {verdict}")


if __name__ == "__main__":
    main()
