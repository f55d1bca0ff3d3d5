"""Seeded random clusters for differential tests: devices in random regions of the paper's world table."""

from __future__ import annotations

import numpy as np

from p2ptrain.planning.cluster import Cluster, Device
from p2ptrain.planning.scenarios import scenario_data
from p2ptrain.planning.workload import Workload

INTRA_LATENCY_MS, INTRA_BANDWIDTH_GBPS = 5.0, 2.0


def _world() -> tuple[list[str], dict[frozenset[str], tuple[float, float]]]:
    links = {
        frozenset((x["a"], x["b"])): (float(x["latency_ms"]), float(x["bandwidth_gbps"]))
        for x in scenario_data()["inter_region_links"]
    }
    return sorted({r for pair in links for r in pair}), links


def region_cluster(regions: list[str], rng: np.random.Generator, jitter: float = 0.0) -> Cluster:
    """Devices in the given regions (one entry per device), links from the paper's inter-region table.

    ``jitter`` > 0 multiplies every link by a random factor in [1 − jitter, 1 + jitter] (symmetrically),
    which makes every device distinct, as in a measured network.
    """
    _, links = _world()
    n = len(regions)
    latency, bandwidth = np.zeros((n, n)), np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            if regions[i] == regions[j]:
                lat, bw = INTRA_LATENCY_MS, INTRA_BANDWIDTH_GBPS
            else:
                lat, bw = links[frozenset((regions[i], regions[j]))]
            if jitter:
                lat, bw = lat * rng.uniform(1 - jitter, 1 + jitter), bw * rng.uniform(1 - jitter, 1 + jitter)
            latency[i, j] = latency[j, i] = lat
            bandwidth[i, j] = bandwidth[j, i] = bw
    devices = tuple(Device(name=f"{r}-{i}", region=r) for i, r in enumerate(regions))
    return Cluster(devices, latency, bandwidth)


def random_instance(seed: int, max_devices: int = 12, jitter: float = 0.0) -> tuple[Cluster, Workload, int]:
    """A cluster of ≤ ``max_devices`` devices in 2–5 regions of uneven sizes, shuffled; 2–6 stages;
    c_PP/c_DP log-uniform in [0.1, 10]."""
    rng = np.random.default_rng(seed)
    names, _ = _world()
    shapes = [(s, d) for s in range(2, 7) for d in range(1, max_devices // s + 1) if s * d >= 4]
    stages, replicas = shapes[int(rng.integers(len(shapes)))]
    n = stages * replicas
    k = int(rng.integers(2, min(5, n) + 1))
    chosen = rng.choice(names, size=k, replace=False)
    weights = rng.dirichlet(np.full(k, 0.7))  # uneven region sizes
    regions = list(rng.choice(chosen, size=n, p=weights))
    ratio = float(np.exp(rng.uniform(np.log(0.1), np.log(10.0))))
    gradient_gb = float(rng.uniform(0.2, 1.0))
    workload = Workload(activation_gb=ratio * gradient_gb, gradient_gb=gradient_gb)
    return region_cluster(regions, rng, jitter), workload, stages
