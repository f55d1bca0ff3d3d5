"""Links measured in O(k) per peer: the planner on estimated links against the planner on the full matrix.

    python benchmarks/links.py [--devices 64,256] [--perturbation 0.1] [--rounds 3] [--json]

For each network (the paper's five and ``homes``) at each size: the network perturbed by ±``perturbation``
(``planning.measured.perturbed``: every link its own factor, device order shuffled) is the truth. The
full-matrix plan is the scheduler's plan of the truth. The estimated-link planner sees only the pairs of
the probe graph (``planning.estimated.probe_graph``, the agents' defaults: ``links.partners`` and
``links.near_partners``, each device labelled with its site as an emulated agent is, ``agent.leadership.
probe_set``), estimates the rest (``estimate_links``) and plans; then, as a swarm does between epochs, the
pairs its plan put next to each other are measured and it plans again (``--rounds`` plans in all). Every
plan is priced on the truth; the ratio to the full-matrix plan's cost is printed with the pairs measured
so far. The same CPU budget for every plan.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import click
import numpy as np

from p2ptrain.agent.config import LinksConfig
from p2ptrain.planning import PAPER_WORKLOAD, Plan, link_clusters, perturbed, scenario, schedule
from p2ptrain.planning.cost import DtfmObjective
from p2ptrain.planning.estimated import estimate_links, plan_pairs, probe_graph

NETWORKS = ("datacenter", "spot", "multi_dc", "regional", "worldwide", "homes")
STAGES = 8
BUDGET_S = {64: 5.0, 256: 60.0}  # CPU seconds a plan, by devices (others: 60, the agents' default)


def _plan(cluster: Any, budget_s: float, seed: int) -> np.ndarray:
    plan = schedule(cluster, PAPER_WORKLOAD, STAGES, seed=seed, time_budget_s=budget_s, clock=time.process_time)
    assert isinstance(plan, Plan), plan
    return np.array(plan.pipelines)


def run_network(name: str, devices: int, level: float, rounds: int, seed: int) -> dict[str, Any]:
    """One network: the full-matrix plan, then ``rounds`` plans on estimated links, all priced on the truth."""
    exact = scenario(name, devices)
    truth, order = perturbed(exact, level, np.random.default_rng(seed)) if level else (exact, np.arange(devices))
    sites = link_clusters(exact)[order]  # what an emulated device's labels say (``probe_set.labels``)
    names = [d.name for d in truth.devices]
    index = {p: k for k, p in enumerate(names)}
    links = LinksConfig()
    graph = probe_graph(names, links.partners, f"bench-{seed}", {p: (f"site:{sites[k]}",) for k, p in enumerate(names)},
                        links.near_partners)
    measured = np.zeros((devices, devices), dtype=bool)
    for p, partners in graph.items():
        measured[index[p], [index[q] for q in partners]] = True
    objective = DtfmObjective(truth, PAPER_WORKLOAD, STAGES)
    budget_s = BUDGET_S.get(devices, 60.0)
    full_s = objective.evaluate(_plan(truth, budget_s, seed)).cost_s
    other_seed_s = objective.evaluate(_plan(truth, budget_s, seed + 1)).cost_s  # the search's own spread
    steps = []
    for _ in range(rounds):
        estimate = estimate_links(truth.latency_ms, truth.bandwidth_gbps, measured)
        seen = dataclasses.replace(truth, latency_ms=estimate.latency_ms, bandwidth_gbps=estimate.bandwidth_gbps,
                                   groups=estimate.groups)
        pipelines = _plan(seen, budget_s, seed)
        steps.append({"measured_pairs": int(np.triu(measured, 1).sum()),
                      "plan_s": objective.evaluate(pipelines).cost_s})
        for pair in plan_pairs(pipelines.tolist()):
            a, b = tuple(pair)
            measured[a, b] = measured[b, a] = True
    return {"network": name, "devices": devices, "perturbation": level, "seed": seed, "full_s": full_s,
            "full_other_seed_s": other_seed_s,
            "pairs": devices * (devices - 1) // 2, "budget_cpu_s": budget_s, "rounds": steps}


def format_rows(rows: list[dict[str, Any]]) -> str:
    rounds = max(len(r["rounds"]) for r in rows)
    head = f"{'network':<11} {'N':>4} {'pairs':>6} {'full s':>8} {'seed+1':>6}  " + "  ".join(
        f"{'plan ' + str(k + 1) + ': measured':>18} {'ratio':>6}" for k in range(rounds))
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "  ".join(f"{s['measured_pairs']:>8} ({s['measured_pairs'] / r['pairs']:5.1%}) {s['plan_s'] / r['full_s']:6.3f}"
                          for s in r["rounds"])
        lines.append(f"{r['network']:<11} {r['devices']:>4} {r['pairs']:>6} {r['full_s']:8.3f} "
                     f"{r['full_other_seed_s'] / r['full_s']:6.3f}  {cells}")
    r = rows[0]
    lines.append(f"ratio: the plan's cost on the true links over the full-matrix plan's (seed+1: the full-matrix plan "
                 f"of another seed, the search's own spread); truth: every link ×U[{1 - r['perturbation']:g}, "
                 f"{1 + r['perturbation']:g}] (seed {r['seed']}), devices shuffled; {STAGES} stages; plan k+1 adds "
                 f"the pairs plan k put next to each other; CPU budget a plan {', '.join(f'{n}: {b:g} s' for n, b in BUDGET_S.items())}")
    return "\n".join(lines)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--devices", default="64,256", show_default=True, help="Network sizes, comma-separated.")
@click.option("--networks", default=",".join(NETWORKS), show_default=True, help="Networks, comma-separated.")
@click.option("--perturbation", default=0.1, show_default=True, type=click.FloatRange(0, 0.99),
              help="Every link's factor is uniform in [1 - this, 1 + this].")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Plans on estimated links.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def command(devices: str, networks: str, perturbation: float, rounds: int, seed: int, as_json: bool) -> None:
    sizes = [int(x) for x in devices.split(",") if x.strip()]
    names = [x.strip() for x in networks.split(",") if x.strip()]
    unknown = sorted(set(names) - set(NETWORKS))
    if unknown:
        raise click.BadParameter(f"unknown network(s) {', '.join(unknown)} (choose from {', '.join(NETWORKS)})")
    rows = []
    for n in sizes:
        for name in names:
            click.echo(f"… {name} at {n} devices", err=True)
            rows.append(run_network(name, n, perturbation, rounds, seed))
    click.echo(json.dumps(rows, indent=1) if as_json else format_rows(rows))


if __name__ == "__main__":
    command()
