"""Idle cost of waiting agents: a bootstrap and N agents that expect one more peer (so they never plan), and
the CPU each kind of process takes over a window once their links are measured, and the memory (proportional
set size: pages shared between processes, such as the fork server's, split among them) an agent's processes hold.

    python benchmarks/idle_cpu.py [--agents 4] [--settle 20] [--window 20]

Measured on the 2-core dev machine (issue 28): 4 agents waiting for a fifth took 1.21 cores while the link
prober re-measured every link every round (before ``[links] refresh_s``), 0.23 cores after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

from p2ptrain.runtime.procgroup import ProcessGroup
from p2ptrain.swarm.agent_launcher import (
    AGENT_MODULES,
    LOOPBACK,
    SwarmConfig,
    _agent_toml,
    _prepare_agents,
    plan_swarm,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds before measuring (links measured)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="p2ptrain-idle-"))
    config = SwarmConfig(agents=args.agents + 1, stages=2, steps=5, scenario=None, workdir=str(root), run="idle")
    train, _, time_scale, size_factor = plan_swarm(config)
    agents = _prepare_agents(root, range(args.agents))
    with ProcessGroup(grace_s=15.0) as group:
        group.use_fork_server(AGENT_MODULES, log_path=root / "forkserver.log")
        announce = root / "bootstrap.maddrs"
        group.start("bootstrap", [sys.executable, "-m", "p2ptrain", "bootstrap", "--host-maddrs", LOOPBACK,
                                  "--announce-file", str(announce), "--run-id", "idle"], log_path=root / "bootstrap.log")
        deadline = time.monotonic() + 120
        while not announce.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"the bootstrap did not start; see {root / 'bootstrap.log'}")
            time.sleep(0.1)
        maddrs = announce.read_text().split()
        for agent in agents:
            agent.config_path.write_text(_agent_toml(config, train, "idle", maddrs, agent, root, None, time_scale,
                                                     size_factor))
            group.start(agent.name, [sys.executable, "-m", "p2ptrain", "agent", "--config", str(agent.config_path)],
                        log_path=agent.log_path, fork=True)
        print(f"settling {args.settle:.0f} s (links measured), then measuring {args.window:.0f} s ...", flush=True)
        time.sleep(args.settle)
        procs = {}
        for name, child in group.children.items():
            top = psutil.Process(child.pid)
            for p in [top, *top.children(recursive=True)]:
                kind = "p2pd" if "p2pd" in p.name() else ("main" if p.pid == top.pid else "dht")
                procs[("bootstrap" if name == "bootstrap" else "agents", kind, p.pid)] = p
        before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
        time.sleep(args.window)
        cores: dict[tuple[str, str], float] = {}
        for k, p in procs.items():
            try:
                used = sum(p.cpu_times()[:2]) - before[k]
            except psutil.Error:
                continue
            cores[k[:2]] = cores.get(k[:2], 0.0) + used / args.window
        memory = memory_by_kind(procs)
    for (who, kind), share in sorted(cores.items()):
        print(f"{who:9s} {kind:5s} {share:5.2f} cores  {memory.get((who, kind), 0.0) / 2**20:7.0f} MiB")
    agents_mib = sum(v for (who, _), v in memory.items() if who == "agents") / 2**20
    print(f"total     {sum(cores.values()):5.2f} cores ({args.agents} agents waiting; logs in {root})")
    print(f"memory an agent: {agents_mib / args.agents:.0f} MiB (main, DHT process and p2pd; proportional set size); "
          f"{args.agents} agents {agents_mib / 1024:.2f} GiB of {psutil.virtual_memory().total / 2**30:.0f} GiB, "
          f"64 agents alike {64 * agents_mib / args.agents / 1024:.1f} GiB")
    print_reads(root)


def memory_by_kind(procs: dict) -> dict[tuple[str, str], float]:
    """Bytes of proportional set size by (who, kind) over ``procs`` (as ``main`` collects them)."""
    out: dict[tuple[str, str], float] = {}
    for key, p in procs.items():
        try:
            out[key[:2]] = out.get(key[:2], 0.0) + p.memory_full_info().pss
        except psutil.Error:
            continue
    return out


def print_reads(root: Path) -> None:
    """The DHT reads an agent made a second, by record kind, between its first ``dht_traffic`` event (a minute
    in) and its last (as it stopped): the agents' own counters."""
    rates: dict[str, list[float]] = {}
    for path in sorted(root.glob("agent-*.events.jsonl")):
        traffic = [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "dht_traffic"]
        if len(traffic) < 2 or traffic[-1]["uptime_s"] - traffic[0]["uptime_s"] < 5:
            continue
        first, last = traffic[0], traffic[-1]
        span = last["uptime_s"] - first["uptime_s"]
        for kind, counts in last["kinds"].items():
            before = first["kinds"].get(kind, {}).get("reads", 0)
            rates.setdefault(kind, []).append((counts["reads"] - before) / span)
    if rates:
        print("DHT reads an agent a second: " + ", ".join(
            f"{kind} {sum(r) / len(r):.2f}" for kind, r in sorted(rates.items())) +
            f" (total {sum(sum(r) / len(r) for r in rates.values()):.2f}; {len(next(iter(rates.values())))} agents)")


if __name__ == "__main__":
    main()
