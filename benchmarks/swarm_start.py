"""How soon a local swarm plans after its last agent is up, side by side: each interpreter given (a venv of one
commit, another of the next) runs ``p2ptrain swarm`` in turn, alternating, and the plan's delay from the last
agent up, the link measurements (each agent's own, and those it took from a peer's probe of it) and the losses
are printed per run, then the mean per interpreter.

    python benchmarks/swarm_start.py --python /tmp/basevenv/bin/python --python .venv/bin/python \
        [--runs 3] [--agents 16] [--stages 4] [--steps 5]

Each run starts from ``/`` so that no interpreter imports a working tree from its directory, and says which
``p2ptrain`` it imported: a venv copied with ``cp -a`` still activates the original (its ``activate`` script names
it), so the interpreter is called by its path. Figures of the 2-core dev machine: benchmarks/README.md, "Links at
scale" (issue 48, session 53).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

SWARM_TIMEOUT_S = 900.0


def run(python: str, agents: int, stages: int, steps: int, workdir: Path) -> dict:
    """One swarm: the delay of its plan after its last agent was up (s), measurements, losses."""
    which = subprocess.run([python, "-c", "import p2ptrain; print(p2ptrain.__file__)"], cwd="/", text=True,
                           capture_output=True, check=True, timeout=60).stdout.strip()
    done = subprocess.run([python, "-m", "p2ptrain", "swarm", "--agents", str(agents), "--stages", str(stages),
                           "--steps", str(steps), "--workdir", str(workdir)], cwd="/", text=True,
                          capture_output=True, timeout=SWARM_TIMEOUT_S)
    out = done.stdout + done.stderr

    def first(pattern: str) -> float | None:
        found = re.search(r"^\[\s*([\d.]+) s\][^\n]*" + pattern, out, re.M)
        return float(found.group(1)) if found else None

    up, plan = first(rf"agents up {agents}/{agents}"), first("plan epoch 0")
    logs = "".join(p.read_text(errors="replace") for p in workdir.glob("agent-*.log"))
    losses = re.findall(r"^\s+\d+\s+([\d.]+)\s+[\d.]+ s$", out, re.M)
    return {"which": which, "code": done.returncode, "delay_s": None if up is None or plan is None else plan - up,
            "own": logs.count("net.transport.probe: link to peer"), "served": logs.count("as its probe of us timed"),
            "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True, help="an interpreter to run (repeat)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="p2ptrain-swarm-start-"))
    delays: dict[str, list[float]] = {p: [] for p in args.python}
    for index in range(args.runs):
        for python in args.python:
            found = run(python, args.agents, args.stages, args.steps, root / f"{len(delays[python])}-{index}-{Path(python).parent.parent.name}")
            delay = found["delay_s"]
            print(f"{python} ({found['which']}): exit {found['code']}, plan "
                  + (f"{delay:.1f} s" if delay is not None else "never") + f" after the last agent up; measurements "
                  f"{found['own']} own + {found['served']} served; losses {' '.join(found['losses'])}", flush=True)
            if delay is not None:
                delays[python].append(delay)
    for python, found in delays.items():
        if found:
            print(f"{python}: mean {statistics.mean(found):.1f} s over {len(found)} runs "
                  f"({' / '.join(f'{d:.1f}' for d in found)})")


if __name__ == "__main__":
    main()
