"""End-to-end benchmark on all five of the paper's networks (same code as ``p2ptrain bench e2e``, one network
after another): measured step times of the scheduled plan, Megatron's order and a random assignment, beside
the simulated objective's predictions; one table, and e2e.json, e2e.csv and e2e.png in --out.

    python benchmarks/e2e.py [--agents 8] [--stages 4] [--steps 8] [--networks worldwide,spot] [--out DIR]
                             [--settings fp32/gpipe/no-overlap,bf16/1f1b/overlap,int8/1f1b/overlap]

With ``--settings`` each network's scheduled plan also trains with every further setting (wire format /
schedule / overlap), measured beside predicted, with the loss after the last step (``p2ptrain bench e2e``).

About nine minutes a network on a 2-core machine (three swarms of 8 agents each, in slow motion: compute
scale 4, ``p2ptrain bench e2e --compute-scale``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from p2ptrain.bench.e2e import DEFAULT_OUT, DEFAULT_SETTING, E2EConfig, run_e2e
from p2ptrain.bench.e2e_report import format_reports, format_settings, write_results
from p2ptrain.lifecycle import StopSignal
from p2ptrain.planning import SCENARIOS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--compute-scale", type=float,
                        help="every device (and the network) this many times slower: the world in slow motion "
                             "(default: as far as the agents' compute needs to fit this machine's cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--networks", default=",".join(SCENARIOS), help="comma-separated scenario names")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where e2e.json, e2e.csv and e2e.png go")
    parser.add_argument("--workdir", help="keep the swarms' logs here (a folder per network and plan)")
    parser.add_argument("--settings", default=DEFAULT_SETTING,
                        help="WIRE/SCHEDULE/overlap|no-overlap, comma-separated; the plans use the first")
    parser.add_argument("--json", action="store_true", help="print the reports as one JSON document")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("p2ptrain.bench.e2e").setLevel(logging.INFO)
    reports = []
    with StopSignal() as stop:
        for name in args.networks.split(","):
            config = E2EConfig(scenario=name, agents=args.agents, stages=args.stages, steps=args.steps,
                               micro_batches=args.micro_batches, seed=args.seed, compute_scale=args.compute_scale,
                               settings=tuple(s.strip() for s in args.settings.split(",") if s.strip()),
                               workdir=str(Path(args.workdir) / name) if args.workdir else None)
            reports.append(run_e2e(config, stop))
            write_results(reports, Path(args.out), "e2e")  # after every network: a stopped run keeps what it did
    if args.json:
        print(json.dumps(reports))
    else:
        print(format_reports(reports))
        for report in reports:
            if len(report["settings"]) > 1:
                print("\n" + format_settings(report))
        print(f"wrote {args.out}/e2e.json, e2e.csv, e2e.png", file=sys.stderr)


if __name__ == "__main__":
    main()
