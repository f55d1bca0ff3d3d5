"""How close a finished local swarm's link measurements came to the emulated network they measured.

    python benchmarks/probe_accuracy.py WORKDIR [WORKDIR ...]

Per workdir (``p2ptrain swarm --workdir``): every measurement an agent logged ("link to peer …"), against the
emulated link between the two agents' devices (``cluster.json``, in the units the agents measure: latency × the
time scale, bandwidth × the size factor / the time scale); the bandwidth's relative error and the latency's
absolute one in the network's own milliseconds (an emulated 0.1 ms within a region is 5 µs at a time scale of
0.05: a relative error there says nothing), median, 90th percentile and worst; the measurements' seconds and
transfers. Figures: benchmarks/README.md,
"Links at scale".
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import tomllib

LINE = re.compile(r"link to peer (\w+): ([\d.]+) ms, ([\d.]+) Gbit/s \((\d+) round trips, (\d+) transfers.*, ([\d.]+) s\)")


def _quantiles(values: list[float], unit: str = "%") -> str:
    ordered = sorted(values)
    shown = (lambda v: f"{v:.2%}") if unit == "%" else (lambda v: f"{v:.2f} {unit}")
    return (f"median {shown(statistics.median(ordered))}  p90 {shown(ordered[int(0.9 * (len(ordered) - 1))])}  "
            f"worst {shown(ordered[-1])}")


def accuracy(workdir: Path) -> dict:
    swarm = json.loads((workdir / "swarm.json").read_text())
    cluster = json.loads((workdir / "cluster.json").read_text())
    device, scale = {}, None
    for agent in swarm["agents"]:
        toml = tomllib.loads((workdir / f"agent-{agent['index']}.toml").read_text())
        emulation = toml["emulation"]
        device[agent["peer_id"]] = emulation["device_index"]
        scale = (emulation["time_scale"], emulation["size_factor"])
    time_scale, size_factor = scale
    latency_errors, bandwidth_errors, seconds, transfers = [], [], [], []
    for agent in swarm["agents"]:
        me = device[agent["peer_id"]]
        for match in LINE.finditer((workdir / f"agent-{agent['index']}.log").read_text(errors="replace")):
            peer, ms, gbps, _, count, took = match.groups()
            if peer not in device:
                continue
            other = device[peer]
            true_ms = cluster["latency_ms"][me][other] * time_scale
            true_gbps = cluster["bandwidth_gbps"][me][other] * size_factor / time_scale
            latency_errors.append(abs(float(ms) - true_ms) / time_scale)
            bandwidth_errors.append(abs(float(gbps) / true_gbps - 1))
            seconds.append(float(took))
            transfers.append(int(count))
    return {"latency": latency_errors, "bandwidth": bandwidth_errors, "seconds": seconds, "transfers": transfers}


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        found = accuracy(Path(arg))
        if not found["seconds"]:
            print(f"{arg}: no measurements logged")
            continue
        print(f"{arg}: {len(found['seconds'])} measurements, {statistics.mean(found['seconds']):.2f} s and "
              f"{statistics.mean(found['transfers']):.1f} transfers each on average")
        print(f"  latency error    {_quantiles(found['latency'], 'ms')} (the network's own)")
        print(f"  bandwidth error  {_quantiles(found['bandwidth'])}")


if __name__ == "__main__":
    main()
