"""The control plane's cost per peer: a model of each agent's DHT and control traffic a minute, from a local
swarm's own counters, at that swarm's size and at 64, 256 and 1,000 peers.

    p2ptrain swarm --agents 8 --stages 2 --steps 30 --workdir /tmp/cp8
    python benchmarks/control_plane.py /tmp/cp8 [--sizes 64,256,1000] [--json]

The swarm's agents count every DHT call by record kind and every ping and probe round trip
(``net.dht.counters``, ``net.transport.counters``; their last ``dht_traffic`` event). The model keeps what the
code fixes and scales what grows with the run (``Model.at``):

- calls a minute per kind stay as measured (each poll reads each kind once, each refresh stores once: the
  rates are the agents' periods, ``membership.poll_s``, ``dht.*_ttl_s``, the standing reads), the median
  agent's; or, with ``--poll-s``, reads at the rates the periods ask for (an upper bound: on a loaded machine
  a poll comes late, and a swarm of 8 agents on 2 cores read about half as often as one of 4);
- a follower reads the ``peers`` and ``plan`` records when its leader's heartbeat answers say they changed
  (``PeerStatus.peers``, ``plan``) and every ``PEERS_READ_S`` / ``PLANS_READ_S`` besides (with ``--poll-s``: at
  those periods, a run where nothing changes); the leader reads them every poll: the ``leader`` rows;
- a follower in a run of n > r = ``membership.read_all_up_to`` peers reads the ``peers``, ``plan`` and
  ``progress`` records n / r times less often, at least once a ``dht.peer_ttl_s`` (``agent.membership_reader``);
- the bytes of a read grow with the records the kind holds: one per peer for ``peers``, ``links`` and
  ``progress`` (a read returns every subkey); a ``plan`` read returns the plan heads (``net.dht.plan_store``:
  about 100 bytes a signer) and a plan's parts only once per epoch, so it stays as measured; a store's bytes are
  one record (a links row grows with the partners, not the run: ``links.partners``);
- pings a minute: every other member while the run has at most ``liveness.watch_all_up_to``, beyond that the
  peers of one's pipeline, the ring fingers of one's stage group (``membership_reader.group_fingers``: O(log) of
  it) and the two first in standing (the leader and the next in line ping everyone);
- probe round trips: a partner's link takes as many as measured, and the partners are bounded
  (``probe_set``), so they do not grow with the run.

A read whose value is over ``DHT_VALUE_LIMIT`` (4 MiB: a DHT reply is one unary libp2p message) is flagged.
(The "~64 KiB" once believed the DHT's limit was a store of over 16 KiB into the DHT process, which could
desync its pipe: ``net.dht.pipe_fix``; replies come back on another channel, and reads of 400 kB were seen
to work.) Checked against a swarm by fitting at one size and comparing with a run at another (``--check``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from p2ptrain.agent.config import MembershipConfig
from p2ptrain.agent.leadership.following import PLANS_READ_S, STANDING_READ_S
from p2ptrain.agent.membership_reader import PEERS_READ_S, group_fingers
from p2ptrain.net.dht.node import DHTConfig

DHT_VALUE_LIMIT = 4 << 20
SPACED = ("peers", "plan", "progress")  # what a follower in a large run reads less often
KINDS = ("peers", "links", "plan", "progress")


@dataclass(frozen=True)
class Measured:
    """One swarm's median agent, per minute of its uptime."""

    agents: int
    stages: int
    replicas: int
    partners: float  # peers in a links row (median)
    reads: dict[str, float]  # reads a minute, per kind
    stores: dict[str, float]
    read_bytes: dict[str, float]  # bytes of one read
    store_bytes: dict[str, float]  # bytes of one store
    pings: float  # pings a minute
    ping_bytes: float  # bytes of one ping and its answer
    probes: float  # probe round trips a minute
    probe_bytes: float  # bytes of one probe round trip


def _per_minute(event: dict[str, Any]) -> dict[str, float]:
    minutes = event["uptime_s"] / 60.0
    out = {}
    for kind in KINDS:
        row = event["kinds"].get(kind, {})
        out[f"reads:{kind}"] = row.get("reads", 0) / minutes
        out[f"stores:{kind}"] = row.get("stores", 0) / minutes
        out[f"read_bytes:{kind}"] = row.get("read_bytes", 0) / max(row.get("reads", 0), 1)
        out[f"store_bytes:{kind}"] = row.get("store_bytes", 0) / max(row.get("stores", 0), 1)
    control = event.get("control") or {}
    out["pings"] = control.get("ping", {}).get("calls", 0) / minutes
    out["ping_bytes"] = control.get("ping", {}).get("bytes", 0) / max(control.get("ping", {}).get("calls", 0), 1)
    out["probes"] = control.get("probe", {}).get("calls", 0) / minutes
    out["probe_bytes"] = control.get("probe", {}).get("bytes", 0) / max(control.get("probe", {}).get("calls", 0), 1)
    return out


def measure(workdir: Path) -> Measured:
    """The median agent of the swarm in ``workdir`` (its agents' events files; the shape from its leader's last
    plan event)."""
    rates, rows, shape = [], [], (1, 1)
    for path in sorted(workdir.glob("agent-*.events.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        plans = [e["plan"] for e in events if e["event"] == "plan"]
        if plans:
            shape = (int(plans[-1]["stages"]), int(plans[-1]["replicas"]))
        traffic = [e for e in events if e["event"] == "dht_traffic" and e["uptime_s"] > 0]
        if traffic:
            rates.append(_per_minute(traffic[-1]))
        links = [e for e in events if e["event"] == "links"]
        if links:
            rows.append(len(links[-1]["row"]))
    if not rates:
        raise click.ClickException(f"{workdir}: no agent wrote a dht_traffic event (run a swarm there first)")
    median = {key: statistics.median(r[key] for r in rates) for key in rates[0]}
    return Measured(
        agents=len(rates), stages=shape[0], replicas=shape[1],
        partners=statistics.median(rows) if rows else 0.0,
        reads={k: median[f"reads:{k}"] for k in KINDS}, stores={k: median[f"stores:{k}"] for k in KINDS},
        read_bytes={k: median[f"read_bytes:{k}"] for k in KINDS},
        store_bytes={k: median[f"store_bytes:{k}"] for k in KINDS},
        pings=median["pings"], ping_bytes=median["ping_bytes"], probes=median["probes"], probe_bytes=median["probe_bytes"])


def ping_targets(n: int, stages: int, replicas: int, watch_all_up_to: int = 32) -> float:
    """Peers a follower pings (``MembershipReader._watch_targets``)."""
    if n - 1 <= watch_all_up_to:
        return float(n - 1)
    # the leader and the next, its pipeline neighbours, its replica group's ring fingers
    return float(min(n - 1, 2 + 2 + len(group_fingers(0, replicas))))


def period_reads(m: Measured, poll_s: float | None, leader: bool = False) -> dict[str, float]:
    """Reads a minute per kind: with ``poll_s``, what the agents' periods ask for (the leader's ``peers`` and
    ``plan`` every poll, a follower's every ``PEERS_READ_S`` and ``PLANS_READ_S``; ``progress`` every
    ``STANDING_READ_S``; ``links`` as measured: only while a plan waits for rows), an upper bound of a loaded
    machine's (a poll that takes longer than its period comes late); without, as measured."""
    if poll_s is None:
        return dict(m.reads)
    peers_s, plan_s = (poll_s, poll_s) if leader else (PEERS_READ_S, PLANS_READ_S)
    return {"peers": 60.0 / peers_s, "plan": 60.0 / plan_s, "progress": 60.0 / STANDING_READ_S, "links": m.reads["links"]}


def model(m: Measured, n: int, poll_s: float | None = None, leader: bool = False) -> dict[str, Any]:
    """Per agent a minute at ``n`` peers, scaled from ``m`` (module docstring): a follower of a plan, or the
    ``leader``."""
    grow = n / m.agents
    read_bytes = {k: m.read_bytes[k] * (grow if k != "plan" else 1.0) for k in KINDS}  # a record per peer
    reads = period_reads(m, poll_s, leader)
    membership, ttl_s = MembershipConfig(expect=1), DHTConfig().peer_ttl_s
    if not leader and n > membership.read_all_up_to:
        for k in SPACED:  # n / r times less often, at least once a record lifetime
            reads[k] = max(reads[k] * membership.read_all_up_to / n, min(reads[k], 60.0 / ttl_s))
    replicas = max(1, n // max(m.stages, 1))
    targets = float(n - 1) if leader else ping_targets(n, m.stages, replicas)
    pings = m.pings * targets / max(ping_targets(m.agents, m.stages, m.replicas), 1.0)
    out = {
        "peers": n,
        "reads_per_min": sum(reads.values()), "stores_per_min": sum(m.stores.values()),
        "read_kb_per_min": sum(reads[k] * read_bytes[k] for k in KINDS) / 1e3,
        "store_kb_per_min": sum(m.stores[k] * m.store_bytes[k] for k in KINDS) / 1e3,
        "largest_read_kb": max(read_bytes.values()) / 1e3,
        "over_limit": sorted(k for k in KINDS if read_bytes[k] > DHT_VALUE_LIMIT),
        "pings_per_min": pings, "ping_kb_per_min": pings * m.ping_bytes / 1e3,
        "probes_per_min": m.probes, "probe_mb_per_min": m.probes * m.probe_bytes / 1e6,
        "by_kind_read_kb": {k: read_bytes[k] / 1e3 for k in KINDS},
    }
    return out


def measured_row(m: Measured) -> dict[str, Any]:
    """The same quantities as ``model``, as measured."""
    return {
        "peers": m.agents, "reads_per_min": sum(m.reads.values()), "stores_per_min": sum(m.stores.values()),
        "read_kb_per_min": sum(m.reads[k] * m.read_bytes[k] for k in KINDS) / 1e3,
        "store_kb_per_min": sum(m.stores[k] * m.store_bytes[k] for k in KINDS) / 1e3,
        "largest_read_kb": max(m.read_bytes.values()) / 1e3, "over_limit": [],
        "pings_per_min": m.pings, "ping_kb_per_min": m.pings * m.ping_bytes / 1e3,
        "probes_per_min": m.probes, "probe_mb_per_min": m.probes * m.probe_bytes / 1e6,
        "by_kind_read_kb": {k: m.read_bytes[k] / 1e3 for k in KINDS},
    }


def format_rows(rows: list[tuple[str, dict[str, Any]]]) -> str:
    head = (f"{'':<22} {'peers':>6} {'reads/min':>9} {'read kB/min':>11} {'largest read':>12} {'stores/min':>10} "
            f"{'store kB/min':>12} {'pings/min':>9} {'probes/min':>10} {'probe MB/min':>12}")
    lines = [head, "-" * len(head)]
    for label, r in rows:
        over = f"  over {DHT_VALUE_LIMIT >> 20} MiB: {', '.join(r['over_limit'])}" if r["over_limit"] else ""
        lines.append(f"{label:<22} {r['peers']:>6} {r['reads_per_min']:9.0f} {r['read_kb_per_min']:11.0f} "
                     f"{r['largest_read_kb']:10.1f}kB {r['stores_per_min']:10.1f} {r['store_kb_per_min']:12.1f} "
                     f"{r['pings_per_min']:9.0f} {r['probes_per_min']:10.1f} {r['probe_mb_per_min']:12.2f}{over}")
    lines.append("per agent a minute, the median agent's rates over its run; reads return every subkey of a kind "
                 "(peers, links, progress: one per peer), so their bytes grow with the run; a follower reads peers, "
                 "plan and progress n / read_all_up_to times less often (leader rows: every poll)")
    return "\n".join(lines)


@click.command(help=__doc__.split("\n\n")[0])
@click.argument("workdir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--sizes", default="64,256,1000", show_default=True, help="Run sizes to model, comma-separated.")
@click.option("--check", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A swarm of another size: the model from WORKDIR beside what it measured.")
@click.option("--poll-s", type=click.FloatRange(0, min_open=True), default=None,
              help="Reads a minute from the agents' poll period (the local swarm's: 0.5; an agent's default: 1.0) "
                   "instead of as measured.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def command(workdir: Path, sizes: str, check: Path | None, poll_s: float | None, as_json: bool) -> None:
    base = measure(workdir)
    rows = [(f"measured ({workdir.name})", measured_row(base))]
    if check is not None:
        other = measure(check)
        rows += [(f"model at {other.agents}", model(base, other.agents, poll_s)),
                 (f"measured ({check.name})", measured_row(other))]
    for n in (int(x) for x in sizes.split(",") if x.strip()):
        rows += [(f"model at {n}", model(base, n, poll_s)), (f"model at {n}, leader", model(base, n, poll_s, True))]
    click.echo(json.dumps([{"row": label, **r} for label, r in rows], indent=1) if as_json else format_rows(rows))


if __name__ == "__main__":
    command()
