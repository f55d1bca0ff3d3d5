"""How many transfers a link measurement spends, and how close it comes, when a busy machine delays its samples:
the tolerance that grows past ``transfers`` (``net.transport.probe.tolerance``) beside a fixed one, side by side.

    python benchmarks/probe_agreement.py [--seeds 300] [--shares 0.3,0.6,0.8]

A modelled link (5 ms, 20 Mbit/s; no network, no clock: the measurement's own code, ``ameasure_session``, on a
session whose samples arrive α + n/β after they are sent) where a share of all one-way trips is late by a draw
from 0 to 100 ms (against a transfer of 0.15 s: a loaded two-core machine's scheduling delays). Per share and
rule: the mean and 90th percentile of transfers spent, the measurements flagged as disagreeing, and the
bandwidth's error (median and worst over the seeds). The swarm's emulated probe (``EMULATED_PROBE``) is the
configuration; ``fixed`` is it with ``agreement_growth`` 1 (the rule before).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
from types import SimpleNamespace

from p2ptrain.net.transport.probe import ameasure_session
from p2ptrain.net.transport.probe_session import RoundTrip
from p2ptrain.swarm.agent_launcher import EMULATED_PROBE

LATENCY_S, BANDWIDTH_BYTES_PER_S = 0.005, 2.5e6


class _Session:
    def __init__(self, late):
        self.peer = "model"
        self.transport = SimpleNamespace(config=SimpleNamespace(call_timeout_s=5.0))
        self.late, self.transfers = late, 0

    async def roundtrip(self, request_bytes: int, reply_bytes: int = 0, timeout_s: float | None = None) -> RoundTrip:
        self.transfers += request_bytes > 0
        there_s = LATENCY_S + request_bytes / BANDWIDTH_BYTES_PER_S + self.late()
        return RoundTrip(there_s + LATENCY_S + self.late(), there_s, same_clock=True)


def _late(seed: int, share: float):
    rng = random.Random(seed)
    return lambda: rng.uniform(0.0, 0.100) if rng.random() < share else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--shares", default="0.3,0.6,0.8")
    args = parser.parse_args()
    rules = {"fixed": dataclasses.replace(EMULATED_PROBE, agreement_growth=1.0), "growing": EMULATED_PROBE}
    truth_gbps = BANDWIDTH_BYTES_PER_S * 8 / 1e9
    print(f"{'late share':>10} {'rule':>8} {'transfers mean':>14} {'p90':>4} {'disagreed':>9} "
          f"{'bw error median':>15} {'worst':>7}")
    for share in (float(s) for s in args.shares.split(",")):
        means = {}
        for name, config in rules.items():
            spent, errors, disagreed = [], [], 0
            for seed in range(args.seeds):
                session = _Session(_late(seed, share))
                estimate = asyncio.run(ameasure_session(session, config))
                spent.append(session.transfers)
                errors.append(abs(estimate.bandwidth_gbps / truth_gbps - 1))
                disagreed += not estimate.agreed
            means[name] = statistics.mean(spent)
            print(f"{share:>10.1f} {name:>8} {means[name]:>14.2f} {sorted(spent)[int(0.9 * len(spent))]:>4} "
                  f"{disagreed:>9} {statistics.median(errors):>14.2%} {max(errors):>7.1%}")
        print(f"{'':>10} transfers spent, growing / fixed: {means['growing'] / means['fixed']:.2f}")


if __name__ == "__main__":
    main()
