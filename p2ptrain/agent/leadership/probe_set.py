"""Whom each peer measures, from the run's records: the probe graph of ``planning.estimated``.

    partners = probe_set.partners(me, peers, config, plan)  # the prober's
    graph = probe_set.graph(peers, config)                  # the links the leader's first plan waits for

Shared by the link prober (its own partners: the graph's, plus its neighbours in the plan it follows) and the
leader and its followers (which links the first plan waits for: the graph's, never a plan's). A pure function
of the peer records, the run's name (the salt of the ring) and ``[links] partners``/``near_partners``, so every
agent derives the same graph from the same records.

A peer's labels (the rings it also joins, ``probe_graph``'s hints of whom to measure; never a link's value): its
region (``PeerRecord.region``) and its host (``host:`` and each address its record gives that is not loopback
nor a relay's circuit: the agents of one multi-GPU machine). An emulated device's are its region and its site
in the emulated network (``site:`` and its group of devices alike to all others, ``planning.link_clusters``: the
instance or region a real device's host and region would name).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from p2ptrain.agent.config import AgentConfig, EmulationSettings
from p2ptrain.net.dht.records import PeerRecord, PlanRecord
from p2ptrain.planning import link_clusters, load_cluster
from p2ptrain.planning.estimated import plan_pairs, probe_graph


def graph(peers: Mapping[str, PeerRecord], config: AgentConfig) -> dict[str, frozenset[str]]:
    """Every peer's partners in the run's probe graph (module docstring)."""
    links = config.links
    return probe_graph(peers, links.partners, config.run, labels(peers, config.emulation), links.near_partners)


def partners(me: str, peers: Mapping[str, PeerRecord], config: AgentConfig, plan: PlanRecord | None) -> set[str]:
    """The peers ``me`` measures: its partners in the graph of ``peers`` (``me`` among them), and its neighbours
    in ``plan`` (the stages before and after it in its pipeline, its stage's group) that are among ``peers``."""
    found = set(graph(peers, config).get(me, ()))
    if plan is not None and plan.position_of(me) is not None:
        rows = [[plan.peer_at(i, j) for j in range(plan.stages)] for i in range(plan.replicas)]
        found |= {q for pair in plan_pairs(rows) if me in pair for q in pair if q != me and q in peers}
    return found


def labels(peers: Mapping[str, PeerRecord], emulation: EmulationSettings) -> dict[str, tuple[str, ...]]:
    """Each peer's labels (module docstring)."""
    sites = _sites(emulation.cluster_file) if emulation.enabled and emulation.cluster_file else None
    out = {}
    for peer, record in peers.items():
        found = [f"region:{record.region}"] if record.region else []
        if sites is not None and record.emulated_device is not None and record.emulated_device < len(sites):
            found.append(f"site:{sites[record.emulated_device]}")
        else:
            found.extend(f"host:{host}" for host in sorted({_host(m) for m in record.maddrs} - {None}))
        out[peer] = tuple(found)
    return out


@functools.lru_cache(maxsize=4)
def _sites(cluster_file: str) -> np.ndarray:
    return link_clusters(load_cluster(cluster_file))


def _host(maddr: str) -> str | None:
    """The IP address of a multiaddress; None for loopback, a relay's circuit or no IP."""
    parts = maddr.split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    ip = parts[2]
    return None if ip.startswith("127.") or ip in ("::1", "0.0.0.0", "::") else ip
